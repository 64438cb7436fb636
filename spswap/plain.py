"""Table rows shown as plain text: what users wrote (model and entry names, instance
fields, reasons) reaches other users' `spswap status`, `pool ls`, `slots ls` and
`events`, and must never be read as rich markup (a name like ``m[/bold]`` broke every
user's status; a ``[link=...]`` one became a hyperlink in their terminal)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


def plain_row(table: Table, *cells: object) -> None:
    """Add one row whose cells are shown exactly as ``str()`` gives them."""
    table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in cells))


class TitleOnOneLine:
    """A table whose title stays on one line where the terminal is wide enough: rich
    folds a title to the table's width, which its columns set, so a long title over
    narrow columns took two lines ("... at most 9.4" then "GiB"); a fixed minimum wider
    than the terminal cropped the table's right edge instead."""

    def __init__(self, table: Table) -> None:
        self.table = table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        title = self.table.title
        self.table.min_width = min(len(str(title or "")), options.max_width)
        yield self.table
