"""Placeholder; replaced by the events command."""


def events() -> None:
    """Show the event log."""
