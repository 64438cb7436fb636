"""spswap serve's packing of an eager vLLM server's weights after its start: the room it
may use, its log line, and a failed pack leaving the run serving (the packing itself:
tests/engines/test_vllm_pack.py; on the GPU tests/engines/test_vllm.py and the serve GPU
test)."""

from __future__ import annotations

from typing import Any

from spswap.errors import EngineError
from spswap.serve.weights_pack import pack_room_share, pack_server_weights


class _Server:
    def __init__(self, answer: dict[str, Any] | Exception) -> None:
        self.answer, self.calls = answer, []

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        self.calls.append((method, *args))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_the_room_is_the_slot_less_vllms_share() -> None:
    assert pack_room_share(4, 0.9) == 0.1
    assert pack_room_share(2, 0.45) == 0.05
    assert pack_room_share(1, 0.5) == 0.0  # vLLM was given more than the slot: no room


def test_a_pack_the_server_refuses_leaves_the_run_serving_with_the_reason() -> None:
    logs: list[str] = []
    server = _Server(EngineError("vLLM server POST /collective_rpc answered 500: boom"))
    report = pack_server_weights(server, "qwen", 0.1, logs.append)
    assert server.calls == [("spswap_pack", 0.1)]
    assert report == {"packed": False, "why": "vLLM server POST /collective_rpc answered 500: boom"}
    assert logs == [
        "spswap serve: could not pack qwen's weights (vLLM server POST "
        "/collective_rpc answered 500: boom); it serves as loaded"
    ]


def test_a_pack_is_logged_with_what_it_did() -> None:
    logs: list[str] = []
    answer = {
        "packed": True,
        "size_bytes": 3 << 30,
        "tensors": 338,
        "before": {"weights": 77, "kv_cache": 28},
        "after": {"weights": 1},
    }
    assert pack_server_weights(_Server(answer), "qwen", 0.05, logs.append) == answer
    assert logs == [
        "spswap serve: qwen's weights packed into one allocation (3.0 GiB, 338 "
        "tensors; were 77): each sleep and wake maps one"
    ]


def test_a_pack_the_worker_declined_is_logged_with_its_reason() -> None:
    logs: list[str] = []
    answer = {"packed": False, "why": "a weight is not contiguous", "before": {"weights": 31}}
    assert pack_server_weights(_Server(answer), "qwen", 0.05, logs.append) == answer
    assert logs == [
        "spswap serve: qwen's weights were not packed into one allocation (a weight is not "
        "contiguous)"
    ]
