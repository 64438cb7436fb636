"""spswap.engines.host_heap: freed heap pages go back to the kernel, live bytes stay."""

from __future__ import annotations

import json
import subprocess
import sys

from spswap.engines.host_heap import (
    HeapRelease,
    MallocStats,
    malloc_stats,
    release_free_heap,
    resident_bytes,
)

# In a child process (this test's heap is its own): 200 MB in 100 kB blocks (below glibc's
# mmap threshold, so from the heap), every 50th kept alive so the heap's top stays in use
# and glibc's own trimming at free() cannot give the rest back.
_CHILD = """
import json
from spswap.engines.host_heap import release_free_heap
blocks = [bytearray(b"x" * 100_000) for _ in range(2000)]
keep = blocks[::50]
del blocks
r = release_free_heap()
print(json.dumps({**r.to_json(), "kept_intact": all(b == b"x" * 100_000 for b in keep)}))
"""


def test_freed_heap_in_the_middle_goes_back_and_live_blocks_stay() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    report = json.loads(out)
    assert report["heap_trimmed"] is True
    assert report["heap_released_bytes"] > 150_000_000  # of the ~196 MB freed
    assert report["kept_intact"] is True


def test_release_reports_resident_bytes_before_and_after() -> None:
    r = release_free_heap()
    assert r.rss_before_bytes > 0 and r.rss_after_bytes > 0
    assert abs(resident_bytes() - r.rss_after_bytes) < 64 << 20


def test_released_bytes_never_negative_and_json_names_units() -> None:
    grew = HeapRelease(rss_before_bytes=100, rss_after_bytes=300, trimmed=True)
    assert grew.released_bytes == 0
    assert HeapRelease(500, 200, True, 0.01234).to_json() == {
        "rss_before_bytes": 500, "rss_after_bytes": 200,
        "heap_released_bytes": 300, "heap_trimmed": True, "heap_trim_s": 0.0123}  # fmt: skip


def test_a_multi_model_worker_s_trim_gives_its_heap_back_with_or_without_an_engine_trim() -> None:
    from spswap.multi.worker import handle

    class Plain:  # the reference engine: no device caches to trim
        pass

    class WithTrim:
        def trim(self) -> dict[str, int]:
            return {"free_bytes": 7}

    plain = handle(Plain(), {"op": "trim"})
    assert plain["ok"] is True and plain["worker"]["heap_trimmed"] is True
    assert plain["worker"]["rss_after_bytes"] > 0
    with_trim = handle(WithTrim(), {"op": "trim"})
    assert with_trim["free_bytes"] == 7 and with_trim["worker"]["heap_trimmed"] is True


# In a child: what glibc's allocator says it holds follows what the process allocates:
# 100 MB in 100 kB blocks live (from the heap), then one 64 MiB block (mapped on its own).
_STATS_CHILD = """
import json
from spswap.engines.host_heap import malloc_stats
before = malloc_stats()
blocks = [bytearray(100_000) for _ in range(1000)]
small = malloc_stats()
big = bytearray(64 << 20)
large = malloc_stats()
del blocks
freed = malloc_stats()
print(json.dumps([s.to_json() for s in (before, small, large, freed)]))
"""


def test_malloc_stats_count_live_free_and_separately_mapped_blocks() -> None:
    out = subprocess.run([sys.executable, "-c", _STATS_CHILD], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    before, small, large, freed = json.loads(out)
    assert small["malloc_in_use_bytes"] - before["malloc_in_use_bytes"] >= 95_000_000
    assert large["malloc_mmapped_bytes"] - small["malloc_mmapped_bytes"] >= 64 << 20
    # freed blocks leave "in use" (glibc may keep them, as free, or give the top back)
    assert large["malloc_in_use_bytes"] - freed["malloc_in_use_bytes"] >= 95_000_000


def test_a_release_reports_the_allocator_after_it_and_json_names_units() -> None:
    r = release_free_heap()
    assert r.malloc_after is not None  # glibc >= 2.33 here (Debian 12: 2.36)
    assert r.to_json()["malloc_in_use_bytes"] == r.malloc_after.in_use_bytes > 0
    stats = MallocStats(in_use_bytes=3, free_bytes=2, mmapped_bytes=1)
    assert HeapRelease(500, 200, True, 0.01234, stats).to_json() == {
        "rss_before_bytes": 500, "rss_after_bytes": 200,
        "heap_released_bytes": 300, "heap_trimmed": True, "heap_trim_s": 0.0123,
        "malloc_in_use_bytes": 3, "malloc_free_bytes": 2, "malloc_mmapped_bytes": 1}  # fmt: skip


def test_no_mallinfo2_in_the_c_library_gives_no_stats() -> None:
    class OldLibc:  # a C library before glibc 2.33 (or not glibc): no such function
        pass

    assert malloc_stats(OldLibc()) is None  # type: ignore[arg-type]
