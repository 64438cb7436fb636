"""``python -m spswap.daemon``: run spswapd in the foreground."""

import sys

from spswap.daemon.main import main

sys.exit(main())
