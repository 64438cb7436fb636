"""``spswap serve`` without the rest of the CLI.

A requeued run's start is on every swap's path (a kept turn waits for it), and the full
app (:mod:`spswap.cli.app`) imports every command's modules first: the benchmarks, the
daemon, the images, the doctor (about 0.2 s on the H200, a sixth of a kept turn's
spswap share). :mod:`spswap.cli.main` sends ``spswap serve ...`` here. The command is
the same function, registered the same way (:func:`register`, used by the full app too),
so its options, ``--help`` and errors are the full app's.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from spswap.cli import help_style, serve
from spswap.cli.common import emit_json, error_json, print_error
from spswap.cli.serve_words import AFTER_DASHDASH
from spswap.errors import PathUnusable, PermissionDenied, SpswapError

# vLLM's own options follow `--`: they reach the command as ctx.args
SERVE_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


class ServeCommand(help_style.Command):
    """``serve``: its usage line names what follows ``--``; what follows it is kept apart
    (:data:`AFTER_DASHDASH`), so that a mistyped option before it is told as one."""

    extra_usage = "[-- VLLM_OPTIONS...]"

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta[AFTER_DASHDASH] = args[args.index("--") + 1 :] if "--" in args else []
        return super().parse_args(ctx, args)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``."""
    app.command("serve", context_settings=SERVE_CONTEXT, cls=ServeCommand)(serve.serve)


def make_app(**typer_kwargs: object) -> typer.Typer:
    """A typer app as spswap's commands need it (no completion, no pretty tracebacks,
    markdown help); ``typer_kwargs`` add to or replace those settings."""
    settings: dict[str, object] = {"name": "spswap", "no_args_is_help": True,
                                   "pretty_exceptions_enable": False, "add_completion": False,
                                   "rich_markup_mode": "markdown"}  # fmt: skip
    settings.update(typer_kwargs)
    return typer.Typer(**settings)  # type: ignore[arg-type]


def run_app(app: typer.Typer) -> None:
    """Run ``app``; spswap's own errors print as one clear message and exit with their
    code."""
    try:
        try:
            app()
        except OSError as os_err:  # a path this user cannot use: one clear line, not a trace
            error = path_error(os_err)
            if error is None:
                raise
            raise error from None
    except SpswapError as e:
        print_error(e)
        if asked_json(sys.argv[1:]):
            # a script that asked for JSON reads one object on stdout, a refusal included
            emit_json(error_json(e))
        sys.exit(e.exit_code)


def path_error(err: OSError) -> SpswapError | None:
    """The error to show for an OSError about one path (another user's, missing, not a
    directory), in the user's words with what to check; None for any other OSError (a
    bug: its traceback stays). Pure."""
    if err.filename is None or not isinstance(
        err, PermissionError | FileNotFoundError | NotADirectoryError | IsADirectoryError
    ):
        return None
    what = f"cannot use {err.filename}: {(err.strerror or str(err)).lower()}"
    if isinstance(err, PermissionError):
        return PermissionDenied(f"{what}; run as root, or give a --root (SPSWAP_ROOT) this "
                                "user may read")  # fmt: skip
    return PathUnusable(f"{what}; check the path, and --root (SPSWAP_ROOT: spswap's state "
                        "directory, e.g. /dev/shm/spswap)")  # fmt: skip


def asked_json(args: list[str]) -> bool:
    """Whether the command line asks for ``--json`` (not after ``--``: vLLM's own options
    follow it in ``spswap serve``). Pure."""
    ours = args[: args.index("--")] if "--" in args else args
    return "--json" in ours


def build() -> typer.Typer:
    """The ``spswap`` group with ``serve`` alone in it (so the usage line reads
    ``spswap serve``, as in the full app)."""
    app = make_app()
    register(app)

    @app.callback()
    def _root() -> None:
        """spswap: swap models on shared GPU nodes in seconds, not minutes."""

    help_style.apply(app)  # --help: "[OPTIONS] MODEL", no "<bool>" after a flag
    return app


def main() -> None:
    """``spswap serve ...``, as the full app runs it."""
    run_app(build())
