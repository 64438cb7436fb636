"""Placeholder; replaced by the demo command."""


def demo() -> None:
    """Run the demo."""
