"""Placeholder; replaced by the doctor command."""


def doctor() -> None:
    """Check this node."""
