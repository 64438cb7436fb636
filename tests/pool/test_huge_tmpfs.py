"""The pool on a tmpfs mounted ``huge=within_size`` (docs/slurm.md, "The root's tmpfs in
huge pages"): an imported entry's data lands in 2 MiB pages there and in 4 KiB pages on a
tmpfs without the option, and ``spswap doctor``'s "root huge pages" row tells the two
apart from the real ``/proc/mounts``. A registered pool entry is pinned page by page
(at every CUDA restore too), so its page size is a restore's cost on a GPU node."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from spswap import doctor_node
from spswap.pool.store import Pool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: run as root")


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Two tmpfs mounts under ``tmp_path``: ``huge`` (huge=within_size) and ``small``."""
    out: dict[str, Path] = {}
    try:
        for name, opts in (("huge", "huge=within_size"), ("small", "huge=never")):
            point = tmp_path / name
            point.mkdir()
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{opts},size=256m",
                                   f"spswap-test-{name}", str(point)],
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
            out[name] = point
        yield out
    finally:
        for point in out.values():
            subprocess.run(["umount", str(point)], check=False)


def pmd_mapped_kib(path: Path) -> int:
    """How much of ``path``, mapped and read whole, this process maps in 2 MiB pages."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        sum(m[i] for i in range(0, size, 4096))  # every page faulted in
        smaps = Path("/proc/self/smaps").read_text()
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
            if block.split("\n", 1)[0].endswith(str(path)):
                found = re.search(r"^ShmemPmdMapped:\s+(\d+) kB", block, re.M)
                return int(found.group(1)) if found else 0
    raise AssertionError(f"{path} not mapped")


def test_a_pool_entry_on_a_huge_tmpfs_is_in_2mib_pages(mounted, tmp_path: Path) -> None:
    shmem = doctor_node.thp_mode(doctor_node.SHMEM_ENABLED.read_text())
    if shmem in ("deny", "force"):
        pytest.skip(f"shmem_enabled is {shmem}: every tmpfs is the same here")
    weights = {"w": np.arange(8 << 20, dtype=np.float32)}  # 32 MiB
    save_file(weights, str(tmp_path / "m.safetensors"))
    mounts = Path("/proc/mounts").read_text()
    pmd, rows = {}, {}
    for name, point in mounted.items():
        pool = Pool(point / "pool", capacity_bytes=128 << 20)
        manifest = pool.import_checkpoint(tmp_path / "m.safetensors")
        pmd[name] = pmd_mapped_kib(pool.data_path(manifest))
        rows[name] = doctor_node.root_huge_check(str(point), doctor_node.mount_entry(point, mounts),
                                                 shmem)  # fmt: skip
    # (a fragmented machine may give some 4 KiB pages where no 2 MiB one is free)
    assert pmd["huge"] >= 2 << 10, pmd
    assert pmd["small"] == 0, pmd
    assert rows["huge"]["ok"] is True and "huge=within_size: 2 MiB pages" in rows["huge"]["value"]
    assert rows["small"]["ok"] is None and "huge=never: 4 KiB pages" in rows["small"]["value"]
