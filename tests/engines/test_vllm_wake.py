"""The wake's sequence of vLLM calls (spswap.engines.vllm_wake), plain and overlapped:
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
def test_plain_wake_maps_weights_copies_then_wakes_the_kv_cache(prefix_caching: bool) -> None:
    ops = _Recorder()
    t = wake(ops, prefix_caching=prefix_caching, slept_at=None)
    assert ops.calls == [
        ("wake_up", ("weights",)),
        ("rpc", "spswap_copy", None, None, False),
        ("wake_up", ("kv_cache",)),
        *([("reset_prefix_cache",)] if prefix_caching else []),
    ]
    assert t.copy == {"seconds": 0.01}


def test_overlapped_wake_copies_first_then_wakes_both_tags_at_once() -> None:
    ops = _Recorder()
    t = wake(ops, prefix_caching=False, slept_at=0.0, overlap=True)
    assert [c[:2] for c in ops.calls] == [
        ("rpc", "spswap_copy"),
        ("wake_up", ("weights", "kv_cache")),
    ]
    _, _, pull, since_s, overlap = ops.calls[0]
    assert pull is None and overlap is True and since_s > 0  # seconds since the sleep
    assert t.wake_weights_s == 0 and t.copy_s > 0 and t.wake_kv_s > 0
