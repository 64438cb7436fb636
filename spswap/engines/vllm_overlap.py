"""The overlapped wake of a level-2-asleep vLLM (issue 18, item 1), inside its worker.

vLLM's ``wake_up(["weights"])`` maps every allocation of the weights again before a byte
may be copied (~9 ms for a 0.5B model, 26 ms for a 7B), then spswap's copy runs, then
``wake_up(["kv_cache"])``: three calls, one after the other. Here the worker maps each
allocation just before the staged copy scatters into it, so the mapping runs while
earlier pieces cross PCIe (:mod:`spswap.transfer.map_order`); one
``wake_up(["weights", "kv_cache"])`` after it maps the KV cache and runs the rest of
vLLM's own wake (the buffers it saved at the sleep, the KV cache's scales), with
vLLM's bookkeeping of what sleeps kept as it is. Stock vLLM, no patched file: the
worker's sleep-mode backend is wrapped so that its resume leaves out a tag whose
memory is all mapped already (:class:`_SkipAwakeTags`).
"""

from __future__ import annotations

from typing import Any

import torch

from spswap.engines.vllm_weights import STAGING_BYTES
from spswap.errors import EngineError
from spswap.transfer.copy import TransferReport, copy_into, scatter_slices
from spswap.transfer.map_order import Allocation, allocations_by_piece
from spswap.transfer.mapping import MappedEntry

WEIGHTS_TAG = "weights"  # vLLM's CuMemAllocator tag of the weights' memory


class _SkipAwakeTags:
    """A sleep-mode backend that hands vLLM's own ``resume`` only the tags still asleep:
    after :func:`wake_weights_copying` mapped the weights, ``wake_up(["weights",
    "kv_cache"])`` must not map them twice."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def suspend(self, level: int = 1) -> None:
        self.inner.suspend(level)

    def state(self) -> Any:
        return self.inner.state()

    def resume(self, tags: list[str] | None = None) -> None:
        from vllm.device_allocator.cumem import CuMemAllocator

        data = list(CuMemAllocator.get_instance().pointer_to_data.values())
        wanted = sorted({d.tag for d in data}) if tags is None else list(tags)
        asleep = [t for t in wanted if any(d.tag == t and d.is_asleep for d in data)]
        if asleep or not wanted:
            self.inner.resume(asleep)


def _install_skip_awake(worker: Any) -> None:
    """Wrap the worker's sleep-mode backend once (vLLM 0.26's ``_get_sleep_mode_backend``)."""
    backend = worker._get_sleep_mode_backend()
    if not isinstance(backend, _SkipAwakeTags):
        worker._sleep_mode_backend = _SkipAwakeTags(backend)


def wake_weights_copying(
    worker: Any, mapping: MappedEntry, weights: dict[str, torch.Tensor], pull: float
) -> TransferReport:
    """Map the sleeping weights' allocations piece by piece while the staged copy of
    ``mapping`` fills them (``pull`` > 0: all mapped first, then the pulled copy); every
    weights allocation is mapped when this returns, also after an error. The caller then
    calls vLLM's ``wake_up(["weights", "kv_cache"])``."""
    from vllm.device_allocator.cumem import CuMemAllocator, create_and_map

    _install_skip_awake(worker)
    asleep = {ptr: d for ptr, d in CuMemAllocator.get_instance().pointer_to_data.items()
              if d.tag == WEIGHTS_TAG and d.is_asleep}  # fmt: skip
    if not asleep:
        raise EngineError("the overlapped wake found no sleeping weights: the engine is "
                          "awake or its sleep was not level 2")  # fmt: skip
    if any(d.cpu_backup_tensor is not None for d in asleep.values()):
        raise EngineError("the weights were offloaded by a level-1 sleep: wake it with "
                          "vLLM's own wake_up")  # fmt: skip
    allocs = [Allocation(ptr, int(d.handle[1])) for ptr, d in asleep.items()]

    def map_group(group: list[Allocation]) -> None:
        for a in group:
            d = asleep[a.ptr]
            if d.is_asleep:
                create_and_map(d.handle)
                d.is_asleep = False

    try:
        if pull > 0:
            map_group(allocs)
            return copy_into(mapping, weights, staging_bytes=STAGING_BYTES, pull=pull)
        ptrs = {name: t.data_ptr() for name, t in weights.items()}
        groups = allocations_by_piece(scatter_slices(mapping.manifest, STAGING_BYTES),
                                      ptrs, allocs)  # fmt: skip
        return copy_into(mapping, weights, staging_bytes=STAGING_BYTES,
                         before_scatter=lambda i: map_group(groups[i]))  # fmt: skip
    finally:
        map_group(allocs)  # (a no-op after a whole copy) never a tag half awake
