"""spswap.engines.vllm_pack on CPU. vLLM's sleep-mode allocator cannot run here, so a
stand-in plays its bookkeeping (``pointer_to_data``, ``allocator_and_pools``,
``use_memory_pool``, the free callback) with the same shapes; the model, its weights and
the rebinding are real. The real allocator: tests/engines/test_vllm.py's GPU test of
``VllmEngine.pack``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from spswap.engines.vllm_pack import KEPT_POOL_KEY, MARGIN_BYTES, SlotRoom, pack_weights  # noqa: E402
from spswap.engines.vllm_weights import host_bytes, weight_tensors  # noqa: E402
from spswap.pool.store import Pool  # noqa: E402
from spswap.transfer.dtypes import to_safetensors  # noqa: E402
from spswap.transfer.packed import packed_target  # noqa: E402

from .test_vllm import _Tiny  # noqa: E402  (ties, a 0-dim weight, both kinds of buffer)


def _entry(tmp_path, model: torch.nn.Module):  # type: ignore[no-untyped-def]
    """A real pool entry of ``model``'s weights (as the worker's export writes it)."""
    with Pool(tmp_path / "pool").writer("tiny") as w:
        for name, t in sorted(weight_tensors(model).items()):
            w.add(name, to_safetensors(t.dtype), tuple(t.shape), host_bytes(t))
    return w.manifest


@dataclass
class _Data:
    handle: tuple[int, int, int, Any]
    tag: str


class _Pool:
    def __init__(self, segments: list[dict[str, int]]) -> None:
        self.segments = segments

    def snapshot(self) -> list[dict[str, int]]:
        return self.segments


class _Allocator:
    """vLLM's CuMemAllocator's bookkeeping as pack_weights uses it."""

    def __init__(self) -> None:
        # the load's pool: three weight segments, two now unused after packing would
        # free them, one still used by something else; one KV cache segment
        self.pointer_to_data = {1000: _Data((0, 64, 1000, "h1"), "weights"),
                                2000: _Data((0, 64, 2000, "h2"), "weights"),
                                3000: _Data((0, 64, 3000, "h3"), "weights"),
                                9000: _Data((0, 64, 9000, "h9"), "kv_cache")}  # fmt: skip
        self.loaded = _Pool([])
        self.allocator_and_pools: dict[str, Any] = {"weights": (self.loaded, None)}
        self.tags: list[str] = []

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str):  # type: ignore[no-untyped-def]
        self.tags.append(tag)
        self.allocator_and_pools[tag] = (_Pool([]), None)  # a new pool, as vLLM makes
        self.pointer_to_data[5000] = _Data((0, 64, 5000, "block"), tag)
        yield
        # after the block: the load's segments as torch's snapshot would show them
        # (4000: free but not vLLM's any more, released earlier: left alone)
        self.loaded.segments = [{"address": 1000, "allocated_size": 0},
                                {"address": 2000, "allocated_size": 0},
                                {"address": 3000, "allocated_size": 64},
                                {"address": 4000, "allocated_size": 0}]  # fmt: skip

    def _python_free_callback(self, address: int) -> tuple[int, int, int, Any]:
        return self.pointer_to_data.pop(address).handle


def test_pack_weights_rebinds_the_model_and_releases_the_loads_unused_segments(
    tmp_path,
) -> None:
    model = _Tiny()
    want = {n: t.clone() for n, t in weight_tensors(model).items()}
    m = _entry(tmp_path, model)
    alloc, released = _Allocator(), []
    params = dict(weight_tensors(model))
    old = [StorageWeakRef(t.untyped_storage()) for t in params.values()]
    report, block = pack_weights(model, m, params, allocator=alloc, release=released.append,
                                 free_bytes=1 << 40, cuda_graphs=False)  # fmt: skip
    assert block is not None and report["packed"] and alloc.tags == ["weights"]
    assert params == {}  # the caller's references to the old tensors: dropped
    assert all(ref.expired() for ref in old)  # nothing keeps the old memory: it can go
    assert report["tensors"] == 5 and report["rebound"] == 5
    assert released == [(0, 64, 1000, "h1"), (0, 64, 2000, "h2")]  # not 3000: in use
    assert report["released"] == 2 and report["left_in_load_pool_bytes"] == 64
    assert report["before"] == {"weights": 3, "kv_cache": 1}
    assert report["after"] == {"weights": 2, "kv_cache": 1}  # 3000 and the block
    assert alloc.allocator_and_pools[KEPT_POOL_KEY][0] is alloc.loaded
    found = packed_target(m, weight_tensors(model))
    assert found is not None and found.data_ptr() == block.data_ptr()
    assert model.head.weight is model.embed.weight  # still tied
    packed = weight_tensors(model)
    assert all(torch.equal(packed[n], want[n]) for n in want), "the same weights"
    assert model.cache.data_ptr() != block.data_ptr()  # not in the entry: left alone


GIB = 1 << 30


@pytest.mark.parametrize(
    ("free_bytes", "room", "graphs", "max_bytes", "why"),
    [(1 << 40, None, True, None, "CUDA graphs"),
     (MARGIN_BYTES, None, False, None, "256.0 MiB free on the GPU, "),
     (1 << 40, SlotRoom(10 * GIB, 10 * GIB - MARGIN_BYTES, True), False, None,
      "the slot's 10.0 GiB leave 256.0 MiB beyond the 9.8 GiB the engine holds, "),
     (1 << 40, None, False, 64, "the weights are 20.0 KiB, over spswap serve's 64 B limit for "
      "packing: packed, a 7B's swap took ~21 ms longer, docs/benchmarks.md section 2")],
)  # fmt: skip
def test_pack_weights_leaves_the_model_alone_where_it_may_not_pack(
    tmp_path,
    free_bytes: int,
    room: SlotRoom | None,
    graphs: bool,
    max_bytes: int | None,
    why: str,
) -> None:
    model = _Tiny()
    before = {n: t.data_ptr() for n, t in weight_tensors(model).items()}
    m = _entry(tmp_path, model)
    alloc, released = _Allocator(), []
    report, block = pack_weights(model, m, dict(weight_tensors(model)), allocator=alloc,
                                 release=released.append, free_bytes=free_bytes,
                                 room=room, cuda_graphs=graphs, max_bytes=max_bytes)  # fmt: skip
    assert block is None and not report["packed"] and why in report["why"]
    if room is not None:  # the figures it judged by, for the run's record
        assert report["room"] == room.to_json()
    assert alloc.tags == [] and released == []
    assert {n: t.data_ptr() for n, t in weight_tensors(model).items()} == before


def test_pack_weights_packs_once_and_gives_the_pool_back_on_an_error(tmp_path) -> None:
    model = _Tiny()
    m = _entry(tmp_path, model)
    alloc, released = _Allocator(), []
    loaded = alloc.allocator_and_pools["weights"]
    alloc.allocator_and_pools[KEPT_POOL_KEY] = (_Pool([]), None)  # as after a first pack
    report, block = pack_weights(model, m, dict(weight_tensors(model)), allocator=alloc,
                                 release=released.append, free_bytes=1 << 40,
                                 cuda_graphs=False)  # fmt: skip
    assert block is None and report["why"] == "the weights are packed already"
    assert alloc.tags == [] and released == []
    del alloc.allocator_and_pools[KEPT_POOL_KEY]
    # an error part-way (a weight the entry does not hold): vLLM's pool context skips its
    # cleanup, so the load's pool must stay the weights' pool
    params = dict(weight_tensors(model), extra=torch.zeros(2))
    params.pop("proj.bias")
    with pytest.raises(KeyError):
        pack_weights(model, m, params, allocator=alloc, release=released.append,
                     free_bytes=1 << 40, cuda_graphs=False)  # fmt: skip
    assert alloc.allocator_and_pools["weights"] is loaded and released == []


def test_the_slot_room_is_the_slot_less_what_the_engine_holds() -> None:
    """The packing's room is judged from what the engine holds, not from vLLM's share:
    with --kv-cache-gib the engine may hold much less (room to pack) or more (none)."""
    small_kv = SlotRoom(slot_bytes=35 * GIB, held_bytes=6 * GIB, held_by_engine=True)
    assert small_kv.room_bytes == 29 * GIB and small_kv.refusal(2 * GIB) is None
    beyond = SlotRoom(slot_bytes=35 * GIB, held_bytes=40 * GIB, held_by_engine=True)
    assert beyond.room_bytes == 0
    assert beyond.refusal(GIB) == (
        "the slot's 35.0 GiB leave 0 B beyond the 40.0 GiB the engine holds, 1.0 GiB "
        "needed for a second copy of the weights for a moment (lower --kv-cache-gib or "
        "--gpu-memory-utilization, or take more --units)")  # fmt: skip
    # NVML did not list the process: the whole GPU's use stands in (never less)
    whole = SlotRoom(slot_bytes=35 * GIB, held_bytes=34 * GIB, held_by_engine=False)
    assert "beyond the 34.0 GiB the GPU has in use (NVML does not list the engine's " \
        "process), 2.0 GiB needed" in str(whole.refusal(2 * GIB))  # fmt: skip
