"""``spswap serve`` runs without the rest of the CLI (a requeued run's start is on the
swap's path), and is the same command there as in the full app."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from spswap.cli import app as full
from spswap.cli import serve_app


def test_serve_alone_says_the_same_as_in_the_full_app() -> None:
    runner = CliRunner()
    for args in (["serve", "--help"], ["serve"], ["serve", "/nonexistent/model"]):
        alone = runner.invoke(serve_app.build(), args, prog_name="spswap")
        whole = runner.invoke(full.app, args, prog_name="spswap")
        assert (alone.exit_code, alone.output) == (whole.exit_code, whole.output), args
    assert "Usage: spswap serve [OPTIONS] MODEL" in runner.invoke(
        serve_app.build(), ["serve", "--help"], prog_name="spswap").output  # fmt: skip


def test_the_console_script_loads_serve_alone() -> None:
    code = (
        "import sys\nsys.argv = ['spswap', 'serve', '--help']\n"
        "from spswap.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith('spswap.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    assert "Usage: spswap serve" in out
    loaded = out.split("LOADED", 1)[1]
    assert "spswap.cli.serve'" in loaded
    for other in ("spswap.cli.app", "spswap.cli.bench", "spswap.cli.daemon", "spswap.cli.pool"):
        assert f"'{other}'" not in loaded, other


def test_help_read_through_a_pipe_keeps_option_names_whole() -> None:
    """No terminal (a pipe, a job log): rich would lay the help out in 80 columns and cut
    "--gpu-memory-utilization" short; the usage line names what follows --."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "spswap.cli", "serve", "--help"],
                         env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "serve [OPTIONS] MODEL [-- VLLM_OPTIONS...]" in out  # (python -m spswap.cli)
    for option in ("--gpu-memory-utilization", "--latency-target-s", "--no-exit-when-idle"):
        assert option in out, option


def test_help_in_a_narrow_terminal_keeps_option_names_whole() -> None:
    """A walk at 80 columns (a real terminal): rich's option table cut "--gpu-memory-uti…"
    and gave the descriptions 17 columns; below 100 columns the plain layout wraps whole."""
    import os

    for columns in ("80", "60"):
        out = subprocess.run([sys.executable, "-m", "spswap.cli", "serve", "--help"],
                             env={**os.environ, "COLUMNS": columns}, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        for option in ("--gpu-memory-utilization", "--latency-target-s", "--no-exit-when-idle"):
            assert option in out, (columns, option)
        assert "…" not in out and "╭" not in out, out
        assert max(len(line) for line in out.splitlines()) <= int(columns), out
    wide = subprocess.run([sys.executable, "-m", "spswap.cli", "serve", "--help"],
                          env={**os.environ, "COLUMNS": "140"}, capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    assert "╭─ Options" in wide  # rich's layout where it fits
