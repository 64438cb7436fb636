"""Copy a mapped pool entry into a model's parameters.

Names, shapes and dtypes are all checked before a single byte moves, so a mismatch
leaves the model as it was. On CUDA the mapping is page-locked once
(:meth:`MappedEntry.register_cuda`), every tensor is copied asynchronously on one
dedicated stream, and the host waits once at the end. On CPU the copies are plain.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from spswap.errors import TransferError
from spswap.pool.manifest import Manifest
from spswap.transfer.dtypes import to_safetensors
from spswap.transfer.mapping import MappedEntry

MAX_LISTED_MISMATCHES = 5


@dataclass(frozen=True)
class TransferReport:
    """What one :func:`copy_into` moved and how fast."""

    size_bytes: int
    seconds: float  # the copies, first issue to last byte landed
    device: str
    tensors: int
    registered: bool  # whether the source was page-locked (full DMA speed on CUDA)
    register_s: float = 0.0  # time spent registering during this call (0 when reused)

    @property
    def gb_per_s(self) -> float:
        return self.size_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gb_per_s": self.gb_per_s}


def _dtype_name(t: torch.Tensor) -> str:
    try:
        return to_safetensors(t.dtype)
    except TransferError:
        return str(t.dtype)


def mismatches(manifest: Manifest, params: Mapping[str, torch.Tensor]) -> list[str]:
    """Every difference between the entry's tensors and ``params``, one line each."""
    problems: list[str] = []
    entries = manifest.by_name()
    for name in sorted(entries.keys() - params.keys()):
        problems.append(f"{name}: in the pool entry, not in the model")
    for name in sorted(params.keys() - entries.keys()):
        problems.append(f"{name}: in the model, not in the pool entry")
    for name in sorted(entries.keys() & params.keys()):
        e, p = entries[name], params[name]
        if tuple(p.shape) != tuple(e.shape):
            problems.append(
                f"{name}: shape {list(e.shape)} in the pool, {list(p.shape)} in the model"
            )
        if _dtype_name(p) != e.dtype:
            problems.append(f"{name}: dtype {e.dtype} in the pool, {_dtype_name(p)} in the model")
    return problems


def check_compatible(manifest: Manifest, params: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`TransferError` unless names, shapes and dtypes match both ways."""
    problems = mismatches(manifest, params)
    if not problems:
        return
    shown = "\n  ".join(problems[:MAX_LISTED_MISMATCHES])
    more = len(problems) - MAX_LISTED_MISMATCHES
    tail = f"\n  ... and {more} more" if more > 0 else ""
    raise TransferError(
        f"pool entry {manifest.name} ({manifest.digest[:12]}) does not fit this model: "
        f"{len(problems)} mismatch(es), nothing was copied:\n  {shown}{tail}\n"
        "The entry was made from another model or layout: import this model's own "
        "checkpoint (spswap pool import) or export the running engine's weights to the pool."
    )


def _device_of(params: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {p.device for p in params.values()}
    if len(devices) > 1:
        raise TransferError(
            f"the parameters span several devices ({', '.join(sorted(map(str, devices)))}); "
            "copy each device's parameters in its own call"
        )
    return next(iter(devices)) if devices else torch.device("cpu")


def copy_into(
    mapping: MappedEntry,
    params: Mapping[str, torch.Tensor],
    *,
    stream: torch.cuda.Stream | None = None,
    staging_bytes: int | None = None,
) -> TransferReport:
    """Copy every tensor of ``mapping`` into the same-named tensor of ``params``.

    Checks everything first (:func:`check_compatible`); then on CUDA registers the
    mapping if it is not yet (once per mapping), issues the async copies on ``stream``
    (a fresh dedicated stream if none) and synchronizes once.

    ``staging_bytes``: copy host -> a contiguous device buffer of at most that size, in
    large pieces, then device -> parameters. For destinations the copy engines write
    slowly: after vLLM's level-2 sleep and wake, its re-mapped weight memory took host
    copies at ~20 GB/s where a plain allocation took ~50 (H200); the device-side copies
    cost little next to PCIe.
    """
    check_compatible(mapping.manifest, params)
    device = _device_of(params)
    sources = mapping.tensors()
    size_bytes = sum(t.size_bytes for t in mapping.manifest.tensors)
    register_s = 0.0
    if device.type == "cuda":
        if not mapping.registered:
            try:
                register_s = mapping.register_cuda()
            except TransferError as e:
                warnings.warn(f"copying unregistered (slow): {e}", RuntimeWarning, stacklevel=2)
        stream = stream if stream is not None else torch.cuda.Stream(device=device)
        # The parameters may still be read by work queued on the current stream.
        stream.wait_stream(torch.cuda.current_stream(device))
        start = time.perf_counter()
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                if staging_bytes:
                    _copy_staged(mapping, params, device, staging_bytes)
                else:
                    for name, src in sources.items():
                        params[name].copy_(src, non_blocking=True)
        finally:
            # also on an error: no copy may still read the mapping when the caller closes it
            stream.synchronize()
        seconds = time.perf_counter() - start
    else:
        start = time.perf_counter()
        with torch.no_grad():
            if staging_bytes:
                _copy_staged(mapping, params, device, staging_bytes)
            else:
                for name, src in sources.items():
                    params[name].copy_(src)
        seconds = time.perf_counter() - start
    return TransferReport(
        size_bytes=size_bytes, seconds=seconds, device=str(device), tensors=len(sources),
        registered=mapping.registered, register_s=register_s,
    )  # fmt: skip


def staging_chunks(manifest: Manifest, staging_bytes: int) -> list[tuple[int, int, list[Any]]]:
    """Group the tensors, in file order, into byte ranges of data.bin of at most
    ``staging_bytes`` each (a larger tensor gets a range of its own): ``(start, end,
    tensors)``. Pure: the plan :func:`copy_into` follows with ``staging_bytes``."""
    chunks: list[tuple[int, int, list[Any]]] = []
    for t in sorted(manifest.tensors, key=lambda t: t.offset):
        end = t.offset + t.size_bytes
        if chunks and end - chunks[-1][0] <= staging_bytes:
            start, _, members = chunks[-1]
            chunks[-1] = (start, end, [*members, t])
        else:
            chunks.append((t.offset, end, [t]))
    return chunks


def _copy_staged(
    mapping: MappedEntry, params: Mapping[str, torch.Tensor], device: torch.device,
    staging_bytes: int,
) -> None:  # fmt: skip
    """Host -> staging buffer (large copies) -> parameters (device copies), all in order
    on the current stream, so one buffer is reused without extra synchronization (it is
    allocated on that stream, so the allocator reuses it only after them)."""
    plan = staging_chunks(mapping.manifest, staging_bytes)
    largest = max((end - start for start, end, _ in plan), default=0)
    buf = torch.empty(largest, dtype=torch.uint8, device=device)
    base = mapping.tensors_base()
    for start, end, members in plan:
        buf[: end - start].copy_(base[start:end], non_blocking=True)
        for t in members:
            dst = params[t.name]
            rel = t.offset - start
            dst.copy_(buf[rel : rel + t.size_bytes].view(dst.dtype).view(dst.shape),
                      non_blocking=True)  # fmt: skip
