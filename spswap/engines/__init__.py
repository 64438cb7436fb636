"""Engines: what spswap swaps. One protocol (:mod:`spswap.engines.protocol`), a small torch
reference engine for tests and the demo (:mod:`spswap.engines.reference`)."""
