"""``spswap demo``: a real run (spswapd on a temporary root; CRIU where this runs as root
and CRIU >= 4.1 is found, else the pool path), and its pure parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from spswap.bench.turns_plan import TurnKind, TurnResult, summarize
from spswap.demo_report import (
    CRIU_HINT,
    DemoMode,
    choose_mode,
    demo_json,
    demo_ok,
    explain_slower,
    pool_copy_note,
    render_demo,
)


def _text(renderable: object) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_cli_demo_real_run_restores_every_later_turn(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from spswap.demo import detect_mode

    mode = detect_mode()
    proc = subprocess.run(
        [sys.executable, "-c", "from spswap.cli.app import main; main()", "demo",
         "--preset", "tiny", "--models", "2", "--rounds", "1", "--device", "cpu",
         "--root", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["mode"] == mode.name and out["all_equal"] is True and out["ok"] is True, out
    turns = out["turns"]
    # the settings' count of models is not the list of their names beside it
    assert out["settings"]["model_count"] == 2 and "models" not in out["settings"]
    assert [(t["kind"], t["model"]) for t in turns] == [
        ("cold", "model-0"), ("cold", "model-1"), ("restore", "model-0"),
        ("restore", "model-1")]  # fmt: skip
    assert [t["path"] for t in turns[:2]] == ["cold", "cold"]
    for t in turns[2:]:
        assert t["path"] in mode.restored_paths and t["identical"] is True, t
        assert t["total_s"] > 0 and t["slurm_s"] >= 0 and t["spswap_s"] >= 0
    assert out["leftovers"] == [] and out["not_restored"] == 0
    assert list(tmp_path.iterdir()) == []  # the temporary node is gone


def test_the_pool_path_serves_every_later_turn_from_the_pool(tmp_path: Path) -> None:
    """What a normal user (or a machine without CRIU) gets: every stop ends the server,
    every later run starts a new one from the pool; the note says what to run."""
    pytest.importorskip("torch")
    from spswap.demo import run_demo

    mode = DemoMode(False, "no CRIU found (forced by the test)")
    msgs: list[str] = []
    summary, got = run_demo(models=2, rounds=1, preset="tiny", device="cpu", root=tmp_path,
                            mode=mode, progress=msgs.append)  # fmt: skip
    assert got is mode and mode.note in msgs
    assert [t.path for t in summary.turns] == ["cold", "cold", "pool", "pool"]
    assert demo_ok(summary) and summary.ok and summary.identical == summary.compared == 2
    text = _text(render_demo(summary, mode))
    assert "through the pool" in text and "forced by the test" in text
    assert " ".join(text.split()).endswith('Next: docs/slurm.md, "Try it on one machine": the '
                                           "same swap for a normal user's job, preempted under "
                                           "a test Slurm.")  # fmt: skip
    # each start from the pool recorded its copy; the slowest is in the report
    slowest = summary.settings["pool_copy_gb_per_s_min"]
    assert isinstance(slowest, float) and slowest > 0
    assert f"the slowest mapped the weights at {slowest:.1f} GB/s" in text
    assert sum("weights from the pool at" in m for m in msgs) == 2  # the pool starts
    assert list(tmp_path.iterdir()) == []


def test_a_pool_copy_below_memory_speed_says_why() -> None:
    assert pool_copy_note(None, "cpu") is None
    assert (
        pool_copy_note(7.5, "cpu") == "starts from the pool: the slowest mapped the "
        "weights at 7.5 GB/s (on the CPU the weights are the pool's own pages, not a copy)"
    )
    assert pool_copy_note(7.5, "cuda") == "starts from the pool: the slowest copied the " \
        "weights at 7.5 GB/s"  # fmt: skip
    slow = pool_copy_note(1.2, "cpu")
    assert slow is not None and "below memory speed (5 GB/s on CPU)" in slow
    assert "spswap bench transfer --device cpu" in slow
    assert "below" not in (pool_copy_note(1.2, "cuda") or "")  # the GPU's goal is elsewhere


def test_choose_mode_says_why_and_what_to_run() -> None:
    assert choose_mode(0, "/usr/local/sbin/criu", (4, 1, 1)) == DemoMode(True)
    missing = choose_mode(0, None, None)
    assert not missing.checkpoint and CRIU_HINT in (missing.note or "")
    old = choose_mode(0, "/usr/sbin/criu", (3, 17, 1))
    assert "CRIU 3.17.1, need >= 4.1" in (old.note or "") and CRIU_HINT in (old.note or "")
    unset = choose_mode(0, None, None, (4, 1, 0), "/nonexistent/criu")
    assert unset == DemoMode(False, "the turns go through the pool alone: SPSWAP_CRIU="
                             "/nonexistent/criu is not an executable file: set SPSWAP_CRIU to "
                             "the criu binary (in /etc/default/spswap), or remove it to use "
                             "PATH's or /usr/local/sbin/criu")  # fmt: skip
    user = choose_mode(1000, "/usr/local/sbin/criu", (4, 1, 1))
    assert not user.checkpoint and "not root" in (user.note or "")
    assert user.restored_paths == ("pool",) and DemoMode(True).restored_paths == ("kept", "image")


def _turn(i: int, model: str, kind: TurnKind, path: str, total: float, slurm: float,
          identical: bool = True) -> TurnResult:  # fmt: skip
    return TurnResult(index=i, round=0 if kind is TurnKind.COLD else 1, model=model,
                      kind=kind, path=path, total_s=total, slurm_s=slurm,
                      spswap_s=total - slurm, identical=identical)  # fmt: skip


def test_a_turn_slower_than_cold_says_why() -> None:
    turns = [_turn(0, "a", TurnKind.COLD, "cold", 2.0, 0.1),
             _turn(1, "a", TurnKind.RESTORE, "image", 3.0, 2.5),
             _turn(2, "a", TurnKind.RESTORE, "image", 2.5, 0.1),
             _turn(3, "a", TurnKind.RESTORE, "kept", 1.0, 0.2)]  # fmt: skip
    out = explain_slower(turns, DemoMode(True), cores=2, load=7.5)
    assert out[0].reason is None and out[3].reason is None  # cold, and faster than cold
    assert "dump took 2.50 s" in (out[1].reason or "")
    assert "spswap's share 2.40 s against 1.90 s cold" in (out[2].reason or "")
    assert "load average 7.5 on 2 cores" in (out[2].reason or "")
    pool = explain_slower(turns, DemoMode(False, "no CRIU"))
    assert "pool path" in (pool[1].reason or "")


def test_report_and_json_of_a_run_with_a_different_answer() -> None:
    turns = [
        _turn(0, "a", TurnKind.COLD, "cold", 2.0, 0.1),
        _turn(1, "b", TurnKind.COLD, "cold", 2.0, 0.1),
        _turn(2, "a", TurnKind.RESTORE, "pool", 1.0, 0.1),
        _turn(3, "b", TurnKind.RESTORE, "pool", 1.0, 0.1, identical=False),
    ]
    mode = DemoMode(False, "no CRIU found: ... `bash scripts/build_criu.sh` ...")
    summary = summarize(["a", "b"], turns, wall_s=2.0, settings={"device": "cpu"},
                        restored_paths=mode.restored_paths)  # fmt: skip
    assert summary.not_restored == 0 and not demo_ok(summary)
    text = _text(render_demo(summary, mode))
    assert "through the pool" in text and "DIFFERS" in text
    assert "swap path is broken" in text and "bash scripts/build_criu.sh" in text
    out = demo_json(summary, mode)
    assert out["mode"] == "pool" and out["all_equal"] is False and out["note"] == mode.note
    json.dumps(out)


def test_path_without_slurm_hides_only_slurms_commands(tmp_path: Path) -> None:
    from spswap.demo import path_without_slurm

    bin_dir, other = tmp_path / "bin", tmp_path / "other"
    for d, names in ((bin_dir, ("scontrol", "squeue", "criu")), (other, ("ls",))):
        d.mkdir()
        for name in names:
            (d / name).write_text("#!/bin/sh\n")
            (d / name).chmod(0o755)
    path = path_without_slurm(f"{bin_dir}{os.pathsep}{other}", tmp_path / "shadow")
    first, second = path.split(os.pathsep)
    assert second == str(other)
    assert sorted(p.name for p in Path(first).iterdir()) == ["criu"]
    assert (Path(first) / "criu").resolve() == bin_dir / "criu"


def test_the_report_keeps_every_value_at_80_columns() -> None:
    # the stats table cut model names and headers short ("model…", "cold/…") in an
    # 80-column console, which is what a pipe or a log gets (newcomer walk)
    turns = [
        _turn(0, "model-0", TurnKind.COLD, "cold", 123.456, 0.1),
        _turn(1, "model-10", TurnKind.COLD, "cold", 11.2, 0.1),
        _turn(2, "model-0", TurnKind.RESTORE, "kept", 1.234, 0.5),
        _turn(3, "model-10", TurnKind.RESTORE, "image", 13.5, 12.0),
    ]
    mode = DemoMode(True)
    turns = explain_slower(turns, mode)
    summary = summarize(["model-0", "model-10"], turns, wall_s=50.0,
                        settings={"device": "cpu"}, restored_paths=mode.restored_paths)  # fmt: skip
    console = Console(width=80, record=True, force_terminal=False)
    console.print(render_demo(summary, mode))
    text = console.export_text()
    assert "…" not in text, text
    assert "through CRIU (spswapd) (seconds)" in " ".join(text.split())  # the table's unit
    assert all(len(line) <= 80 for line in text.splitlines())
    cells = {word for line in text.splitlines() for word in line.split()}
    for value in ("model-0", "model-10", "123.46", "reference", "100.0x", "0.8x", "turns",
                  "faster", "Slurm", "spswap"):  # fmt: skip
        assert value in cells, f"{value!r} not whole in:\n{text}"
    # a turn's reason is said in full under the turn table
    assert "turn 4 (model-10, image): slower than cold: the displaced model's dump took " \
        "12.00 s of it (Slurm's share of the cold turn: 0.10 s)" in \
        " ".join(text.split()), text  # fmt: skip


def test_cli_demo_bad_preset_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-c", "from spswap.cli.app import main; main()", "demo", "--preset",
         "nope", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown reference preset 'nope'" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


def test_cli_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import spswap.cli.app, spswap.cli.demo\n"
        "assert 'spswap.demo' not in sys.modules\n"
        "from spswap.cli.main import main\n"
        "sys.argv = ['spswap', 'demo']\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    repo = Path(__file__).resolve().parents[1]  # this install's own command (no index)
    said = " ".join(proc.stderr.split())
    assert "spswap demo: error: the demo needs torch, safetensors and numpy" in said, said
    # this checkout's install script into this venv, else pip's extra from this checkout
    assert (f"bash {repo}/scripts/install.sh`" in said if sys.prefix != sys.base_prefix
            else f"-m pip install -e '{repo}[torch]'" in said), said  # fmt: skip


def test_the_demo_as_a_normal_user_takes_the_pool_path(user_uid: int) -> None:
    """As a normal user (it failed before: the runs named a job only root's prolog could
    register, and their runs.jsonl lines were matched by a restart count they did not have)."""
    import pwd
    import tempfile

    pytest.importorskip("torch")
    gid = pwd.getpwuid(user_uid).pw_gid
    home = Path(tempfile.mkdtemp(prefix="spswap-demo-user-", dir="/tmp"))
    os.chown(home, user_uid, gid)
    try:
        proc = subprocess.run(
            ["setpriv", f"--reuid={user_uid}", f"--regid={gid}", "--init-groups",
             sys.executable, "-c", "from spswap.cli.app import main; main()", "demo",
             "--preset", "tiny", "--models", "2", "--rounds", "1", "--device", "cpu", "--json"],
            capture_output=True, text=True, timeout=600, cwd=home,
            env={"PATH": os.environ["PATH"], "HOME": str(home),
                 "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )  # fmt: skip
        if "Permission denied" in proc.stderr and proc.returncode == 126:
            pytest.fail(f"{sys.executable} cannot be run by a normal user: scripts/install.sh "
                        "builds the venv on a Python every user can run")  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        assert out["mode"] == "pool" and out["ok"] is True, out
        assert [t["path"] for t in out["turns"]] == ["cold", "cold", "pool", "pool"]
    finally:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
