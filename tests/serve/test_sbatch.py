"""The sbatch templates are exactly what the renderers return (golden files)."""

from __future__ import annotations

import difflib
import subprocess

import pytest

from spswap.serve.sbatch import TEMPLATES_DIR, SbatchOptions, render_serve, templates


@pytest.mark.parametrize(("name", "text"), sorted(templates().items()))
def test_template_file_matches_renderer(name, text):
    on_disk = (TEMPLATES_DIR / name).read_text()
    if on_disk != text:
        diff = "".join(difflib.unified_diff(on_disk.splitlines(True), text.splitlines(True),
                                            f"sbatch_templates/{name}", "rendered"))
        pytest.fail(f"{name} differs from its renderer:\n{diff}\n"
                    "accept with: python -m spswap.serve.sbatch --write")


@pytest.mark.parametrize(("name", "text"), sorted(templates().items()))
def test_template_is_valid_bash(name, text):
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_handlers_only_forward_signals():
    text = render_serve()
    traps = [line for line in text.splitlines() if line.startswith("trap ")]
    assert traps == ["trap 'kill -USR1 \"$PID\" 2>/dev/null' USR1",
                     "trap 'kill -TERM \"$PID\" 2>/dev/null' TERM"]
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text


def test_options_are_quoted():
    text = render_serve(SbatchOptions(model="/models/a b'c", units=2, partition="gpu"))
    assert "MODEL='/models/a b'\"'\"'c'" in text
    assert "--units 2" in text and "#SBATCH --partition=gpu" in text
