"""The sbatch templates are exactly what the renderers return (golden files)."""

from __future__ import annotations

import difflib
import subprocess

import pytest

from spswap.serve.sbatch import (
    TEMPLATES_DIR,
    SbatchOptions,
    render_serve,
    render_serve_vllm,
    templates,
)


@pytest.mark.parametrize(("name", "text"), sorted(templates().items()))
def test_template_file_matches_renderer(name, text):
    on_disk = (TEMPLATES_DIR / name).read_text()
    if on_disk != text:
        diff = "".join(
            difflib.unified_diff(
                on_disk.splitlines(True),
                text.splitlines(True),
                f"sbatch_templates/{name}",
                "rendered",
            )
        )
        pytest.fail(
            f"{name} differs from its renderer:\n{diff}\n"
            "accept with: python -m spswap.serve.sbatch --write"
        )


@pytest.mark.parametrize(("name", "text"), sorted(templates().items()))
def test_template_is_valid_bash(name, text):
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_handlers_only_forward_signals():
    text = render_serve()
    traps = [line for line in text.splitlines() if line.startswith("trap ")]
    assert traps == [
        "trap 'kill -USR1 \"$PID\" 2>/dev/null' USR1",
        "trap 'kill -TERM \"$PID\" 2>/dev/null' TERM",
    ]
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text


def test_options_are_quoted():
    text = render_serve(SbatchOptions(model="/models/a b'c", units=2, partition="gpu"))
    assert "MODEL='/models/a b'\"'\"'c'" in text
    assert "--units 2" in text and "#SBATCH --partition=gpu" in text


def test_vllm_template_passes_vllm_options_after_the_dashes():
    text = render_serve_vllm(
        SbatchOptions(
            engine="vllm", model="/m", vllm_args="--max-num-seqs 8 --served-model-name 'a b'"
        )
    )
    assert "VLLM_ARGS=(--max-num-seqs 8 --served-model-name 'a b')" in text
    assert "SERVE_ARGS=(--units 4 --eager)   # CHANGE: spswap serve's options" in text
    assert 'spswap serve "$MODEL" --state-dir "$STATE" "${SERVE_ARGS[@]}" --engine vllm -- ' \
        '"${VLLM_ARGS[@]}" &' in text  # fmt: skip
    head = text.split("\nSTATE=")[0]
    out = subprocess.run(["bash", "-c", head + '\nprintf "%s|" "${SERVE_ARGS[@]}" '
                          '"${VLLM_ARGS[@]}"'],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out == "--units|4|--eager|--max-num-seqs|8|--served-model-name|a b|"


def test_vllm_template_s_serve_options_are_spswap_serve_s_own():
    """What SERVE_ARGS holds is what `spswap serve` takes: --no-eager there is how a user
    gets vLLM's CUDA graphs (spswap passes --enforce-eager otherwise)."""
    from typer.testing import CliRunner

    from spswap.cli.app import app

    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for option in ("--units", "--eager", "--no-eager", "--port"):
        assert option in help_text, option
