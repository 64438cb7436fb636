"""Who moves a wake's weights right after a level-2 sleep: the copy engines or the GPU's
own cores (pure: bytes and seconds in, a share out; used by the vLLM worker)."""

from __future__ import annotations

# The driver clears the memory a level-2 sleep hands back (weights and KV cache) in the
# background, with the copy engines: host copies through them ran at ~20 GB/s for ~0.45 s
# after a sleep that freed 57.6 GB, and at full rate at once after one that freed 7.6 GB
# (H200, scripts/gpu/sleep_probe.py; docs/benchmarks.md). Meanwhile the GPU's cores pull
# the pool mapping at ~49 GB/s on the H200 but ~34 GB/s on the H100 (a 7B, 15.2 GB,
# pulled: 0.45 s, where the copy engines would take ~0.35 s), against ~54 for idle copy
# engines on both: so the cores pull only where that is faster at the GPU's own rate.
SCRUB_FREE_BYTES = 8 << 30  # freed bytes that left the copy engines at full rate
SCRUB_BYTES_PER_S = 100e9  # how fast the rest is cleared (conservative: ~130e9 measured)
SCRUBBING_COPY_BYTES_PER_S = 20e9  # the copy engines' rate while the driver clears
COPY_BYTES_PER_S = 54e9  # idle copy engines, pinned host -> GPU (H100, H200)
PULL_BYTES_PER_S = 34e9  # the cores' pull on a GPU not measured: the slower one (H100)
# the cores' pull where measured, by a word of the GPU's name (docs/benchmarks.md)
PULL_BYTES_PER_S_BY_GPU = {"H200": 49e9, "H100": 34e9}
PULL_WINDOW_S = 2.0  # the window when the bytes freed are not known


def pull_bytes_per_s(gpu_name: str) -> float:
    """How fast the cores of the GPU named ``gpu_name`` (as CUDA names it, e.g. "NVIDIA
    H200") pull the pool mapping: its measured rate, else :data:`PULL_BYTES_PER_S`."""
    words = gpu_name.upper().replace("-", " ").split()
    rates = [rate for gpu, rate in PULL_BYTES_PER_S_BY_GPU.items() if gpu in words]
    return rates[0] if rates else PULL_BYTES_PER_S


def scrub_busy_s(released_bytes: int) -> float:
    """How long after a sleep that handed ``released_bytes`` back to the driver its copy
    engines are still busy clearing them (see :data:`SCRUB_BYTES_PER_S`)."""
    return max(0, released_bytes - SCRUB_FREE_BYTES) / SCRUB_BYTES_PER_S


def copy_engines_s(copy_bytes: int, busy_s: float) -> float:
    """How long the copy engines take to move ``copy_bytes`` while the driver still
    clears for ``busy_s`` seconds: the slow rate first, the full rate after."""
    during_bytes = busy_s * SCRUBBING_COPY_BYTES_PER_S
    if copy_bytes <= during_bytes:
        return copy_bytes / SCRUBBING_COPY_BYTES_PER_S
    return busy_s + (copy_bytes - during_bytes) / COPY_BYTES_PER_S


def pull_share(since_sleep_s: float | None, released_bytes: int | None = None,
               copy_bytes: int | None = None,
               pull_rate_bytes_per_s: float = PULL_BYTES_PER_S) -> float:  # fmt: skip
    """How much of a wake's copy the GPU's cores should pull themselves (see
    :func:`spswap.transfer.copy.copy_into`; a share between, pulled first and the rest
    copied by the engines after it, was no faster than the engines alone and slower than
    pulling all: a 7B on an H100, 45.9-47.0 GB/s against 50.0-50.8 pulled,
    docs/notes/copy-after-sleep.md): all of it while the driver is still clearing
    what this process's own level-2 sleep released (:func:`scrub_busy_s`) and the pull
    of ``copy_bytes`` (at ``pull_rate_bytes_per_s``: :func:`pull_bytes_per_s` of the
    GPU) is faster than the copy engines' slowed copy
    (:func:`copy_engines_s`; a large model after a small KV cache: the copy outlasts the
    clearing, so the engines' full rate wins); none otherwise (a small KV cache, a
    restored, kept or long-asleep process: the idle copy engines beat the pull).
    ``released_bytes`` None (not known): within :data:`PULL_WINDOW_S`. ``copy_bytes``
    None: the copy's size is not weighed. ``since_sleep_s`` None: it never slept;
    negative: the clock is not the sleep's (a restore on another boot), so not right
    after it either."""
    if since_sleep_s is None or since_sleep_s < 0:
        return 0.0
    busy_s = PULL_WINDOW_S if released_bytes is None else scrub_busy_s(released_bytes)
    left_s = busy_s - since_sleep_s
    if left_s <= 0:
        return 0.0
    if copy_bytes is None:
        return 1.0
    pull_s = copy_bytes / pull_rate_bytes_per_s
    return 1.0 if pull_s < copy_engines_s(copy_bytes, left_s) else 0.0
