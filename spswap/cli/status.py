"""Placeholder; replaced by the status command."""


def status() -> None:
    """Show GPUs, slots, pool entries and instances."""
