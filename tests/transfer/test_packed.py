"""Weights packed as their pool entry's data file (spswap.transfer.packed), on CPU: the
model rebound to views of one block reads the same weights, tied weights stay tied, and
a packed copy moves the whole entry in one copy. The vLLM side (the block made in vLLM's
sleep-mode pool, the old allocations released) is tests/engines/test_vllm.py's GPU test.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spswap.engines.vllm_weights import weight_tensors  # noqa: E402
from spswap.errors import TransferError  # noqa: E402
from spswap.transfer.copy import copy_into  # noqa: E402
from spswap.transfer.mapping import MappedEntry  # noqa: E402
from spswap.transfer.packed import pack_into, packed_target, rebind, tensor_key  # noqa: E402

from .conftest import write_entry  # noqa: E402


class Tiny(torch.nn.Module):
    """Parameters of several dtypes, a tied head, a persistent and a scratch buffer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter in two modules
        self.norm = torch.nn.Parameter(torch.randn(6, generator=g).to(torch.bfloat16))
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(ids)) * self.norm.float() * self.scale[1]
        return self.head(h)


def _entry(pool, model: torch.nn.Module):
    # (write_entry reads host memory: a CUDA model's weights are copied to the host)
    return write_entry(pool, "tiny", {n: t.cpu().clone() for n, t in weight_tensors(model).items()})


def test_a_packed_model_reads_the_same_weights_from_one_block(pool) -> None:
    model = Tiny()
    ids = torch.tensor([[1, 5, 9]])
    want = model(ids).detach()
    m = _entry(pool, model)
    params = weight_tensors(model)
    assert packed_target(m, params) is None  # apart, as a model loads
    block = torch.empty(m.data_size_bytes, dtype=torch.uint8)
    assert pack_into(model, m, params, block) == len(params)  # head.weight: once, same object
    del params
    assert model.head.weight is model.embed.weight  # still tied
    packed = weight_tensors(model)
    assert set(packed) == {"embed.weight", "proj.weight", "proj.bias", "norm", "scale"}
    found = packed_target(m, packed)
    assert found is not None and found.data_ptr() == block.data_ptr()
    assert found.numel() == m.data_size_bytes
    offsets = {e.name: e.offset for e in m.tensors}
    for name, t in packed.items():
        assert t.data_ptr() == block.data_ptr() + offsets[name], name
    assert model.scratch.data_ptr() != block.data_ptr()  # not in the entry: left alone
    assert torch.equal(model(ids), want)


def test_a_packed_copy_moves_the_whole_entry_at_once(pool) -> None:
    model = Tiny()
    m = _entry(pool, model)
    block = torch.empty(m.data_size_bytes, dtype=torch.uint8)
    pack_into(model, m, weight_tensors(model), block)
    want = {n: t.clone() for n, t in weight_tensors(model).items()}
    block.zero_()
    with MappedEntry(m, pool.data_path(m)) as mapping:
        report = copy_into(mapping, weight_tensors(model), packed_into=block)
        assert report.size_bytes == sum(e.size_bytes for e in m.tensors)
        for name, t in weight_tensors(model).items():
            assert torch.equal(t, want[name]), name
        with pytest.raises(TransferError, match="contiguous uint8 block"):
            copy_into(mapping, weight_tensors(model), packed_into=block[1:])


def test_packed_target_refuses_any_tensor_off_its_place(pool) -> None:
    model = Tiny()
    m = _entry(pool, model)
    block = torch.empty(m.data_size_bytes, dtype=torch.uint8)
    pack_into(model, m, weight_tensors(model), block)
    params = weight_tensors(model)
    assert packed_target(m, params) is not None
    moved = dict(params, norm=params["norm"].clone())  # one tensor elsewhere
    assert packed_target(m, moved) is None
    assert packed_target(m, {k: v for k, v in params.items() if k != "scale"}) is None
    # at its place but seen as another size (a view over part of it)
    assert packed_target(m, dict(params, scale=params["scale"][:1])) is None


def test_rebind_follows_two_parameters_over_the_same_memory() -> None:
    a = torch.nn.Linear(2, 2, bias=False)
    b = torch.nn.Linear(2, 2, bias=False)
    b.weight = torch.nn.Parameter(a.weight.data)  # two objects, one memory
    model = torch.nn.Sequential(a, b)
    new = torch.ones(2, 2)
    assert rebind(model, {tensor_key(a.weight): new}) == 2
    assert a.weight.data_ptr() == b.weight.data_ptr() == new.data_ptr()
    assert isinstance(a.weight, torch.nn.Parameter)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_a_packed_copy_on_cuda_is_exact_pulled_or_copied(pool) -> None:
    """The packed copy on the GPU: one host copy, one pulling kernel, or a 4 KiB-aligned
    share pulled then the rest copied; every byte as in the pool."""
    model = Tiny().cuda()
    m = _entry(pool, model)
    block = torch.empty(m.data_size_bytes, dtype=torch.uint8, device="cuda")
    pack_into(model, m, weight_tensors(model), block)
    want = {n: t.clone() for n, t in weight_tensors(model).items()}
    with MappedEntry(m, pool.data_path(m)) as mapping:
        mapping.register_cuda()
        for pull in (0.0, 0.37, 1.0):
            block.zero_()
            copy_into(mapping, weight_tensors(model), packed_into=block, pull=pull)
            for name, t in weight_tensors(model).items():
                assert torch.equal(t, want[name]), (name, pull)
