"""vLLM's wake from a level-2 sleep, in the one order that is right, for both ways spswap
drives vLLM: an ``LLM`` in this process (:class:`~spswap.engines.vllm_engine.VllmEngine`)
and vLLM's OpenAI server in a child (:class:`~spswap.serve.vllm_api.VllmApiServer`,
through its development endpoints)::

    wake_up(tags=["weights"])      weight memory mapped again (garbage until the copy)
    collective_rpc("spswap_copy")  every weight copied from the attached pool entry
    wake_up(tags=["kv_cache"])     the KV cache back only after the weights
    reset_prefix_cache()           with prefix caching on: nothing computed from garbage
                                   survives (vLLM's sleep already cleared it)

Plain Python: no vLLM, no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol


class WakeOps(Protocol):
    """The vLLM calls a wake is made of, however they reach vLLM."""

    def wake_up(self, tags: list[str]) -> None:
        """vLLM's ``wake_up(tags=...)``."""
        ...

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        """A worker-extension method through ``collective_rpc``; rank 0's reply."""
        ...

    def reset_prefix_cache(self) -> None:
        """vLLM's ``reset_prefix_cache()``."""
        ...


@dataclass
class WakeTimes:
    """Where a wake's time went, as the engine's owner sees it (seconds)."""

    wake_weights_s: float = 0.0
    copy_s: float = 0.0  # the collective_rpc, round trip
    wake_kv_s: float = 0.0
    reset_prefix_s: float = 0.0
    copy: dict[str, Any] = field(default_factory=dict)  # the worker's TransferReport

    @property
    def total_s(self) -> float:
        return self.wake_weights_s + self.copy_s + self.wake_kv_s + self.reset_prefix_s


def wake(ops: WakeOps, *, prefix_caching: bool, slept_at: float | None) -> WakeTimes:
    """Wake a level-2-asleep vLLM through ``ops`` (see the module doc). ``slept_at``: the
    ``time.monotonic()`` of its sleep (the worker picks how to pull the weights by how long
    the pages have been left alone), None when unknown."""
    t = WakeTimes()
    s = time.perf_counter()
    ops.wake_up(["weights"])
    t.wake_weights_s = time.perf_counter() - s
    s = time.perf_counter()
    since = None if slept_at is None else time.monotonic() - slept_at
    t.copy = ops.rpc("spswap_copy", None, since)  # the worker picks the pull
    t.copy_s = time.perf_counter() - s
    s = time.perf_counter()
    ops.wake_up(["kv_cache"])
    t.wake_kv_s = time.perf_counter() - s
    if prefix_caching:
        # vLLM clears the prefix cache when it sleeps, and the weights are back before
        # any KV block is computed; with caching on, make sure anyway.
        s = time.perf_counter()
        ops.reset_prefix_cache()
        t.reset_prefix_s = time.perf_counter() - s
    return t
