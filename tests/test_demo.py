"""The demo end to end on CPU (tiny preset), through the function and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from spswap.demo import render_demo, run_demo  # noqa: E402


def test_run_demo_swaps_and_answers_match(tmp_path: Path) -> None:
    msgs: list[str] = []
    result = run_demo(models=3, rounds=2, preset="tiny", device="cpu", root=tmp_path,
                      progress=msgs.append)  # fmt: skip
    assert result.all_equal
    assert [m.name for m in result.models] == ["model-0", "model-1", "model-2"]
    for m in result.models:
        assert m.answers_equal == [True, True]
        assert len(m.restore_s) == len(m.sleep_s) == 2
        assert m.cold_load_s > 0 and m.pool_load_s > 0 and m.import_s > 0
        assert all(r > 0 for r in m.restore_gb_per_s)
    assert "round 2/2" in msgs
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone
    d = result.to_json()
    assert d["all_equal"] is True and d["models"][0]["all_equal"] is True
    json.dumps(d)
    console = Console(width=120, record=True)
    console.print(render_demo(result))
    text = console.export_text()
    assert "3 models x 2 rounds on cpu" in text
    assert "Every answer equals the model's cold greedy answer." in text
    assert text.count("2/2 yes") == 3


def test_demo_result_reports_a_difference() -> None:
    from spswap.demo import DemoResult, ModelResult

    bad = ModelResult("m", 1, 0.1, 0.1, 0.1, restore_s=[0.1], restore_gb_per_s=[1.0],
                      sleep_s=[0.0], answers_equal=[True, False])  # fmt: skip
    result = DemoResult("cpu", "tiny", 2, 8, [bad])
    assert not result.all_equal
    console = Console(width=120, record=True)
    console.print(render_demo(result))
    text = console.export_text()
    assert "1/2 NO" in text
    assert "swap path is broken" in text


def test_cli_demo_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from spswap.cli.app import main; main()", "demo",
         "--preset", "tiny", "--models", "2", "--rounds", "1", "--device", "cpu",
         "--root", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["all_equal"] is True and len(out["models"]) == 2


def test_cli_demo_bad_preset_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from spswap.cli.app import main; main()", "demo", "--preset",
         "nope", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown reference preset 'nope'" in proc.stderr


def test_cli_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import spswap.cli.app, spswap.cli.demo\n"
        "assert 'spswap.demo' not in sys.modules\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(spswap.cli.app.app, ['demo'])\n"
        "print(r.exit_code); print(r.output)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    code_line, *rest = proc.stdout.splitlines()
    assert code_line == "2"
    assert "pip install 'spswap[torch]'" in proc.stdout + proc.stderr
