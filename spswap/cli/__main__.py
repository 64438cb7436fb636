"""``python -m spswap.cli``: the same as the ``spswap`` command (fast hooks included)."""

from spswap.cli.main import main

main()
