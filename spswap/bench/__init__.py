"""Benchmarks behind ``spswap bench``: side-by-side measurements, reported as ratios."""
