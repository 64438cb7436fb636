"""``spswap slots`` and the slot bench, run through the real CLI app."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spswap.bench.slots import bench_slots, render_bench_slots
from spswap.cli.app import app
from spswap.cli.slots import render_slots, units_bar
from spswap.slots.table import SlotTable


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"SPSWAP_ROOT": str(tmp_path), "SPSWAP_GPUS": "0,1"}


def _run(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["slots", *args], env=env)
    return result.exit_code, result.output


def test_reserve_ls_release(env: dict[str, str], tmp_path: Path) -> None:
    code, out = _run(env, "reserve", "--model", "llama", "--units", "2", "--json")
    assert code == 0, out
    r = json.loads(out)
    # tied to the calling process (here: this test's parent), not to the short-lived CLI
    assert r["holder"]["pid"] == os.getppid() and r["units"] == [0, 1] and r["gpus"] == [0]
    code, out = _run(env, "reserve", "--model", "qwen", "--gpus", "1", "--pid", str(os.getpid()))
    assert code == 0 and out.strip() == "r2"
    code, out = _run(env, "ls", "--json")
    snap = json.loads(out)
    assert [g["units"] for g in snap["gpus"]] == [["r1", "r1", None, None], ["r2"] * 4]
    code, out = _run(env, "ls")
    assert code == 0 and "██░░" in out and "r1 llama" in out and "████" in out
    code, out = _run(env, "release", "r1")
    assert code == 0 and "released r1 (llama)" in out
    code, out = _run(env, "release", "r2", "--json")
    assert json.loads(out)["id"] == "r2"
    assert SlotTable(tmp_path / "slots", [0, 1]).reservations() == []


def test_reserve_with_job_id_and_bad_units(env: dict[str, str]) -> None:
    code, out = _run(env, "reserve", "--model", "m", "--units", "1", "--job-id", "99", "--json")
    assert json.loads(out)["holder"]["job_id"] == "99"
    code, _out = _run(env, "reserve", "--model", "m", "--units", "3")
    assert code != 0


def test_reserve_times_out_when_full(env: dict[str, str]) -> None:
    assert _run(env, "reserve", "--model", "a", "--gpus", "2", "--pid", str(os.getpid()))[0] == 0
    code, _out = _run(env, "reserve", "--model", "b", "--gpu", "1", "--timeout-s", "0.05")
    assert code != 0


def test_units_bar_and_render() -> None:
    assert units_bar(["r1", None, "r2", "r2"]) == "█░██"
    snap = {
        "gpus": [
            {"index": 0, "units": ["r1", None, None, None], "units_free": 3, "units_total": 4}
        ],
        "reservations": [{
            "id": "r1", "model": "m", "granted_at": 0.0, "gpus": [0], "units": [0],
            "holder": {"pid": 5, "uid": 7, "job_id": "12"},
        }],
        "waiters": [{
            "ticket": 3, "model": "w", "units": 2, "whole_gpus": None, "candidates": [0],
            "holder": {"pid": 6, "uid": 7, "job_id": None}, "enqueued_at": 0.0,
        }],
    }  # fmt: skip
    tables = render_slots(snap)
    assert len(tables) == 2 and tables[0].row_count == 1 and tables[1].row_count == 1


def test_bench_slots_on_tmpfs(tmp_path: Path) -> None:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    d = base / f"spswap-bench-test-{os.getpid()}"
    try:
        result = bench_slots(d, iterations=300)
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    assert result["iterations"] == 300
    assert 0 < result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["meets_target"] == (result["p50_ms"] <= 1.0)
    assert render_bench_slots(result).row_count == 1
    # The budget itself (p50 <= 1 ms uncontended) is checked by `spswap bench slots`
    # (docs/benchmarks.md), not by a timed test on a shared 2-core box.
