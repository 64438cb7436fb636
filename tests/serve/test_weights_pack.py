"""spswap serve's packing of an eager vLLM server's weights after its start: the room it
may use, its log line, and a failed pack leaving the run serving (the packing itself:
tests/engines/test_vllm_pack.py; on the GPU tests/engines/test_vllm.py and the serve GPU
test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spswap.errors import EngineError
from spswap.multi.engine_settings import model_settings
from spswap.multi.serve import MultiOptions
from spswap.serve.weights_pack import SERVE_PACK_MAX_BYTES, pack_logged, pack_slot_share


class _Server:
    def __init__(self, answer: dict[str, Any] | Exception) -> None:
        self.answer, self.calls = answer, []

    def pack(self, slot_share: float, max_bytes: int) -> dict[str, Any]:
        self.calls.append((slot_share, max_bytes))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_a_models_slot_share_is_its_units(tmp_path: Path) -> None:
    """Each model's engine stays inside its units' share of the GPU, the packing's second
    copy included (the worker judges the room beside what the engine holds: with
    --kv-cache-gib that is not vLLM's share)."""

    def opts(**kw: Any) -> MultiOptions:
        return MultiOptions(models=(tmp_path / "a",), socket_path=tmp_path / "s",
                            state_dir=tmp_path, engine="vllm", device="cuda", **kw)  # fmt: skip

    assert opts().pack_slot_share() == 0.5  # 2 units of 4
    assert opts(units_per_model=1).pack_slot_share() == 0.25
    assert opts(vllm=model_settings(2, kv_cache_gib=4)).pack_slot_share() == 0.5
    assert opts(vllm=model_settings(2, eager=False)).pack_slot_share() is None  # CUDA graphs
    assert opts(pack=False).pack_slot_share() is None  # --no-pack
    assert pack_slot_share(4) == 1.0 and pack_slot_share(8) == 1.0  # never beyond the GPU


def test_a_pack_the_server_refuses_leaves_the_run_serving_with_the_reason() -> None:
    logs: list[str] = []
    server = _Server(EngineError("vLLM server POST /collective_rpc answered 500: boom"))
    report = pack_logged(server.pack, "qwen", 0.1, logs.append)
    # serve's cap goes with the call: a 7B's weights swapped slower packed (2026-12-08)
    assert server.calls == [(0.1, SERVE_PACK_MAX_BYTES)] and SERVE_PACK_MAX_BYTES == 8 << 30
    assert report == {"packed": False, "why": "vLLM server POST /collective_rpc answered 500: boom"}
    assert logs == [
        "spswap serve: could not pack qwen's weights (vLLM server POST "
        "/collective_rpc answered 500: boom); they stay as loaded"
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
    assert pack_logged(_Server(answer).pack, "qwen", 0.05, logs.append) == answer
    assert logs == [
        "spswap serve: qwen's weights packed into one allocation (3.0 GiB, 338 "
        "tensors; from 77 allocations): each sleep and wake maps one"
    ]


def test_a_pack_the_worker_declined_is_logged_with_its_reason() -> None:
    logs: list[str] = []
    answer = {"packed": False, "why": "a weight is not contiguous", "before": {"weights": 31}}
    assert pack_logged(_Server(answer).pack, "qwen", 0.05, logs.append) == answer
    assert logs == [
        "spswap serve: qwen's weights were not packed into one allocation (a weight is not "
        "contiguous)"
    ]


def test_a_pack_whose_layout_did_not_check_says_the_wakes_copy_one_by_one() -> None:
    logs: list[str] = []
    answer = {"packed": True, "size_bytes": 1 << 30, "tensors": 290, "layout_checked": False,
              "before": {"weights": 31}}  # fmt: skip
    pack_logged(_Server(answer).pack, "qwen", 0.05, logs.append)
    assert logs == ["spswap serve: qwen's weights packed into one allocation (1.0 GiB, 290 "
                    "tensors; from 31 allocations): each sleep and wake maps one; their layout "
                    "did not check out: each wake copies them one by one"]  # fmt: skip
