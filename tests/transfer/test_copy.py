"""Transfer on CPU from real pool entries (pool.writer -> data.bin -> mmap -> copy)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from spswap.errors import TransferError  # noqa: E402
from spswap.transfer.copy import check_compatible, copy_into, mismatches  # noqa: E402
from spswap.transfer.mapping import MappedEntry  # noqa: E402

from .conftest import write_entry  # noqa: E402


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(33, 17, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(12, dtype=torch.int64).view(3, 4),
        "d.flag": torch.tensor([True, False, True]),
        "e.empty": torch.empty(0, 4),
        "f.half": torch.randn(2, 3, 4, generator=g).to(torch.float16),
    }


def _dest_like(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in src.items()}


def test_views_are_zero_copy_and_offsets_aligned(pool) -> None:
    src = _source()
    m = write_entry(pool, "m", src)
    with MappedEntry(m, pool.data_path(m)) as mapping:
        views = mapping.tensors()
        assert set(views) == set(src)
        for name, t in src.items():
            assert torch.equal(views[name], t), name
            if t.numel():
                assert views[name].data_ptr() - mapping.address == m.by_name()[name].offset
                assert views[name].data_ptr() % 4096 == 0


def test_copy_into_cpu_is_bit_exact_and_reports(pool) -> None:
    src = _source()
    m = write_entry(pool, "m", src)
    dst = _dest_like(src)
    with MappedEntry(m, pool.data_path(m)) as mapping:
        report = copy_into(mapping, dst)
    for name, t in src.items():
        assert torch.equal(dst[name], t), name
    assert report.size_bytes == sum(t.numel() * t.element_size() for t in src.values())
    assert report.tensors == len(src)
    assert report.device == "cpu"
    assert report.seconds > 0 and report.gb_per_s > 0
    assert not report.registered
    assert report.to_json()["gb_per_s"] == report.gb_per_s


@pytest.mark.parametrize(
    "mutate, expected",
    [  # noqa: E501
        (lambda d: d.pop("a.weight"), "a.weight: in the pool entry, not in the model"),
        (lambda d: d.__setitem__("z.extra", torch.zeros(2)), "z.extra: in the model, not in the pool"),  # noqa: E501
        (lambda d: d.__setitem__("a.weight", torch.zeros(17, 33)), "a.weight: shape [33, 17] in the pool, [17, 33] in the model"),  # noqa: E501
        (lambda d: d.__setitem__("b.bias", torch.zeros(5)), "b.bias: dtype BF16 in the pool, F32 in the model"),  # noqa: E501
    ],
)  # fmt: skip
def test_mismatch_raises_before_any_byte_moves(pool, mutate, expected: str) -> None:
    src = _source()
    m = write_entry(pool, "m", src)
    dst = _dest_like(src)
    mutate(dst)
    before = {n: t.clone() for n, t in dst.items()}
    with MappedEntry(m, pool.data_path(m)) as mapping:
        with pytest.raises(TransferError) as err:
            copy_into(mapping, dst)
    assert expected in str(err.value)
    assert "nothing was copied" in str(err.value)
    assert "spswap pool import" in str(err.value)
    for name, t in dst.items():  # destination untouched, every tensor
        assert torch.equal(t, before[name]), name


def test_many_mismatches_are_capped_in_the_message(pool) -> None:
    m = write_entry(pool, "m", {f"t{i}": torch.zeros(2) for i in range(9)})
    with pytest.raises(TransferError, match=r"(?s)9 mismatch\(es\).*and 4 more"):
        check_compatible(m, {})
    assert len(mismatches(m, {})) == 9


def test_truncated_data_file_is_refused(pool) -> None:
    m = write_entry(pool, "m", {"w": torch.ones(4096)})
    path = pool.data_path(m)
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(TransferError, match="damaged"):
        MappedEntry(m, path)


def test_closed_mapping_refuses_use(pool) -> None:
    m = write_entry(pool, "m", {"w": torch.ones(8)})
    mapping = MappedEntry(m, pool.data_path(m))
    mapping.close()
    mapping.close()  # idempotent
    assert mapping.closed
    with pytest.raises(TransferError, match="closed"):
        mapping.tensors()


def test_mixed_devices_are_refused(pool) -> None:
    m = write_entry(pool, "m", {"w": torch.ones(8), "v": torch.ones(8)})
    dst = {"w": torch.zeros(8), "v": torch.zeros(8, device="meta")}
    with MappedEntry(m, pool.data_path(m)) as mapping:
        with pytest.raises(TransferError, match="several devices"):
            copy_into(mapping, dst)
    assert torch.equal(dst["w"], torch.zeros(8))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")


@cuda
@pytest.mark.gpu
def test_copy_into_cuda_registers_once_and_is_exact(pool) -> None:
    src = _source()
    m = write_entry(pool, "m", src)
    dst = {n: torch.zeros_like(t, device="cuda") for n, t in src.items()}
    with MappedEntry(m, pool.data_path(m)) as mapping:
        first = copy_into(mapping, dst)
        assert first.registered and mapping.registered
        second = copy_into(mapping, dst)
        assert second.register_s == 0.0
    for name, t in src.items():
        assert torch.equal(dst[name].cpu(), t), name
    assert first.device.startswith("cuda")


@cuda
@pytest.mark.gpu
def test_pulled_copy_is_bit_exact_on_cuda(pool) -> None:
    """The GPU's cores read the registered mapping (odd sizes, bool, empty, NaN bits)."""
    src = _source()
    src["g.nan"] = torch.tensor([float("nan"), -0.0, 1.5], dtype=torch.bfloat16)
    src["g.nan"].view(torch.int16)[0] = 0x7FC1  # a NaN payload a float op could change
    m = write_entry(pool, "m", src)
    dst = {n: torch.zeros_like(t, device="cuda") for n, t in src.items()}
    with MappedEntry(m, pool.data_path(m)) as mapping:
        copy_into(mapping, dst)  # registers
        # all pulled; half pulled, then the copy engines, direct or staged (what a wake
        # right after its sleep does: spswap_copy)
        for fraction, staging in ((1.0, None), (0.5, None), (0.5, 4096), (0.2, 1 << 20)):
            for t in dst.values():
                t.zero_()
            copy_into(mapping, dst, pull=fraction, staging_bytes=staging)
            for name, t in src.items():
                got = dst[name].cpu().view(torch.uint8)
                assert torch.equal(got, t.view(torch.uint8)), (name, fraction, staging)


def test_pull_on_cpu_is_the_plain_copy(pool) -> None:
    src = _source()
    m = write_entry(pool, "m", src)
    dst = _dest_like(src)
    with MappedEntry(m, pool.data_path(m)) as mapping:
        copy_into(mapping, dst, pull=1.0)
    for name, t in src.items():
        assert torch.equal(dst[name], t), name


def test_split_for_pull_takes_about_the_share_largest_first() -> None:
    from spswap.transfer.copy import split_for_pull

    sizes = {"a": 600, "b": 300, "c": 60, "d": 40}
    assert split_for_pull(sizes, 1.0) == set(sizes)
    assert split_for_pull(sizes, 0.0) == set()
    assert split_for_pull(sizes, 0.6) == {"a"}
    assert split_for_pull(sizes, 0.9) == {"a", "b"}
    assert split_for_pull(sizes, 0.35) == {"a"}  # 600 is nearer 350 than 0 is
    assert split_for_pull(sizes, 0.25) == {"b"}
    assert split_for_pull({}, 0.5) == set()


def test_word_dtype_is_the_widest_that_divides_everything() -> None:
    from spswap.transfer.copy import word_dtype

    assert word_dtype(4096, 1 << 20, 64) == torch.int64
    assert word_dtype(4096, 12, 64) == torch.int32
    assert word_dtype(4096, 6, 64) == torch.int16
    assert word_dtype(4096, 6, 65) == torch.uint8
    assert word_dtype(0, 0) == torch.int64


@cuda
@pytest.mark.gpu
def test_cuda_host_register_read_only_mapping(pool) -> None:
    from spswap.transfer import cuda_host

    m = write_entry(pool, "m", {"w": torch.ones(1 << 20)})
    with MappedEntry(m, pool.data_path(m)) as mapping:
        s = mapping.register_cuda()
        assert s > 0 and mapping.registered
        assert mapping.register_cuda() == 0.0
        assert mapping.tensors()["w"].is_pinned()
    assert cuda_host.available()


@pytest.mark.parametrize("staging_bytes", [4096, 8192, 1 << 20])
def test_staged_copy_is_bit_exact_on_cpu(pool, staging_bytes: int) -> None:
    """The staged path (host -> staging buffer -> parameters); 4096 bytes forces one chunk
    per tensor and a tensor larger than the buffer, 1 MiB one chunk for all."""
    src = {**_source(), "g.big": torch.randn(64, 64)}  # 16 KiB: larger than 4096 and 8192
    m = write_entry(pool, "m", src)
    dst = _dest_like(src)
    with MappedEntry(m, pool.data_path(m)) as mapping:
        copy_into(mapping, dst, staging_bytes=staging_bytes)
    for name, t in src.items():
        assert torch.equal(dst[name], t), name


def test_staged_copy_through_given_buffers(pool) -> None:
    """Caller-kept staging buffers are used (their last piece is left in them) and checked."""
    src = {**_source(), "g.big": torch.randn(64, 64)}
    m = write_entry(pool, "m", src)
    dst = _dest_like(src)
    bufs = [torch.full((8192,), 7, dtype=torch.uint8) for _ in range(2)]
    with MappedEntry(m, pool.data_path(m)) as mapping:
        copy_into(mapping, dst, staging_bytes=8192, staging_buffers=bufs)
        assert not all(bool((b == 7).all()) for b in bufs)
        with pytest.raises(TransferError, match="two uint8 tensors of at least 8192 bytes"):
            copy_into(mapping, dst, staging_bytes=8192,
                      staging_buffers=[torch.empty(4096, dtype=torch.uint8)] * 2)  # fmt: skip
    for name, t in src.items():
        assert torch.equal(dst[name], t), name


def test_same_device_treats_a_missing_index_as_the_current_one() -> None:
    from spswap.transfer.copy import _same_device

    d = torch.device
    assert _same_device(d("cuda"), d("cuda:1")) and _same_device(d("cuda:0"), d("cuda:0"))
    assert not _same_device(d("cuda:0"), d("cuda:1")) and not _same_device(d("cpu"), d("cuda"))


def test_staging_plan_splits_tensors_and_skips_gaps(pool) -> None:
    from spswap.transfer.staging import staging_plan

    src = {"a": torch.zeros(1024), "b": torch.zeros(1024), "c": torch.zeros(4096)}
    m = write_entry(pool, "m", src)  # a@0, b@4096, c@8192 (16 KiB): 4 KiB each, then 16
    off = {t.name: t.offset for t in m.tensors}
    plan = staging_plan(m, 8192)
    assert [(p.start, p.end, p.buffer, p.slices) for p in plan] == [
        (off["a"], off["a"] + 8192, 0, (("a", 0, 0, 4096), ("b", 0, 4096, 4096))),
        (off["c"], off["c"] + 8192, 1, (("c", 0, 0, 8192),)),
        (off["c"] + 8192, off["c"] + 16384, 0, (("c", 8192, 0, 8192),)),
    ]
    # pieces start mid-tensor: b is split, then c's first part shares b's piece
    plan = staging_plan(m, 6144)
    assert [p.slices for p in plan][:2] == [
        (("a", 0, 0, 4096), ("b", 0, 4096, 2048)),
        (("b", 2048, 0, 2048), ("c", 0, 2048, 4096)),
    ]
    assert len(staging_plan(m, 1 << 30)) == 1
    with pytest.raises(TransferError, match="positive"):
        staging_plan(m, 0)


def test_staging_plan_leaves_out_the_pulled_tensors(pool) -> None:
    # the copy engines' share after a pull: no piece carries a byte of a pulled tensor
    from spswap.transfer.staging import staging_plan

    src = {"a": torch.zeros(1024), "b": torch.zeros(1024), "c": torch.zeros(4096)}
    m = write_entry(pool, "m", src)  # a@0, b@4096, c@8192
    off = {t.name: t.offset for t in m.tensors}
    plan = staging_plan(m, 1 << 20, skip=frozenset({"b"}))
    assert [(p.start, p.end, p.buffer, p.slices) for p in plan] == [
        (off["a"], off["a"] + 4096, 0, (("a", 0, 0, 4096),)),
        (off["c"], off["c"] + 16384, 1, (("c", 0, 0, 16384),)),
    ]
    plan = staging_plan(m, 8192, skip=frozenset({"a"}))
    assert [(p.start, p.end, p.slices) for p in plan] == [
        (off["b"], off["b"] + 8192, (("b", 0, 0, 4096), ("c", 0, 4096, 4096))),
        (off["c"] + 4096, off["c"] + 12288, (("c", 4096, 0, 8192),)),
        (off["c"] + 12288, off["c"] + 16384, (("c", 12288, 0, 4096),)),
    ]
    assert staging_plan(m, 8192, skip=frozenset(src)) == []


def test_a_mapping_plans_once_per_piece_size(pool) -> None:
    # a wake copies without planning again: the mapping keeps the plan for each size
    from spswap.transfer.mapping import MAX_PLANS
    from spswap.transfer.staging import staging_plan

    src = {"a": torch.arange(1024, dtype=torch.float32), "b": torch.ones(3000)}
    m = write_entry(pool, "m", src)
    with MappedEntry(m, pool.data_path(m)) as mapping:
        first = mapping.staging_plan(8192)
        assert list(first) == staging_plan(m, 8192)
        assert mapping.staging_plan(8192) is first
        assert list(mapping.staging_plan(4096)) == staging_plan(m, 4096)
        skip_b = frozenset({"b"})
        assert list(mapping.staging_plan(4096, skip_b)) == staging_plan(m, 4096, skip=skip_b)
        assert mapping.staging_plan(4096, skip_b) is mapping.staging_plan(4096, skip_b)
        # a pulled share varies from wake to wake: the plans left-out sets make are bounded
        for size in range(1024, 1024 * 20, 1024):
            mapping.staging_plan(size, skip_b)
        assert len(mapping._plans) <= MAX_PLANS
        assert mapping.staging_plan(8192) is first  # the plain plans stay
        for size in range(512, 512 * (MAX_PLANS + 4), 512):  # many piece sizes: bounded too
            mapping.staging_plan(size)
        assert len(mapping._plans) <= MAX_PLANS
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        for _ in range(2):  # the second copy follows the kept plan
            copy_into(mapping, dst, staging_bytes=4096)
            assert all(torch.equal(dst[k], src[k]) for k in src)
            dst = {k: torch.zeros_like(v) for k, v in src.items()}


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
       piece=st.integers(1, 9000))  # fmt: skip
def test_staging_plan_covers_every_byte_once(sizes: list[int], piece: int) -> None:
    """Property: each tensor's bytes are covered exactly once, in order, no piece is
    larger than asked, and pieces alternate between the two buffers."""
    from spswap.pool.manifest import Manifest, TensorEntry, align_up
    from spswap.transfer.staging import staging_plan

    entries, off = [], 0
    for i, n in enumerate(sizes):
        entries.append(TensorEntry(name=f"t{i}", dtype="U8", shape=(n,), offset=off,
                                   size_bytes=n, checksum=""))  # fmt: skip
        off = align_up(off + n)
    m = Manifest(name="m", digest="d", data_size_bytes=off, tensors=tuple(entries))
    plan = staging_plan(m, piece)
    seen: dict[str, list[tuple[int, int]]] = {}
    for i, p in enumerate(plan):
        assert p.buffer == i % 2 and 0 < p.end - p.start <= piece
        for name, t_off, b_off, n in p.slices:
            assert n > 0 and 0 <= b_off and b_off + n <= p.end - p.start
            tensor = next(t for t in entries if t.name == name)
            assert p.start + b_off == tensor.offset + t_off  # the same bytes of data.bin
            seen.setdefault(name, []).append((t_off, n))
    for t in entries:
        pos = 0
        for t_off, n in seen[t.name]:
            assert t_off == pos
            pos += n
        assert pos == t.size_bytes


@cuda
@pytest.mark.gpu
def test_staged_copy_cuda_is_exact(pool) -> None:
    src = _source()
    m = write_entry(pool, "m", src)
    dst = {n: torch.zeros_like(t, device="cuda") for n, t in src.items()}
    with MappedEntry(m, pool.data_path(m)) as mapping:
        copy_into(mapping, dst, staging_bytes=1 << 20)
    for name, t in src.items():
        assert torch.equal(dst[name].cpu(), t), name


def test_views_outlive_a_closed_or_dropped_mapping(pool) -> None:
    """A view taken from a mapping stays readable after close() (or after the mapping
    object is dropped): the pages go with the last view, never under it (was a SIGSEGV)."""
    src = {"t": torch.arange(1024, dtype=torch.float32)}
    m = write_entry(pool, "m", src)
    dropped = MappedEntry(m, pool.data_path(m)).tensors()["t"]
    mapping = MappedEntry(m, pool.data_path(m))
    kept = mapping.tensors()["t"]
    mapping.close()
    assert mapping.closed
    assert torch.equal(dropped, src["t"]) and torch.equal(kept, src["t"])
