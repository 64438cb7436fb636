"""Table rows shown as plain text: what users wrote (model and entry names, instance
fields, reasons) reaches other users' `spswap status`, `pool ls`, `slots ls` and
`events`, and must never be read as rich markup (a name like ``m[/bold]`` broke every
user's status; a ``[link=...]`` one became a hyperlink in their terminal)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def plain_row(table: Table, *cells: object) -> None:
    """Add one row whose cells are shown exactly as ``str()`` gives them."""
    table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in cells))
