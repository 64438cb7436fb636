"""Generate docs/cli.md from the command tree, so the reference never drifts from --help.

python -m spswap.cli.docs --write     # regenerate docs/cli.md
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import typer

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


# Duck-typed on click's objects: typer vendors click in some versions and not in others.
def _param_line(p: Any) -> str:
    if p.param_type_name == "argument":
        head = f"- `{(p.metavar or p.name).upper()}` (argument{'' if p.required else ', optional'})"
        arg_help = " ".join((getattr(p, "help", None) or "").split())  # (typer's, not click's)
        return f"{head}: {arg_help}" if arg_help else head
    names = ", ".join(f"`{o}`" for o in p.opts + p.secondary_opts)
    if p.required:
        names += " (required)"
    help_text = " ".join((p.help or "").split())
    default = ""
    if isinstance(p.show_default, str) and p.show_default:
        default = f" (default: {p.show_default})"  # the text --help shows (no value: None)
    elif p.show_default not in (False, None) and p.default not in (None, False, "", ()):
        default = f" (default: `{p.default}`)"
    envvar = ""
    if p.envvar:
        names_of = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
        envvar = " (env: " + ", ".join(f"`{e}`" for e in names_of) + ")"
    return f"- {names}: {help_text}{envvar}{default}".rstrip(": ")


def heading(path: str) -> str:
    """A command's (or group's) heading, one level per word of its path below the page's
    title: ``## `spswap ask```, ``## `spswap pool```, ``### `spswap pool ls```."""
    return f"{'#' * len(path.split())} `{path}`"


def _command_md(path: str, cmd: Any) -> list[str]:
    doc = inspect.cleandoc(cmd.help or "")
    lines = [heading(path), ""]
    if doc:
        lines += [" ".join(para.split()) + "\n" for para in doc.split("\n\n")]
    params = [p for p in cmd.params if p.name not in ("help",)]
    lines += [_param_line(p) for p in params]
    return lines + [""]


def render_cli_md(app: typer.Typer) -> str:
    """The whole CLI reference as Markdown (pure function of the command tree)."""
    root = typer.main.get_command(app)
    out = ["# spswap command reference", "",
           "Generated from the commands themselves (`python -m spswap.cli.docs --write`); "
           "`spswap COMMAND --help` shows the same.", ""]  # fmt: skip

    def walk(prefix: str, cmd: Any) -> None:
        if hasattr(cmd, "commands"):
            if prefix != "spswap":
                out.extend([heading(prefix), "", " ".join((cmd.help or "").split()), ""])
            for name in sorted(cmd.commands):
                walk(f"{prefix} {name}", cmd.commands[name])
        else:
            out.extend(_command_md(prefix, cmd))

    walk("spswap", root)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    from spswap.cli.app import app

    if argv[1:] != ["--write"]:
        print("usage: python -m spswap.cli.docs --write", file=sys.stderr)
        return 2
    DOC_PATH.write_text(render_cli_md(app))
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
