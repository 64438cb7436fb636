"""The engine protocol: what spswap needs from anything it swaps.

An engine lives inside the model process. spswap drives it through the instance state
machine's Sleep <-> Up primitives: :meth:`Engine.sleep` frees the weights' device
memory (the pool still has them), :meth:`Engine.wake` copies them back from the pool.
Plain data here: importing this module needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from spswap.instance.state import State
from spswap.pool.manifest import Manifest

if TYPE_CHECKING:  # the copy module imports torch; this one must not
    from spswap.transfer.copy import TransferReport


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is and holds, for status tables and health checks."""

    name: str
    kind: str  # "reference", "vllm", ...
    device: str
    state: State
    weight_bytes: int  # bytes of weights when Up
    resident_bytes: int  # bytes of weights on the device now (0 when asleep)
    source: str = ""  # where the weights come from: a pool digest or a checkpoint path
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d


@runtime_checkable
class Engine(Protocol):
    """A model that can load, sleep, wake, generate and export its weights."""

    @property
    def state(self) -> State:
        """Up or Sleep (the states this process itself moves between)."""
        ...

    def load_from_checkpoint(self, path: Path) -> float:
        """Cold path: read the weights from a safetensors checkpoint; returns seconds."""
        ...

    def load_from_pool(self, pool: Any, ref: str) -> TransferReport:
        """Read the weights from pool entry ``ref`` (name or digest) through transfer;
        keeps the entry mapped (and in use) for later wakes. Returns a TransferReport."""
        ...

    def sleep(self) -> float:
        """Up -> Sleep: free the weights' device memory; returns seconds."""
        ...

    def wake(self) -> TransferReport:
        """Sleep -> Up: copy the weights back from the pool; returns a TransferReport."""
        ...

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int,
                 abort: Callable[[], bool] | None = None) -> list[list[int]]:  # fmt: skip
        """Greedy continuation token ids of each prompt (the new tokens only); ``abort``
        is asked between tokens and raises RequestAborted when it says True."""
        ...

    def export_weights(self, pool: Any, name: str) -> Manifest:
        """Write the current weights as pool entry ``name``; returns its Manifest."""
        ...

    def health(self) -> EngineInfo:
        """The engine's current state and footprint."""
        ...

    def close(self) -> None:
        """Release the pool mapping and device memory."""
        ...
