"""bench_transfer on CPU, small sizes: the same code path the GPU run takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from spswap.bench.transfer import TENSOR_BYTES, bench_transfer, render_bench_transfer  # noqa: E402


def test_bench_transfer_cpu_small(tmp_path: Path) -> None:
    sizes = [1 << 20, TENSOR_BYTES + 12345]
    result = bench_transfer(sizes, device="cpu", repeats=2, root=tmp_path)
    json.dumps(result)
    assert result["device"] == "cpu" and result["repeats"] == 2
    rows = result["rows"]
    assert [r["size_bytes"] for r in rows] == sizes
    assert [r["tensors"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["pool"]["seconds"]) == 2 and r["pool"]["best_gb_per_s"] > 0
        assert r["pool"]["best_gb_per_s"] >= r["pool"]["median_gb_per_s"]
        assert r["pageable"]["best_gb_per_s"] > 0
        assert r["pinned"] is None and r["pool_to_pinned"] is None and r["register_s"] is None
    # Each size's entry is removed once measured.
    assert not [p for p in (tmp_path / "pool").iterdir() if p.is_dir() and p.name[0] != "."]
    console = Console(width=160, record=True)
    console.print(render_bench_transfer(result))
    text = console.export_text()
    assert "pool -> cpu" in text and "64.0 MiB" in text and "n/a" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.gpu
def test_bench_transfer_cuda_reaches_most_of_pinned(tmp_path: Path) -> None:
    result = bench_transfer([256 << 20], device="cuda", repeats=3, root=tmp_path)
    row = result["rows"][0]
    assert row["register_s"] > 0
    assert row["pinned"]["best_gb_per_s"] > row["pageable"]["best_gb_per_s"]
    assert row["pool_to_pinned"] > 0.8, row


def test_sizes_a_machine_cannot_hold_are_refused_naming_those_it_can() -> None:
    from spswap.bench.transfer import fmt_size_arg, memory_problem

    gib = 1 << 30
    sizes = [64 << 20, gib, 4 * gib, 16 * gib]
    said = memory_problem(sizes, available_bytes=23 * gib, scratch=Path("/dev/shm"),
                          scratch_free_bytes=12 * gib)  # fmt: skip
    assert said == ("--sizes asks for 16.0 GiB: a size needs about twice that in memory at "
                    "once (35.2 GiB with a margin), and this machine has 23.0 GiB available; "
                    "give smaller --sizes, e.g. --sizes 64M,1G,4G")  # fmt: skip
    said = memory_problem(sizes[:3], available_bytes=23 * gib, scratch=Path("/dev/shm"),
                          scratch_free_bytes=2 * gib)  # fmt: skip
    assert said == ("--sizes asks for 4.0 GiB but the scratch directory /dev/shm has 2.0 GiB free; "
                    "give --scratch-dir DIR on a tmpfs with room, or smaller --sizes")  # fmt: skip
    assert memory_problem(sizes[:3], available_bytes=23 * gib, scratch=Path("/dev/shm"),
                          scratch_free_bytes=12 * gib) is None  # fmt: skip
    assert memory_problem(sizes, available_bytes=None, scratch=Path("/x"),
                          scratch_free_bytes=None) is None  # fmt: skip
    assert [fmt_size_arg(n) for n in (64 << 20, gib, 3 << 10, 1536)] == ["64M", "1G", "3K", "1536"]
