"""The vLLM side of a multi-model job, without vLLM: each model's settings from the slot
table's units, the order the engines start in, the refusals, and the start path's
choices (pool entry or cold + export) on stand-ins."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spswap.engines import vllm_identity
from spswap.engines.vllm_engine import VllmSettings, llm_kwargs
from spswap.errors import ConfigError, PoolCorrupt
from spswap.multi import vllm_start
from spswap.multi.engine_settings import (
    check_engine,
    model_settings,
    one_at_a_time,
    settings_from_json,
    start_order,
)
from spswap.multi.placement import ModelState, Placement
from spswap.multi.procs import start_hint
from spswap.multi.startup import close_timeout_s, spec_with, start_procs

A, S = ModelState.AWAKE, ModelState.ASLEEP


@pytest.mark.parametrize(("units", "util"), [(1, 0.225), (2, 0.45), (4, 0.9)])
def test_share_from_units(units, util):
    s = model_settings(units)
    assert s.gpu_memory_utilization == util
    assert s.kv_cache_memory_bytes is None and s.enforce_eager


def test_kv_cache_eager_and_overrides_pass_through():
    s = model_settings(2, kv_cache_gib=4, eager=False, max_model_len=2048,
                       llm_overrides={"max_num_seqs": 8})  # fmt: skip
    assert s.kv_cache_memory_bytes == 4 << 30 and not s.enforce_eager
    assert s.max_model_len == 2048
    kw = llm_kwargs(Path("/m"), s, dummy=True)
    assert kw["kv_cache_memory_bytes"] == 4 << 30 and kw["max_num_seqs"] == 8
    assert kw["gpu_memory_utilization"] == 0.45 and kw["enforce_eager"] is False


def test_settings_round_trip_through_json():
    s = model_settings(2, kv_cache_gib=1.5, llm_overrides={"max_num_seqs": 4})
    import json

    assert settings_from_json(json.loads(json.dumps(s.to_json()))) == s
    assert settings_from_json({}) == VllmSettings()
    with pytest.raises(ConfigError, match=r"unknown vLLM settings \['bogus'\]"):
        settings_from_json({"bogus": 1})


def test_refusals_name_the_fix():
    with pytest.raises(ConfigError, match="--units 5: give 1 to 4"):
        model_settings(5)
    with pytest.raises(ConfigError, match=r"more than a model's share .* \(0.45\)"):
        model_settings(2, gpu_memory_utilization=0.6)
    with pytest.raises(ConfigError, match="--kv-cache-gib 0: give a positive"):
        model_settings(2, kv_cache_gib=0)
    with pytest.raises(ConfigError, match="unknown engine 'tgi'; valid engines: reference, vllm"):
        check_engine("tgi", "cuda")
    with pytest.raises(ConfigError, match="runs on a GPU, not on 'cpu'"):
        check_engine("vllm", "cpu")
    check_engine("vllm", "cuda")
    check_engine("reference", "cpu")
    assert "lower --kv-cache-gib" in start_hint("CUDA out of memory")
    assert start_hint("no such file") == ""


def test_asleep_ones_start_first_then_the_awake_ones():
    p = Placement(("a", "b", "c", "d"), slots=2)
    assert start_order(p.states) == [("c", True), ("d", True), ("a", False), ("b", False)]
    one = Placement(("a", "b"), slots=1)
    assert start_order(one.states) == [("b", True), ("a", False)]
    assert one_at_a_time("vllm") and not one_at_a_time("reference")
    assert close_timeout_s("vllm") > close_timeout_s("reference")


class FakeProc:
    """A ModelProc stand-in that records what the start asked of it, in order."""

    def __init__(self, name: str, log: list[str], hello: dict[str, Any]) -> None:
        self.name, self.log, self.hello, self.load_s = name, log, hello, 0.5

    def go(self) -> None:
        self.log.append(f"go {self.name}")

    def wait_ready(self) -> float:
        self.log.append(f"up {self.name}")
        return 0.5

    def call(self, op: str) -> dict[str, Any]:
        self.log.append(f"{op} {self.name}")
        return {"ok": True}

    def ask_close(self) -> None:
        pass  # (its order beside the waits: tests/multi/test_close.py)

    def close(self, timeout_s: float) -> None:
        self.log.append(f"close {self.name}")


def _start(engine: str, fail: str | None = None) -> list[str]:
    log: list[str] = []
    specs = {n: SimpleNamespace(name=n) for n in ("a", "b", "c")}
    states = Placement(tuple(specs), slots=1).states

    def make(spec: Any, wait_go: bool) -> Any:
        log.append(f"make {spec.name} wait_go={wait_go}")
        return FakeProc(spec.name, log, {"from": "pool"})

    def started(name: str, proc: Any) -> None:
        if name == fail:
            raise RuntimeError("boom")
        log.append(f"started {name}")

    start_procs(specs, states, engine=engine, make=make, log=lambda _m: None,  # type: ignore[arg-type]
                on_started=started)  # fmt: skip
    return log


def test_vllm_engines_start_one_at_a_time_each_asleep_before_the_next():
    assert _start("vllm") == [
        "make a wait_go=True", "make b wait_go=True", "make c wait_go=True",
        "go b", "up b", "started b", "sleep b",
        "go c", "up c", "started c", "sleep c",
        "go a", "up a", "started a",
    ]  # fmt: skip


def test_reference_engines_start_all_at_once():
    log = _start("reference")
    assert log[:6] == ["make a wait_go=False", "make b wait_go=False", "make c wait_go=False",
                       "up a", "up b", "up c"]  # fmt: skip
    assert log[6:] == ["started a", "started b", "sleep b", "started c", "sleep c"]


def test_a_failed_start_closes_every_process():
    with pytest.raises(RuntimeError, match="boom"):
        _start("vllm", fail="c")


def test_spec_takes_the_digest_its_engine_started_from():
    from spswap.multi.procs import ModelSpec

    spec = ModelSpec("a", Path("/m/a"), "")
    assert spec_with(spec, {"digest": "d1"}).digest == "d1"
    assert spec_with(spec, {}).digest == ""


class FakeEngine:
    """VllmEngine's start calls, recorded."""

    def __init__(self) -> None:
        self.model_dir = Path("/m/qwen")
        self.settings = VllmSettings()
        self.calls: list[str] = []

    def identity(self) -> dict[str, Any]:
        return {"engine": "vllm"}

    def load_from_pool(self, pool: Any, digest: str) -> Any:
        self.calls.append(f"pool {digest}")
        return SimpleNamespace(to_json=lambda: {"gb_per_s": 50.0})

    def load_from_checkpoint(self, path: Path) -> float:
        self.calls.append(f"disk {path}")
        return 1.0

    def attach(self, pool: Any, digest: str) -> dict[str, Any]:
        self.calls.append(f"attach {digest}")
        return {}


class FakePool:
    def __init__(self) -> None:
        self.used: list[str] = []

    @contextlib.contextmanager
    def use(self, digest: str) -> Any:
        self.used.append(digest)
        yield


def test_start_from_the_pool_when_an_entry_of_its_identity_is_there(monkeypatch):
    monkeypatch.setattr(vllm_identity, "find_entry", lambda *a: SimpleNamespace(digest="e1"))
    eng, pool = FakeEngine(), FakePool()
    with contextlib.ExitStack() as uses:
        hello = vllm_start.start_engine(eng, pool, uses)
    assert hello["from"] == "pool" and hello["digest"] == "e1"
    assert eng.calls == ["pool e1"] and pool.used == ["e1"]


def test_first_start_is_cold_then_exported_and_attached(monkeypatch):
    exported: list[tuple[Any, ...]] = []
    monkeypatch.setattr(vllm_identity, "find_entry", lambda pool, ident: None)
    monkeypatch.setattr(vllm_start, "export_weights",
                        lambda *a: exported.append(a) or "e2")  # fmt: skip
    eng, pool = FakeEngine(), FakePool()
    with contextlib.ExitStack() as uses:
        hello = vllm_start.start_engine(eng, pool, uses)
    assert hello == {"from": "checkpoint", "digest": "e2"}
    assert eng.calls == ["disk /m/qwen", "attach e2"] and pool.used == ["e2"]
    (args,) = exported
    assert args[0] is eng and args[3] == "qwen" and args[4] == 1  # name, tensor parallel


def test_an_entry_found_written_over_starts_cold_and_says_why(monkeypatch):
    # spswapd read the entry (its file changed since sealed), found it damaged, removed it
    monkeypatch.setattr(vllm_identity, "find_entry", lambda *a: SimpleNamespace(digest="e1"))
    monkeypatch.setattr(vllm_start, "export_weights", lambda *a: "e2")

    class DamagedPool(FakePool):
        @contextlib.contextmanager
        def use(self, digest: str) -> Any:
            if digest == "e1":
                raise PoolCorrupt("pool entry q (e1): tensor 'w' does not match; removed")
            self.used.append(digest)
            yield

    eng, pool = FakeEngine(), DamagedPool()
    with contextlib.ExitStack() as uses:
        hello = vllm_start.start_engine(eng, pool, uses)
    assert hello == {
        "from": "checkpoint",
        "digest": "e2",
        "damaged": "pool entry q (e1): tensor 'w' does not match; removed",
    }
    assert eng.calls == ["disk /m/qwen", "attach e2"] and pool.used == ["e2"]


def test_no_vllm_args_needs_no_vllm():
    assert vllm_start.llm_overrides(Path("/m"), []) == {}
