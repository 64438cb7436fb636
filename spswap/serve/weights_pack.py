"""``spswap serve --engine vllm`` packs an eager server's weights into one allocation
once it is up (the worker's ``spswap_pack``: :mod:`spswap.engines.vllm_pack`).

vLLM's sleep-mode pool maps and unmaps each of its allocations with its own driver
calls (~40-50 us each), and a loaded model's weights span dozens of them; packed as
their pool entry's data file they are one, and every later wake copies them in one host
copy. Packing holds the weights twice for a moment: the second copy must fit in the
part of the run's GPU slot the engine does not hold (its weights, KV cache, CUDA
context: NVML's figure for its process), or it is skipped. Weights of more than
:data:`SERVE_PACK_MAX_BYTES` are not packed: a 7B's swapped slower packed. A run that
could not pack serves as it is: only each swap's few milliseconds are lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spswap.serve.backend import Log
from spswap.slots.alloc import UNITS_PER_GPU
from spswap.units import fmt_bytes

# Measured on one H100 host (docs/benchmarks.md, section 2, runs p-r, 2026-12-08):
# packed, a 0.5B's and a 1.5B's cycle (1.2, 3.3 GiB) took 5-13 ms less (run m, another
# host with a 4 GiB KV cache, had the 1.5B's 4 ms slower), a 7B's (14.2 GiB) 21-22 ms
# more: its one 15 GB block filled at 84-85% of the pinned rate against 92-95% as
# loaded. Between the two, nothing was measured: the cap sits in that gap.
SERVE_PACK_MAX_BYTES = 8 << 30


def pack_slot_share(units: int) -> float:
    """The share of the GPU's memory the run's slot holds (``units`` of
    :data:`UNITS_PER_GPU`): the engine's process, the packing's second copy included,
    stays inside it (the worker subtracts what the engine holds now).

    >>> pack_slot_share(4), pack_slot_share(1), pack_slot_share(2)
    (1.0, 0.25, 0.5)
    """
    return min(1.0, units / UNITS_PER_GPU)


def pack_skipped(eager: bool, pack: bool) -> str | None:
    """Why a run does not try to pack (the log line's and ``--json``'s ``why``), or None
    when it does.

    >>> pack_skipped(True, True) is None
    True
    >>> pack_skipped(True, False)
    '--no-pack'
    >>> pack_skipped(False, True)
    "--no-eager: vLLM's CUDA graphs hold their addresses"
    """
    if not eager:  # (captured CUDA graphs would replay into the old addresses)
        return "--no-eager: vLLM's CUDA graphs hold their addresses"
    return None if pack else "--no-pack"


def pack_line(model: str, report: dict[str, Any]) -> str:
    """The run's log line for the worker's ``spswap_pack`` report (exact lines:
    tests/serve/test_weights_pack.py)."""
    if report.get("packed"):
        before = int((report.get("before") or {}).get("weights", 0))
        line = (f"spswap serve: {model}'s weights packed into one allocation "
                f"({fmt_bytes(int(report['size_bytes']))}, {report['tensors']} tensors; "
                f"from {before} allocations): each sleep and wake maps one")  # fmt: skip
        if report.get("layout_checked") is False:  # (the worker then copies tensor by tensor)
            line += "; their layout did not check out: each wake copies them one by one"
        return line
    why = report.get("why")
    return f"spswap serve: {model}'s weights were not packed into one allocation ({why})"


def pack_logged(pack: Callable[[float, int], dict[str, Any]], model: str, slot_share: float,
                log: Log) -> dict[str, Any]:  # fmt: skip
    """``pack(slot_share, SERVE_PACK_MAX_BYTES)`` (the worker's ``spswap_pack``, through
    ``model``'s server or engine), logged; what it answered (``packed``, else ``why``
    not). Never raises for
    the packing's own trouble: the model goes on with its weights as loaded (a worker
    that died of it is the server's exit, told where the run watches for that)."""
    try:
        report = pack(slot_share, SERVE_PACK_MAX_BYTES)
    except Exception as e:  # noqa: BLE001 - the packing never ends a model's serving
        log(f"spswap serve: could not pack {model}'s weights ({e}); they stay as loaded")
        return {"packed": False, "why": str(e)}
    log(pack_line(model, report))
    return report
