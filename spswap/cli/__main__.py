"""``python -m spswap.cli``: the same as the ``spswap`` command."""

from spswap.cli.app import main

main()
