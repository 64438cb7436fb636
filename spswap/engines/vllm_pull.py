"""Who moves a wake's weights right after a level-2 sleep: the copy engines or the GPU's
own cores (pure: bytes and seconds in, a share out; used by the vLLM worker)."""

from __future__ import annotations

# The driver clears the memory a level-2 sleep hands back (weights and KV cache) in the
# background, with the copy engines: host copies through them ran at ~20 GB/s for ~0.45 s
# after a sleep that freed 57.6 GB, and at full rate at once after one that freed 7.6 GB
# (H200, scripts/gpu/sleep_probe.py; docs/benchmarks.md). Meanwhile the GPU's cores pull
# the pool mapping at ~49 GB/s, against ~54 for idle copy engines.
SCRUB_FREE_BYTES = 8 << 30  # freed bytes that left the copy engines at full rate
SCRUB_BYTES_PER_S = 100e9  # how fast the rest is cleared (conservative: ~130e9 measured)
PULL_WINDOW_S = 2.0  # the window when the bytes freed are not known


def scrub_busy_s(released_bytes: int) -> float:
    """How long after a sleep that handed ``released_bytes`` back to the driver its copy
    engines are still busy clearing them (see :data:`SCRUB_BYTES_PER_S`)."""
    return max(0, released_bytes - SCRUB_FREE_BYTES) / SCRUB_BYTES_PER_S


def pull_share(since_sleep_s: float | None, released_bytes: int | None = None) -> float:
    """How much of a wake's copy the GPU's cores should pull themselves (see
    :func:`spswap.transfer.copy.copy_into`): all of it while the driver is still clearing
    what this process's own level-2 sleep released (:func:`scrub_busy_s`), when copies
    through the copy engines run at under half rate; none otherwise (a small KV cache, a
    restored, kept or long-asleep process: the idle copy engines' 52-54 GB/s beat the
    pull's ~49). ``released_bytes`` None (not known): within :data:`PULL_WINDOW_S`.
    ``since_sleep_s`` None: it never slept; negative: the clock is not the sleep's (a
    restore on another boot), so not right after it either."""
    if since_sleep_s is None or since_sleep_s < 0:
        return 0.0
    busy_s = PULL_WINDOW_S if released_bytes is None else scrub_busy_s(released_bytes)
    return 1.0 if since_sleep_s < busy_s else 0.0
