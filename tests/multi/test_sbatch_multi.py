"""serve_multi.sbatch is exactly its renderer's output, valid bash, quoting its models."""

from __future__ import annotations

import difflib
import subprocess

import pytest

from spswap.multi.sbatch import FILE_NAME, MultiSbatchOptions, render_serve_multi
from spswap.serve.sbatch import TEMPLATES_DIR


def test_golden_file():
    on_disk, text = (TEMPLATES_DIR / FILE_NAME).read_text(), render_serve_multi()
    if on_disk != text:
        diff = "".join(difflib.unified_diff(on_disk.splitlines(True), text.splitlines(True)))
        pytest.fail(f"{diff}\naccept with: python -m spswap.multi.sbatch --write")


def test_valid_bash_and_models_quoted():
    text = render_serve_multi(MultiSbatchOptions(models=("/m/a b", "/m/c'd"),
                                                 latency_target_s=2.0))  # fmt: skip
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    head = text.split("\nSTATE=")[0]
    out = subprocess.run(["bash", "-c", head + '\nprintf "%s|" "${MODELS[@]}"'],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out == "/m/a b|/m/c'd|"
    assert ('spswap serve --models "${MODELS[@]}" --state-dir "$STATE" --socket auto \\\n'
            '    --engine "$ENGINE" "${ENGINE_ARGS[@]}" --units 2 \\\n'
            "    --idle-timeout-s 600 --latency-target-s 2 &") in text  # fmt: skip


def test_engine_lines_are_what_the_run_gets():
    text = render_serve_multi(MultiSbatchOptions(engine="reference", engine_args=()))
    head = text.split("\nSTATE=")[0]
    out = subprocess.run(["bash", "-c", head + '\nprintf "%s|" "$ENGINE" "${ENGINE_ARGS[@]}"'],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out == "reference|"
    default = render_serve_multi()
    head = default.split("\nSTATE=")[0]
    out = subprocess.run(["bash", "-c", head + '\nprintf "%s|" "$ENGINE" "${ENGINE_ARGS[@]}"'],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out == "vllm|--kv-cache-gib|4|"
