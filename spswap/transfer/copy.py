"""Copy a mapped pool entry into a model's parameters.

Names, shapes and dtypes are all checked before a single byte moves, so a mismatch
leaves the model as it was. On CUDA the mapping is page-locked once
(:meth:`MappedEntry.register_cuda`), every tensor is copied asynchronously on one
dedicated stream, and the host waits once at the end. On CPU the copies are plain.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Mapping, Sequence
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
    mapped: bool = False  # no copy: the weights are views of the pool's mapping (CPU)

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
    staging_buffers: Sequence[torch.Tensor] | None = None,
    pull: float = 0.0,
    packed_into: torch.Tensor | None = None,
) -> TransferReport:
    """Copy every tensor of ``mapping`` into the same-named tensor of ``params``.

    Checks everything first (:func:`check_compatible`); then on CUDA registers the
    mapping if it is not yet (once per mapping), issues the async copies on ``stream``
    (a fresh dedicated stream if none) and synchronizes once.

    ``staging_bytes``: copy host -> two device staging buffers of that size in turn
    (pieces of the entry's data), then device -> parameters, the two overlapped (see
    :func:`~spswap.transfer.staging.staging_plan`; the mapping keeps the plan): a few
    large host copies instead of one per tensor (H200, 1.5B as the first copy after a
    sleep: 53.2-54.1 GB/s against a 55.3 pinned limit); the
    device-side copies cost little next to PCIe and run while the next piece crosses
    it. ``staging_buffers``: two uint8 device tensors of at least ``staging_bytes`` to
    use instead of allocating them.

    ``pull``: the share of the bytes (0 to 1, whole tensors, see :func:`split_for_pull`)
    that the GPU's own cores read first from the registered mapping through its device
    address (kernels doing loads over PCIe, :func:`_copy_pulled`); the copy engines then
    move the rest (staged with ``staging_bytes``), after the pull on the same stream (at
    the same time the two ran slower than the pull alone, 28-34 GB/s; in sequence no
    faster than the better of the two whole, so a wake pulls all or none:
    docs/notes/copy-after-sleep.md). Needs a registered mapping; on CPU it is the plain
    copy.

    ``packed_into``: where every parameter is a view of one block laid out as the entry's
    data file (:func:`~spswap.transfer.packed.packed_target` of ``params``): that block,
    and the entry moves in one host copy (``pull`` 1: one pulling kernel; between: the
    first share pulled, the rest copied) instead of one per tensor or staged piece.
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
                if packed_into is not None:
                    _copy_packed(mapping, packed_into, device, pull)
                elif pull > 0 and mapping.registered:
                    _copy_pull_first(mapping, params, device, pull, staging_bytes,
                                     staging_buffers)  # fmt: skip
                elif staging_bytes:
                    _copy_staged(mapping, params, device, staging_bytes, staging_buffers)
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
            if packed_into is not None:
                _copy_packed(mapping, packed_into, device, 0.0)
            elif staging_bytes:
                _copy_staged(mapping, params, device, staging_bytes, staging_buffers)
            else:
                for name, src in sources.items():
                    params[name].copy_(src)
        seconds = time.perf_counter() - start
    return TransferReport(
        size_bytes=size_bytes, seconds=seconds, device=str(device), tensors=len(sources),
        registered=mapping.registered, register_s=register_s,
    )  # fmt: skip


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a flat uint8 view, or None when its memory is not one block."""
    if not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` alike when one names no index (the current device)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _copy_staged(
    mapping: MappedEntry, params: Mapping[str, torch.Tensor], device: torch.device,
    staging_bytes: int, buffers: Sequence[torch.Tensor] | None = None,
    skip: frozenset[str] = frozenset(),
) -> None:  # fmt: skip
    """Host -> staging buffer (one large copy per piece) -> parameters (device copies),
    with two buffers: on CUDA the host copy of piece k+1 (current stream) runs while
    piece k is scattered (a second stream), so PCIe never waits for the scatter. Events
    keep a buffer from being refilled before its scatter has read it. The tensors named
    in ``skip`` are left out (another path copied them)."""
    plan = mapping.staging_plan(staging_bytes, skip)  # made once per mapping, size, skip
    if not plan:
        return
    base = mapping.tensors_base()
    # Each parameter's flat view is made when its first slice is scattered: the first
    # piece crosses PCIe meanwhile instead of waiting for hundreds of views (~1 ms).
    flats: dict[str, torch.Tensor | None] = {}

    def flat_of(name: str) -> torch.Tensor | None:
        if name not in flats:
            flats[name] = _flat_bytes(params[name])
            if flats[name] is None:  # rare: a strided parameter is copied whole, directly
                params[name].copy_(mapping.tensors()[name], non_blocking=True)
        return flats[name]

    size = max(p.end - p.start for p in plan)
    if buffers is not None:
        if len(buffers) != 2 or any(b.numel() < size or b.dtype != torch.uint8
                                    or not _same_device(b.device, device)
                                    for b in buffers):  # fmt: skip
            raise TransferError(f"staging buffers must be two uint8 tensors of at least "
                                f"{size} bytes on {device}")  # fmt: skip
        bufs = list(buffers)
    else:
        bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    cuda = device.type == "cuda"
    h2d = torch.cuda.current_stream(device) if cuda else None
    scatter = torch.cuda.Stream(device=device) if cuda else None
    filled = [torch.cuda.Event() for _ in bufs] if cuda else []
    drained = [torch.cuda.Event() for _ in bufs] if cuda else []
    try:
        for i, piece in enumerate(plan):
            buf = bufs[piece.buffer]
            if cuda and i >= len(bufs):  # the buffer's last scatter must have read it
                h2d.wait_event(drained[piece.buffer])  # type: ignore[union-attr]
            buf[: piece.end - piece.start].copy_(base[piece.start : piece.end], non_blocking=True)
            if cuda:
                filled[piece.buffer].record(h2d)
                scatter.wait_event(filled[piece.buffer])  # type: ignore[union-attr]
            with torch.cuda.stream(scatter) if cuda else contextlib.nullcontext():
                for name, t_off, b_off, n in piece.slices:
                    flat = flat_of(name)
                    if flat is not None:
                        flat[t_off : t_off + n].copy_(buf[b_off : b_off + n], non_blocking=True)
            if cuda:
                drained[piece.buffer].record(scatter)
    finally:
        if cuda:
            # the caller synchronizes its stream; the scatter stream joins it first (also
            # after an error: nothing may still read the mapping or the buffers)
            h2d.wait_stream(scatter)  # type: ignore[union-attr,arg-type]
            for b in bufs:  # the allocator must not hand these out before the scatter ends
                b.record_stream(scatter)  # type: ignore[arg-type]


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def word_dtype(*offsets_and_sizes: int) -> torch.dtype:
    """The widest integer type whose size divides every given byte offset and size: the
    word a pulling kernel moves per element (wider words, fewer PCIe read requests)."""
    for dtype in _WORDS:
        size = torch.empty(0, dtype=dtype).element_size()
        if all(n % size == 0 for n in offsets_and_sizes):
            return dtype
    return torch.uint8


def _device_view(mapping: MappedEntry, device: torch.device) -> torch.Tensor:
    """The registered mapping as a uint8 tensor on ``device`` (no copy): with unified
    addressing a registered host range has the same address on the GPU."""

    class _Interface:
        __cuda_array_interface__ = {"shape": (mapping.size_bytes,), "typestr": "|u1",
                                    "data": (mapping.address, False), "version": 3}  # fmt: skip

    return torch.as_tensor(_Interface(), device=device)


def split_for_pull(sizes: Mapping[str, int], fraction: float) -> set[str]:
    """The tensors whose bytes the cores pull: largest first, each taken when that
    brings the pulled bytes closer to ``fraction`` of all; the copy engines take the rest.
    Pure: ``fraction`` 1 takes every tensor, 0 none."""
    target = fraction * sum(sizes.values())
    pulled: set[str] = set()
    got = 0
    for name, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        if got + n / 2 <= target or fraction >= 1:
            pulled.add(name)
            got += n
    return pulled


def _copy_pull_first(
    mapping: MappedEntry, params: Mapping[str, torch.Tensor], device: torch.device,
    fraction: float, staging_bytes: int | None, buffers: Sequence[torch.Tensor] | None,
) -> None:  # fmt: skip
    """The cores pull ``fraction`` of the bytes, then the copy engines copy the rest
    (staged where ``staging_bytes``), issued on the current stream after the pull: in
    sequence (a staged copy's scatter runs on its own stream, after its pieces)."""
    pulled = split_for_pull({t.name: t.size_bytes for t in mapping.manifest.tensors}, fraction)
    _copy_pulled(mapping, params, device, pulled)
    if len(pulled) == len(mapping.manifest.tensors):
        return
    if staging_bytes:
        _copy_staged(mapping, params, device, staging_bytes, buffers, skip=frozenset(pulled))
    else:
        for name, src in mapping.tensors().items():
            if name not in pulled:
                params[name].copy_(src, non_blocking=True)


PULL_CUT_ALIGN_BYTES = 4096  # where a packed copy's pulled share ends (any word fits)


def _copy_packed(mapping: MappedEntry, block: torch.Tensor, device: torch.device,
                 pull: float) -> None:  # fmt: skip
    """The whole data file into ``block`` (the packed weights) at once: its first
    ``pull`` share read by the cores (registered mapping on CUDA), the rest copied."""
    size = mapping.size_bytes
    if block.dtype != torch.uint8 or block.numel() != size or not block.is_contiguous():
        raise TransferError(f"a packed copy needs a contiguous uint8 block of the entry's "
                            f"{size} bytes, not {block.dtype} x {block.numel()}")  # fmt: skip
    pulled = 0
    if device.type == "cuda" and pull > 0 and mapping.registered:
        pulled = (
            size if pull >= 1 else int(pull * size) // PULL_CUT_ALIGN_BYTES * PULL_CUT_ALIGN_BYTES
        )
        _pull_bytes(_device_view(mapping, device)[:pulled], block[:pulled])
    if pulled < size:
        block[pulled:].copy_(mapping.tensors_base()[pulled:], non_blocking=device.type == "cuda")


def _pull_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The uint8 ``dst`` gets the bytes of the uint8 ``src`` (the registered mapping's
    device view) through an elementwise kernel, the GPU's cores reading over PCIe. Not a
    memcpy (the driver would hand that to the copy engines): an integer ``x | 0`` over the
    widest word that fits, which moves the bits unchanged."""
    word = word_dtype(src.data_ptr(), dst.data_ptr(), src.numel())
    torch.bitwise_or(src.view(word), 0, out=dst.view(word))


def _copy_pulled(mapping: MappedEntry, params: Mapping[str, torch.Tensor],
                 device: torch.device, names: set[str]) -> None:  # fmt: skip
    """Each parameter of ``names`` read by the cores straight from the registered mapping
    (:func:`_pull_bytes`). The copy engines are what runs at half rate right after a
    same-process level-2 sleep (docs/benchmarks.md); the cores are not."""
    src_all = _device_view(mapping, device)
    for t in mapping.manifest.tensors:
        if t.name not in names:
            continue
        dst = params[t.name]
        flat = _flat_bytes(dst)
        src = src_all[t.offset : t.offset + t.size_bytes]
        if flat is None:  # rare: a strided parameter takes a plain copy of its bytes
            dst.copy_(mapping.tensors()[t.name], non_blocking=True)
            continue
        _pull_bytes(src, flat)
