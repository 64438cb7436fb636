"""spswapd, the per-node daemon: socket protocol, server, event log and lifecycle.

Import the submodule you need; this package imports nothing so that the prolog's path
(``lifecycle`` + ``client``) stays fast.
"""
