"""The GPU probes' pure parts (scripts/gpu), on CPU: what they print is read as data."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# loaded by its path: scripts/gpu stays off sys.path (its names would shadow others')
_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "asleep_probe.py"
_SPEC = importlib.util.spec_from_file_location("asleep_probe", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
_PROBE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_PROBE)
smaps_summary = _PROBE.smaps_summary

_SMAPS = """\
55d0a0000000-55d0a0400000 rw-p 00000000 00:00 0                          [heap]
Size:               4096 kB
Rss:                3072 kB
Private_Dirty:      3072 kB
7f0000000000-7f0004000000 rw-p 00000000 00:00 0
Size:              65536 kB
Rss:               40960 kB
Private_Dirty:     40960 kB
7f1000000000-7f1000100000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
Private_Dirty:      1024 kB
7f2000000000-7f2000200000 r-xp 00000000 08:01 123                        /usr/lib/libc.so.6
Size:               2048 kB
Rss:                2048 kB
Private_Dirty:         0 kB
7f2000200000-7f2000280000 rw-p 00200000 08:01 123                        /usr/lib/libc.so.6
Size:                512 kB
Rss:                 512 kB
Private_Dirty:       512 kB
7f3000000000-7f3000200000 rw-s 00000000 00:05 77                         /dev/nvidiactl
Size:               2048 kB
Rss:                2048 kB
Private_Dirty:         0 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  20 kB
Private_Dirty:        20 kB
"""


def test_smaps_summary_sorts_resident_memory_by_kind_and_anonymous_by_size() -> None:
    assert smaps_summary(_SMAPS) == {
        "rss_mib_by_kind": {"anonymous": 41.0, "file": 2.5, "file, private dirty": 0.5,
                            "heap": 3.0, "nvidia device": 2.0, "stack": 0.0},
        "anon_rss_mib_by_size": {"<= 1 MiB": 1.0, "<= 64 MiB": 40.0},
        "largest_anon": [{"rss_mib": 40.0, "size_mib": "64.0", "perms": "rw-p"},
                         {"rss_mib": 1.0, "size_mib": "1.0", "perms": "rw-p"}],
    }  # fmt: skip


def test_packed_size_probe_runs_dry_on_cpu(tmp_path: Path) -> None:
    """scripts/gpu/packed_size_probe.py's dry run (--device cpu): one PACKSIZE line per size
    and release, each way's three rates, and no file left behind (the GPU's run is the
    measure; this keeps the script from reaching the GPU machine broken)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(repo / "scripts" / "gpu" / "packed_size_probe.py"), "--device",
         "cpu", "--sizes-gib", "0.004", "--release-gib", "0", "0.004", "--chunk-mib", "1",
         "--dir", str(tmp_path / "psp")],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x.split(" ", 1)[1]) for x in out.stdout.splitlines()
             if x.startswith("PACKSIZE ")]  # fmt: skip
    assert [(r["size_gib"], r["release_gib"]) for r in lines] == [(0.0, 0.0), (0.0, 0.0)]
    for r in lines:
        assert r["expandable"] is False
        assert all(len(r[f"{way}_gb_s"]) == 3 for way in ("whole", "chunked", "same_block"))
    assert list((tmp_path / "psp").iterdir()) == []
