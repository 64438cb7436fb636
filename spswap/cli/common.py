"""Helpers every command module shares: config, JSON output, the consoles."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from spswap.config import Config
from spswap.errors import SpswapError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

JsonOpt = typer.Option(
    False,
    "--json",
    help="Print machine-readable JSON instead of tables; when spswap refuses or fails, "
    '{"error": {"kind", "message", "exit_code"}} on stdout, the message on stderr too (a '
    "usage error: an unknown option, a missing or invalid argument, prints its usage text "
    "only, exit 2).",
)
RootOpt = typer.Option(
    None, "--root", envvar="SPSWAP_ROOT",
    help="spswap's state directory (pool, slots, images) on node-local tmpfs.",
    show_default="SPSWAP_ROOT of /etc/default/spswap, else /dev/shm/spswap",
)  # fmt: skip


def load_config(root: Path | None = None) -> Config:
    """The node's settings (``/etc/default/spswap``), the environment's ``SPSWAP_*`` over
    them, ``--root`` over both: what the daemon and the Slurm hooks read too."""
    return Config.load(root=root)


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON on stdout (sorted keys, so scripts and goldens are stable)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def error_json(err: SpswapError) -> dict[str, Any]:
    """What a command run with ``--json`` prints on stdout when it fails with one of
    spswap's own errors: ``{"error": {"kind", "message", "exit_code"}}`` (the same message
    goes to stderr as text). ``kind`` is the error's class name, e.g. ``PermissionDenied``.
    Pure."""
    return {"error": {"kind": type(err).__name__, "message": str(err),
                      "exit_code": err.exit_code}}  # fmt: skip


def print_error(err: SpswapError) -> None:
    """The one line on stderr for a command that failed with ``err``: the command's name
    first (as its other lines in a job log have it), the message as text, not markup
    ("spswap[torch]" prints as written)."""
    command = " ".join(["spswap", *[a for a in sys.argv[1:] if not a.startswith("-")][:1]])
    err_console.print(f"{escape(command)}: [bold red]error:[/] {escape(str(err))}",
                      markup=True, soft_wrap=True)  # fmt: skip


def emit(result: Any, as_json: bool, render: Callable[[Any], Any]) -> None:
    """``result`` as JSON (for scripts) or as the table ``render`` makes of it."""
    if as_json:
        emit_json(result)
    else:
        console.print(render(result))


class UsageProblem(typer.BadParameter):
    """A usage error about a command line's words, said as it is ("no such option: --unit
    ..."), not as a bad value ("Invalid value: ...": no value was given)."""

    def format_message(self) -> str:
        return self.message


def nonempty_path(text: str) -> Path:
    """A path option's value; an empty one (``--state-dir "$STATE"`` with STATE unset) is
    refused rather than taken as the current directory."""
    if not text.strip():
        raise typer.BadParameter("is empty (an unset shell variable?): name a directory, or "
                                 "leave the option out")  # fmt: skip
    return Path(text)


def checked_model_dir(path: Path, *, many: bool) -> Path:
    """``path`` resolved when it is a directory, else the error that says what to give
    (``many``: one of ``--models``'s). A template's unchanged ``/path/to/...`` is named."""
    if path.is_dir():
        return path.resolve()
    what = "does not exist" if not path.exists() else "is not a directory"
    line = "MODELS=" if many else "MODEL="
    template = (f" (an sbatch template's {line} CHANGE line still has its example)"
                if str(path).startswith("/path/to/") else "")  # fmt: skip
    rest = ("; after --models, every word that is not one of spswap serve's options is a "
            "model directory (vLLM's own options go in --vllm-args)") if many else ""  # fmt: skip
    raise typer.BadParameter(f"model directory {path} {what}{template}{rest}")


def given_flags(ctx: typer.Context) -> list[str]:
    """The options of ``ctx``'s command the user gave (on the command line or through
    an environment variable), each by its long name as written: ``--no-pack`` for a
    ``--pack/--no-pack`` switch turned off. Defaults are not named."""
    # (by the source's name: typer vendors click in some versions and not in others)
    given = ("COMMANDLINE", "ENVIRONMENT")
    flags: list[str] = []
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name is None:
            continue
        if getattr(ctx.get_parameter_source(param.name), "name", None) not in given:
            continue
        turned_off = ctx.params.get(param.name) is False and param.secondary_opts
        flags.append(max(param.secondary_opts if turned_off else param.opts, key=len))
    return flags
