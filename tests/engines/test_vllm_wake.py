"""The wake's sequence of vLLM calls (spswap.engines.vllm_wake):
the calls' order and arguments, on CPU (the calls themselves run on the GPU machine in
tests/engines/test_vllm.py)."""

from __future__ import annotations

from typing import Any

import pytest

from spswap.engines.vllm_wake import wake


class _Recorder:
    """Stands in for vLLM (absent here): records the calls a wake makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        self.calls.append(("rpc", method, *args))
        return {"seconds": 0.01}

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_wake_maps_weights_copies_then_wakes_the_kv_cache(prefix_caching: bool) -> None:
    ops = _Recorder()
    t = wake(ops, prefix_caching=prefix_caching, slept_at=None)
    assert ops.calls == [
        ("wake_up", ("weights",)),
        ("rpc", "spswap_copy", None, None),
        ("wake_up", ("kv_cache",)),
        *([("reset_prefix_cache",)] if prefix_caching else []),
    ]
    assert t.copy == {"seconds": 0.01}
