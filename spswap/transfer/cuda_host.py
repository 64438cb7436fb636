"""``cudaHostRegister`` / ``cudaHostUnregister`` of a read-only host mapping.

Registered (page-locked) host memory feeds host->GPU copies at the PCIe limit
(53-55 GB/s on an H200, the same as ``cudaHostAlloc`` memory); pageable memory reaches
6-8 GB/s. Registering costs ~0.33 s/GiB the first time, so a mapping is registered
once and kept registered for its life.

A pool entry is mapped read-only (users cannot write pool files), and the driver can
pin read-only pages only with ``cudaHostRegisterReadOnly`` (CUDA >= 11.1, on devices
that report ``cudaDevAttrHostRegisterReadOnlySupported``). We go through
``torch.cuda.cudart()`` when it exposes the calls, else ``cuda.bindings.runtime``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from spswap.errors import TransferError
from spswap.install_hint import pip_install_hint

# cudaHostRegister flags (cuda_runtime_api.h)
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08


@dataclass(frozen=True)
class Registration:
    """One registered host range."""

    address: int
    size_bytes: int
    flags: int
    seconds: float  # what registering took


def available() -> bool:
    """Whether host registration can work here (a CUDA device is visible)."""
    return torch.cuda.is_available()


def _error_code(ret: Any) -> int:
    # torch's cudart returns a pybind enum; cuda.bindings returns a 1-tuple of an enum.
    if isinstance(ret, tuple):
        ret = ret[0]
    return int(getattr(ret, "value", ret))


def _runtime_calls() -> tuple[Any, Any, Any]:
    """(register(ptr, size, flags), unregister(ptr), error_name(code)) from some binding."""
    rt = torch.cuda.cudart()
    if hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister"):
        return rt.cudaHostRegister, rt.cudaHostUnregister, _torch_error_name
    try:
        from cuda.bindings import runtime as cbr  # type: ignore[import-not-found]
    except ImportError:
        raise TransferError(
            f"torch {torch.__version__} does not expose cudaHostRegister and "
            f"cuda-bindings is not installed: `{pip_install_hint('gpu')}`"
        ) from None
    return cbr.cudaHostRegister, cbr.cudaHostUnregister, _bindings_error_name


def _torch_error_name(code: int) -> str:
    try:
        return str(torch.cuda.cudart().cudaGetErrorString(code))  # type: ignore[attr-defined]
    except Exception:
        return f"cudaError {code}"


def _bindings_error_name(code: int) -> str:
    try:
        from cuda.bindings import runtime as cbr  # type: ignore[import-not-found]

        return str(cbr.cudaGetErrorString(cbr.cudaError_t(code))[1])
    except Exception:
        return f"cudaError {code}"


def register(address: int, size_bytes: int, *, read_only: bool = True) -> Registration:
    """Page-lock ``[address, address + size_bytes)`` for DMA from every CUDA context.

    Raises :class:`TransferError` when the driver refuses; the caller may then copy from
    the unregistered mapping at pageable speed.
    """
    if not available():
        raise TransferError("no CUDA device is visible: host registration needs one")
    if size_bytes <= 0:
        raise TransferError("cannot register an empty range")
    torch.cuda.current_device()  # the runtime needs a context before registering
    reg, _unreg, name = _runtime_calls()
    flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
    start = time.perf_counter()
    code = _error_code(reg(address, size_bytes, flags))
    seconds = time.perf_counter() - start
    if code != 0:
        hint = (
            "this GPU or driver may not support read-only registration "
            "(cudaDevAttrHostRegisterReadOnlySupported); copies will run at pageable speed"
            if read_only
            else "check the locked-memory limit (ulimit -l) and free host memory"
        )
        raise TransferError(
            f"cudaHostRegister of {size_bytes} bytes at {address:#x} failed: "
            f"{name(code)} (code {code}); {hint}"
        )
    return Registration(address=address, size_bytes=size_bytes, flags=flags, seconds=seconds)


def unregister(registration: Registration) -> None:
    """Undo :func:`register`. Errors are raised: a leaked registration pins memory."""
    _reg, unreg, name = _runtime_calls()
    code = _error_code(unreg(registration.address))
    if code != 0:
        raise TransferError(
            f"cudaHostUnregister at {registration.address:#x} failed: {name(code)} "
            f"(code {code}); the range stays page-locked until this process exits"
        )
