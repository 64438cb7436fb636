"""The CUDA context's per-thread stack limit, through the driver API (ctypes; no torch).

A CUDA context keeps local memory for every thread its GPU can hold at once: the
per-thread stack (``CU_LIMIT_STACK_SIZE``, 1 KiB by default) times the resident threads
of every SM (2048 x 132 on an H100: 264 MiB). A sleeping vLLM engine holds it with the
rest of its context, and a CUDA checkpoint copies it to host memory (into the image) and
back at the restore. Set smaller before the checkpoint, the driver frees it (H100, 0.5B
eager: 930 -> 670 MiB left asleep at 16 bytes; CUDA checkpoint 0.56 -> 0.36 s, restore
0.43 -> 0.29 s, the same answers); set back before the engine's next kernel, the engine
runs as before. (The driver also grows the stack itself for a launch that needs more.)

Each call acts on the CUDA context current on the calling thread.
"""

from __future__ import annotations

import ctypes

STACK_LIMIT = 0  # CUlimit CU_LIMIT_STACK_SIZE
TRIMMED_STACK_BYTES = 16  # as the probe set it: a 64th of the default, ~4 MiB on an H100


def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver on this machine
        return None


def stack_bytes() -> int | None:
    """The current context's per-thread stack in bytes (``cuCtxGetLimit``); None without
    a driver or a current context."""
    cuda = _driver()
    if cuda is None:
        return None
    value = ctypes.c_size_t(0)
    if cuda.cuCtxGetLimit(ctypes.byref(value), ctypes.c_int(STACK_LIMIT)) != 0:
        return None
    return int(value.value)


def set_stack_bytes(size_bytes: int) -> bool:
    """Set the current context's per-thread stack (``cuCtxSetLimit``; it waits for the
    context's work to finish); whether the driver took it."""
    cuda = _driver()
    if cuda is None:
        return False
    return int(cuda.cuCtxSetLimit(ctypes.c_int(STACK_LIMIT), ctypes.c_size_t(size_bytes))) == 0
