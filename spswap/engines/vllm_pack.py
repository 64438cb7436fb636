"""The weights of a vLLM engine packed into one allocation of vLLM's sleep-mode pool
(used by the vLLM worker: :meth:`SpswapWorkerExtension.spswap_pack`).

vLLM's sleep-mode allocator (``CuMemAllocator``) maps and unmaps each of its
allocations with its own driver calls, ~40-50 us each whatever the size, and a loaded
model's weights span one allocation per segment of torch's pool (77 for a 1.5B: 6-7 ms
of its level-2 sleep, 10-11 ms of its wake; docs/notes/copy-after-sleep.md). Packed as
their pool entry's data file (:mod:`spswap.transfer.packed`) they are one allocation,
and a wake copies them in one host copy.

How: one block is made under vLLM's own ``weights`` tag (``use_memory_pool``), each
weight copied into its view and the model rebound to the views; then the segments of
the pool the model was loaded into that no tensor uses any more are released the way
vLLM releases a load's unused allocations (its free callback, then
``unmap_and_release``). For a moment the weights are on the GPU twice: packing is
skipped where the free memory does not allow it, and for engines with CUDA graphs
(captured graphs hold the old addresses).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spswap.pool.manifest import Manifest
from spswap.transfer.packed import pack_into
from spswap.units import fmt_bytes

WEIGHTS_TAG = "weights"  # vLLM's tag for the weights' allocations
KEPT_POOL_KEY = "weights-before-pack"  # where the load's pool is kept (vLLM drops it last)
MARGIN_BYTES = 256 << 20  # free memory kept beside the second copy while packing


@dataclass(frozen=True)
class SlotRoom:
    """What the run's GPU slot leaves the packing's second copy: the slot's bytes less
    what the engine holds now (NVML's figure for its process; where NVML does not list
    it, all the GPU has in use, which is never less). vLLM's own share is not the
    measure: with ``--kv-cache-gib`` the engine holds what its KV cache and weights
    take, more or less than that share."""

    slot_bytes: int
    held_bytes: int
    held_by_engine: bool  # False: held_bytes is the whole GPU's use

    @property
    def room_bytes(self) -> int:
        return max(0, self.slot_bytes - self.held_bytes)

    def refusal(self, needed_bytes: int) -> str | None:
        """Why the second copy does not fit, or None where it does (exact texts:
        tests/engines/test_vllm_pack.py)."""
        if self.room_bytes >= needed_bytes:
            return None
        held = ("the engine holds" if self.held_by_engine
                else "the GPU has in use (NVML does not list the engine's process)")  # fmt: skip
        return (f"the slot's {fmt_bytes(self.slot_bytes)} leave {fmt_bytes(self.room_bytes)} "
                f"beyond the {fmt_bytes(self.held_bytes)} {held}, {fmt_bytes(needed_bytes)} "
                "needed for a second copy of the weights for a moment (lower --kv-cache-gib "
                "or --gpu-memory-utilization, or take more --units)")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"slot_bytes": self.slot_bytes, "held_bytes": self.held_bytes,
                "held_by_engine": self.held_by_engine}  # fmt: skip


def allocations_by_tag(allocator: Any) -> dict[str, int]:
    """How many allocations vLLM's sleep-mode pool holds, by tag."""
    out: dict[str, int] = {}
    for data in allocator.pointer_to_data.values():
        out[data.tag] = out.get(data.tag, 0) + 1
    return out


def pack_weights(
    model: torch.nn.Module, manifest: Manifest, params: Mapping[str, torch.Tensor], *,
    allocator: Any, release: Callable[[Any], None], free_bytes: int, cuda_graphs: bool,
    room: SlotRoom | None = None, max_bytes: int | None = None,
) -> tuple[dict[str, Any], torch.Tensor | None]:  # fmt: skip
    """Pack ``params`` (the entry's tensors of ``model``) into one block of
    ``allocator``'s ``weights`` pool; ``release`` unmaps and releases a handle
    (vLLM's ``unmap_and_release``). The second copy of the weights needs ``free_bytes``
    (the GPU's free memory) and, where given, ``room`` (what the run's slot leaves
    beyond what the engine holds) to hold it and :data:`MARGIN_BYTES`; weights of more than
    ``max_bytes``, where given, are left as loaded. Returns a report and the
    block (None where it did not pack: the report's ``why`` says so). The caller drops
    its references to ``params`` before the old memory can go: pass a dict it owns no
    other reference to.
    Once per engine (the load's pool kept under :data:`KEPT_POOL_KEY` says it packed):
    a second pack would keep the first block and drop the load's pool.

    ``left_in_load_pool_bytes`` in the report: what the load's pool still holds after
    the release (buffers outside the entry, such as rotary caches): a weight still
    referenced from elsewhere would show here, and it would not be refilled by a wake."""
    before = allocations_by_tag(allocator)
    size = manifest.data_size_bytes
    why = None
    if KEPT_POOL_KEY in allocator.allocator_and_pools:
        why = "the weights are packed already"
    elif cuda_graphs:
        why = "the engine runs CUDA graphs, which hold the weights' addresses"
    elif max_bytes is not None and size > max_bytes:
        why = (f"the weights are {fmt_bytes(size)}, over spswap serve's {fmt_bytes(max_bytes)} "
               "limit for packing: packed, a 7B's swap took ~21 ms longer, docs/benchmarks.md "
               "section 2")  # fmt: skip
    elif room is not None and (refused := room.refusal(size + MARGIN_BYTES)) is not None:
        why = refused
    elif free_bytes < size + MARGIN_BYTES:
        why = (f"{fmt_bytes(free_bytes)} free on the GPU, {fmt_bytes(size + MARGIN_BYTES)} "
               "needed for a second copy of the weights for a moment")  # fmt: skip
    elif any(not t.is_contiguous() for t in params.values()):
        why = "a weight is not contiguous"
    if why is not None:
        out = {"packed": False, "why": why, "before": before}
        return ({**out, "room": room.to_json()} if room is not None else out), None
    loaded_pool = allocator.allocator_and_pools.get(WEIGHTS_TAG)
    device = next(iter(params.values())).device
    try:
        with allocator.use_memory_pool(tag=WEIGHTS_TAG):
            block = torch.empty(size, dtype=torch.uint8, device=device)
            rebound = pack_into(model, manifest, params, block)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            named = len(params)
            if isinstance(params, dict):
                params.clear()  # (the caller's last reference to the old tensors)
            gc.collect()
    except BaseException:
        # vLLM's pool context skips its own cleanup on an error: the load's pool stays
        # the weights' pool (the model reads old memory or views of equal bytes)
        if loaded_pool is not None:
            allocator.allocator_and_pools[WEIGHTS_TAG] = loaded_pool
        raise
    released = left_bytes = 0
    if loaded_pool is not None:
        allocator.allocator_and_pools[KEPT_POOL_KEY] = loaded_pool
        for segment in loaded_pool[0].snapshot():
            address = segment["address"]
            left_bytes += int(segment["allocated_size"])
            if segment["allocated_size"] == 0 and address in allocator.pointer_to_data:
                release(allocator._python_free_callback(address))
                released += 1
    report = {"packed": True, "size_bytes": size, "tensors": named, "rebound": rebound,
              "released": released, "left_in_load_pool_bytes": left_bytes,
              "before": before, "after": allocations_by_tag(allocator)}  # fmt: skip
    if room is not None:
        report["room"] = room.to_json()
    return report, block
