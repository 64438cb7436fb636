"""Table rows shown as plain text: what users wrote (model and entry names, instance
fields, reasons) reaches other users' `spswap status`, `pool ls`, `slots ls` and
`events`, and must never be read as rich markup (a name like ``m[/bold]`` broke every
user's status; a ``[link=...]`` one became a hyperlink in their terminal)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
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


def fits_unwrapped(console: Console, options: ConsoleOptions, table: Table) -> bool:
    """Whether ``table``'s rows fit the terminal without wrapping a cell (its unclamped
    widest width within ``options.max_width``)."""
    wide = options.update_width(1 << 16)
    return Measurement.get(console, wide, table).maximum <= options.max_width


class DropToFit:
    """A table built at render time, leaving out its least needed columns (``droppable``,
    the first to go first) while its rows would not fit the terminal unwrapped; the
    caption names what was left out. At 80 columns every column folded its values
    mid-token ("checkpoin" / "t", an id over two lines)."""

    def __init__(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
                 droppable: Sequence[str], left_out_note: str,
                 caption: str = "") -> None:  # fmt: skip
        self.title, self.columns, self.rows = title, list(columns), rows
        self.droppable, self.left_out_note, self.caption = droppable, left_out_note, caption

    def build(self, columns: Sequence[str]) -> Table:
        """The table with ``columns`` only (plain cells, folded where they must)."""
        t = Table(title=self.title, caption=self.caption or None)
        for col in columns:
            t.add_column(col, overflow="fold")
        keep = [self.columns.index(c) for c in columns]
        for row in self.rows:
            plain_row(t, *(row[i] for i in keep))
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = list(self.columns)
        table = self.build(columns)
        for name in self.droppable:
            if fits_unwrapped(console, options, table):
                break
            columns.remove(name)
            table = self.build(columns)
        left = [c for c in self.columns if c not in columns]
        if left:
            note = f"{', '.join(left)}: {self.left_out_note}"
            table.caption = f"{self.caption}\n{note}" if self.caption else note
        yield table
