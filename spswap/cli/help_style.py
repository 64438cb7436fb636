"""How ``--help`` names things: ``Usage: spswap serve [OPTIONS] MODEL`` (arguments in
capitals, optional ones in brackets), and no ``<bool>`` after a flag, which takes no value.

Recent typer writes required arguments as ``{model}`` and gives every flag a ``<bool>``
type; :func:`apply` gives every command and group of an app the classes below, which say
it the way the docs do. Options that take a value keep their type (``<int>``, ``<path>``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

# Help read through a pipe or in a job log (no terminal: rich assumes 80 columns) cut
# option names short ("--gpu-memory-uti…"); this width fits them.
PIPED_HELP_COLUMNS = 120
# Below this width rich's option table cuts names short in a real terminal too (a walk at
# 80 columns: "--gpu-memory-uti…", a 17-column description); the plain layout wraps whole.
NARROW_HELP_COLUMNS = 100


@contextlib.contextmanager
def _wide_when_piped() -> Iterator[None]:
    """COLUMNS for the help's rich console where no terminal gives a width and the
    caller set none (a terminal's own width, or COLUMNS, is kept)."""
    if "COLUMNS" in os.environ or sys.stdout.isatty():
        yield
        return
    os.environ["COLUMNS"] = str(PIPED_HELP_COLUMNS)
    try:
        yield
    finally:
        os.environ.pop("COLUMNS", None)


def _tidy(params: list[Any]) -> None:
    for p in params:
        if p.param_type_name == "argument" and p.metavar is None:
            p.metavar = p.name.upper()
        elif getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""  # a flag takes no value: no type to show


def _usage(cmd: Any, ctx: Any) -> list[str]:
    pieces = [cmd.options_metavar] if cmd.options_metavar else []
    for p in cmd.get_params(ctx):
        if p.param_type_name != "argument":
            continue
        name = (p.metavar or p.name).upper() + ("..." if p.nargs != 1 else "")
        pieces.append(name if p.required else f"[{name}]")
    return pieces


class _Tidied:
    """What :class:`Command` and :class:`Group` share: their options named the same way
    (no type shown for flags), help laid out wide when piped (a job log, a grep)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _tidy(self.params)  # type: ignore[attr-defined]

    def get_help(self, ctx: Any) -> str:
        with _wide_when_piped():
            return str(super().get_help(ctx))  # type: ignore[misc]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Rich's layout where the terminal is wide enough; else click's plain one, whose
        option names stay whole (typer takes it where no markup mode is set)."""
        if shutil.get_terminal_size((PIPED_HELP_COLUMNS, 24)).columns >= NARROW_HELP_COLUMNS:
            super().format_help(ctx, formatter)  # type: ignore[misc]
            return
        mode = getattr(self, "rich_markup_mode", None)
        setattr(self, "rich_markup_mode", None)  # noqa: B010 - typer's attribute, not ours
        try:
            super().format_help(ctx, formatter)  # type: ignore[misc]
        finally:
            setattr(self, "rich_markup_mode", mode)  # noqa: B010

    def get_help_option(self, ctx: Any) -> Any:
        opt = super().get_help_option(ctx)  # type: ignore[misc]
        if opt is not None:
            _tidy([opt])
        return opt


class Command(_Tidied, TyperCommand):
    """A command whose help reads ``[OPTIONS] MODEL`` and shows no type for flags."""

    extra_usage = ""  # what the usage line shows after the arguments (a subclass's)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return _usage(self, ctx) + ([self.extra_usage] if self.extra_usage else [])


class Group(_Tidied, TyperGroup):
    """A group of commands, named the same way as :class:`Command`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        metavar = getattr(self, "subcommand_metavar", None)
        return _usage(self, ctx) + ([metavar] if metavar else [])


def apply(app: typer.Typer) -> None:
    """Give ``app``, its sub-apps and every command in them the classes above (where no
    other class was asked for)."""
    if app.info.cls in (None, TyperGroup) or not isinstance(app.info.cls, type):
        app.info.cls = Group
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand) or not isinstance(info.cls, type):
            info.cls = Command
    for group in app.registered_groups:
        if group.typer_instance is not None:
            apply(group.typer_instance)
