"""The vLLM engine.

CPU (always): the pure parts (identity, LLM arguments, rpc replies, goals, model shapes)
and the worker extension's export -> pool entry -> attach -> copy path, run on a real
torch model inside a stand-in for vLLM's worker (vLLM's worker itself needs a GPU).
GPU + vLLM (skipped with a reason elsewhere): a real vLLM 0.26 on a Qwen2 0.5B-shaped
model with real safetensors: cold vs start-without-disk outputs, sleep/wake cycles,
and the export round trip checked byte for byte.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spswap.bench.swap import (  # noqa: E402
    compare_outputs,
    goals,
    render_bench_swap,
)
from spswap.engines import cuda_limits  # noqa: E402
from spswap.engines.protocol import Engine  # noqa: E402
from spswap.engines.vllm_engine import (  # noqa: E402
    WORKER_EXTENSION,
    VllmEngine,
    VllmSettings,
    available,
    engine_env,
    engine_identity,
    llm_kwargs,
    rank_result,
    transfer_report,
)
from spswap.engines.vllm_identity import (  # noqa: E402
    find_entry,
    identity_matches,
    model_config_hash,
    weights_fingerprint,
)
from spswap.engines.vllm_weights import weight_tensors  # noqa: E402
from spswap.engines.vllm_worker import SpswapWorkerExtension  # noqa: E402
from spswap.errors import EngineError, TransferError  # noqa: E402
from spswap.fsutil import evict_page_cache  # noqa: E402
from spswap.pool.store import Pool  # noqa: E402
from spswap.transfer.copy import TransferReport  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("make_models", ROOT / "scripts/gpu/make_models.py")
assert spec and spec.loader
make_models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_models)


def _model_dir(tmp_path: Path, **over: Any) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**make_models.qwen2_config("0.5b"), **over}))
    return d


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    return Pool(tmp_path / "pool", capacity_bytes=1 << 30)


# -- pure parts ------------------------------------------------------------------------
def test_engine_satisfies_the_protocol(tmp_path: Path) -> None:
    assert isinstance(VllmEngine(_model_dir(tmp_path)), Engine)


def test_identity_depends_on_config_content_not_key_order_or_place(tmp_path: Path) -> None:
    a = _model_dir(tmp_path)
    b = tmp_path / "elsewhere"
    b.mkdir()
    cfg = json.loads((a / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(dict(reversed(list(cfg.items())))))
    assert model_config_hash(a) == model_config_hash(b)
    ident = engine_identity(a, VllmSettings(), "0.26.0")
    assert ident == {"engine": "vllm", "vllm": "0.26.0", "tp_size": 1, "rank": 0,
                     "dtype": "bfloat16", "model_config_hash": model_config_hash(a),
                     "weights": weights_fingerprint(a)}  # fmt: skip
    (b / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    assert model_config_hash(a) != model_config_hash(b)
    with pytest.raises(EngineError, match="config.json"):
        model_config_hash(tmp_path / "nowhere")


@pytest.mark.parametrize("key", ["engine", "vllm", "tp_size", "rank", "dtype",
                                 "model_config_hash", "weights"])  # fmt: skip
def test_identity_matches_needs_every_key(key: str, tmp_path: Path) -> None:
    ident = engine_identity(_model_dir(tmp_path), VllmSettings(), "0.26.0")
    assert identity_matches({**ident, "extra": 1}, ident)
    assert not identity_matches({**ident, key: "other"}, ident)


def test_weights_fingerprint_tells_checkpoints_of_one_config_apart(tmp_path: Path) -> None:
    """ckpt-2000 after ckpt-1000 of one training run: same config.json, other weights;
    the pool must not hand back ckpt-1000's."""
    a, b = _model_dir(tmp_path), tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text((a / "config.json").read_text())
    (a / "model.safetensors").write_bytes(b"1" * 64)
    (b / "model.safetensors").write_bytes(b"2" * 80)
    assert model_config_hash(a) == model_config_hash(b)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    ia, ib = (engine_identity(d, VllmSettings(), "0.26.0") for d in (a, b))
    assert not identity_matches(ia, ib)
    before = weights_fingerprint(a)
    os.utime(a / "model.safetensors", ns=(1, 1))  # rewritten in place
    assert weights_fingerprint(a) != before
    now = weights_fingerprint(a)
    (a / "notes.txt").write_text("x")  # other files do not count
    assert weights_fingerprint(a) == now


def test_find_entry_picks_the_newest_matching_entry(tmp_path: Path, pool: Pool) -> None:
    ident = engine_identity(_model_dir(tmp_path), VllmSettings(), "0.26.0")
    digests = []
    for i, identity in enumerate([ident, {**ident, "dtype": "float16"}, ident]):
        with pool.writer(f"e{i}", identity=identity) as w:
            w.add("x", "U8", (4,), bytes([i] * 4))
        digests.append(w.manifest.digest)
    found = find_entry(pool, ident)
    assert found is not None and found.digest == digests[2]
    assert find_entry(pool, {**ident, "vllm": "0.33.0"}) is None


def test_llm_kwargs_and_env(tmp_path: Path) -> None:
    s = VllmSettings(gpu_memory_utilization=0.3)
    kw = llm_kwargs(tmp_path, s, dummy=True)
    assert kw["load_format"] == "dummy" and kw["enable_sleep_mode"] is True
    assert kw["skip_tokenizer_init"] is True and kw["enable_prefix_caching"] is False
    assert kw["attention_config"] == {"backend": "FLASH_ATTN"}
    assert llm_kwargs(tmp_path, s, dummy=False)["load_format"] == "auto"
    assert "kv_cache_memory_bytes" not in kw  # vLLM sizes the KV cache
    sized = VllmSettings(kv_cache_memory_bytes=8 << 30)
    assert llm_kwargs(tmp_path, sized, dummy=True)["kv_cache_memory_bytes"] == 8 << 30
    from spswap.bench.swap import bench_settings

    assert bench_settings(0.3, 4.0) == VllmSettings(gpu_memory_utilization=0.3,
                                                    kv_cache_memory_bytes=4 << 30)  # fmt: skip
    assert bench_settings().kv_cache_memory_bytes is None
    module, _, cls = kw["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), cls) is SpswapWorkerExtension
    env = engine_env(s)
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert engine_env(VllmSettings(multiprocessing=False))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_rank_result_checks_every_rank_replied() -> None:
    assert rank_result([{"a": 1}], "m", 1) == {"a": 1}
    with pytest.raises(EngineError, match="one dict per rank"):
        rank_result([None], "m", 1)
    with pytest.raises(EngineError, match=WORKER_EXTENSION):
        rank_result([{"a": 1}], "m", 2)


def test_transfer_report_round_trips_through_its_json() -> None:
    r = TransferReport(size_bytes=10, seconds=0.5, device="cuda:0", tensors=2,
                       registered=True, register_s=0.1)  # fmt: skip
    assert transfer_report(json.loads(json.dumps(r.to_json()))) == r


def test_goals() -> None:
    g = goals(55_000_000_000, 1.0, 30.0, 52.0, 54.0)
    assert g["bound_s"] == pytest.approx(1.05) and g["within_bound"]
    assert g["speedup_vs_level2_reload"] == pytest.approx(30.0) and g["speedup_ok"]
    assert g["copy_fraction_of_pinned"] == pytest.approx(52 / 54) and g["copy_ok"]
    g = goals(55_000_000_000, 1.2, 10.0, 40.0, 54.0)
    assert not (g["within_bound"] or g["speedup_ok"] or g["copy_ok"])
    assert goals(1, 0.1, None, 1.0, 0.0)["speedup_vs_level2_reload"] is None


def test_compare_outputs_says_where_prompts_diverge() -> None:
    assert compare_outputs([[1, 2], [3]], [[1, 2], [3]]) == {
        "equal": True, "prompts_equal": 2, "prompts": 2, "first_diff": [None, None]}  # fmt: skip
    c = compare_outputs([[1, 5, 6], [3], [4]], [[1, 2, 3], [3], [4, 4]])
    assert c["first_diff"] == [1, None, 1] and c["prompts_equal"] == 1 and not c["equal"]


def test_render_bench_swap_shows_every_path() -> None:
    from rich.console import Console

    m = {"model": "qwen2-0.5b", "weights": {"size_bytes": 988_000_000}, "cold_start_s": 20.0,
         "level1": {"total_s": 2.5}, "level2_reload": {"total_s": 1.5},
         "spswap_cycle_median_s": 0.06, "copy_median_gb_per_s": 53.1,
         "pinned": {"gb_per_s": 54.0}, "pool_start": {"start_s": 14.0},
         "all_identical": True, "goals": goals(988_000_000, 0.06, 1.5, 53.1, 54.0)}  # fmt: skip
    result = {"vllm": "0.26.0", "torch": "2.11", "host": "h", "models": [m,
              {"model": "broken", "errors": ["boom"]}],
              "settings": {"gpu_memory_utilization": 0.4,
                           "kv_cache_memory_bytes": 4 << 30}}  # fmt: skip
    m["spswap_cycles"] = [{"sleep_s": 0.02, "wake_weights_s": 0.01, "copy_rpc_s": 0.025,
                           "wake_kv_s": 0.005}] * 3  # fmt: skip
    result["models"] += [dict(m, model="qwen2-1.5b")]
    out = io.StringIO()
    # an 80-column terminal (or a job's log): every value whole (a row per model ran to
    # 12 columns and cut every cell to "…")
    Console(file=out, width=80).print(render_bench_swap(result))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    cells = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in text.splitlines() if line.startswith("│")}  # fmt: skip
    assert cells["copy GB/s"][0] == "53.1" and cells["pinned GB/s"][0] == "54.0"
    assert cells["vs L2 + reload"][0] == "25x faster" and cells["goals met"][0] == "20x, bound, 95%"
    assert cells["identical"] == ["yes", "-", "yes"]
    assert cells["error"] == ["-", "boom", "-"]
    assert cells["copy / pinned"][0] == "98.3%" and cells["spswap cycle"][0] == "60.0 ms"
    assert cells["wake weights"][0] == "10.0 ms"
    # spswap bench swap --pack: the packed cycles' rows after "copy / pinned"
    packed = dict(m, model="packed", spswap_cycles_packed=[
        {"sleep_s": 0.012, "wake_weights_s": 0.004, "copy_rpc_s": 0.024,
         "wake_kv_s": 0.005}] * 3, packed_cycle_median_s=0.045,
        goals_packed=goals(988_000_000, 0.045, 1.5, 53.9, 54.0))  # fmt: skip
    result["models"] = [packed, dict(m, model="unpacked")]
    out = io.StringIO()
    Console(file=out, width=80).print(render_bench_swap(result))
    lines = [line.split("│") for line in out.getvalue().splitlines() if line.startswith("│")]
    labels = [cells[1].strip() for cells in lines]
    at = labels.index("copy / pinned")
    assert labels[at + 1 : at + 6] == ["packed cycle", "sleep", "wake weights", "copy RPC",
                                       "copy / pinned"]  # fmt: skip
    assert [c.strip() for c in lines[at + 1][2:-1]] == ["45.0 ms", "-"]
    assert [c.strip() for c in lines[at + 2][2:-1]] == ["12.0 ms", "-"]
    assert [c.strip() for c in lines[at + 5][2:-1]] == ["99.8%", "-"]
    from spswap.bench.swap import kv_text
    from spswap.units import fmt_bytes

    assert kv_text(result["settings"]) == f"KV cache {fmt_bytes(4 << 30)}"
    assert kv_text({"gpu_memory_utilization": 0.4}) == (
        "KV cache: what gpu_memory_utilization=0.4 leaves"
    )


def test_qwen2_shapes_have_the_published_sizes() -> None:
    def params(size: str) -> int:
        shapes = make_models.tensor_shapes(make_models.qwen2_config(size))
        return sum(int(torch.Size(s).numel()) for s in shapes.values())

    assert 490e6 < params("0.5b") < 500e6
    assert 1.53e9 < params("1.5b") < 1.55e9
    assert 7.6e9 < params("7b") < 7.65e9
    shapes = make_models.tensor_shapes(make_models.qwen2_config("7b"))
    plan = make_models.shard_plan(shapes, 4 << 30)
    assert [n for shard in plan for n in shard] == list(shapes)
    assert len(plan) == 4


def test_evict_page_cache(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").write_bytes(b"x" * 4096)
    assert evict_page_cache(tmp_path)


# -- the worker extension on CPU, in a stand-in worker -----------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.proj = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as Qwen2-0.5B/1.5B
        self.register_buffer("scale", torch.full((4,), 2.0))  # persistent
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        self.k_scale = torch.nn.Parameter(torch.rand(()), requires_grad=False)  # 0-dim


class _Worker(SpswapWorkerExtension):
    """The attributes of vLLM's GPU worker that the extension reads."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.rank = 0


def test_weight_tensors_takes_tied_params_once_and_persistent_buffers() -> None:
    names = set(weight_tensors(_Tiny()))
    assert names == {"embed.weight", "proj.weight", "proj.bias", "k_scale", "scale"}


def test_worker_export_attach_copy_round_trip(tmp_path: Path, pool: Pool) -> None:
    torch.manual_seed(0)
    src = _Worker(_Tiny())
    out = src.spswap_export(str(pool.pool_dir), "tiny", {"engine": "vllm", "vllm": "x"})
    assert out["identity"] == {"engine": "vllm", "vllm": "x", "rank": 0, "tp_size": 1}
    assert out["tensors"] == 5 and json.loads(json.dumps(out)) == out  # plain data
    torch.manual_seed(1)
    dst = _Worker(_Tiny())
    assert dst.spswap_verify(str(pool.pool_dir), "tiny")["differ"]  # different weights
    loaded = dst.spswap_load(str(pool.pool_dir), out["digest"])
    assert loaded["copy"]["size_bytes"] > 0 and loaded["attach"]["digest"] == out["digest"]
    assert dst.spswap_verify(str(pool.pool_dir), "tiny") == {"checked": 5, "differ": []}
    assert torch.equal(dst.model_runner.model.head.weight, src.model_runner.model.embed.weight)
    assert float(dst.model_runner.model.k_scale) == float(src.model_runner.model.k_scale)
    # The entry is in use while attached, and no longer after detach.
    users = [e.users for e in pool.entries() if e.manifest.digest == out["digest"]][0]
    assert [h.pid for h in users] == [os.getpid()]
    with torch.no_grad():
        dst.model_runner.model.proj.weight.zero_()
    copied = dst.spswap_copy()  # a wake: from the same mapping again
    assert (copied["pull"], copied["released_bytes"]) == (0.0, None)  # as given: stage
    assert dst.spswap_verify(str(pool.pool_dir), "tiny")["differ"] == []
    # The wake picks the pull itself from the time since its sleep. Without vLLM's
    # allocator the pool's size is not known: the fixed window. Where vLLM is installed its
    # allocator says what a sleep released: nothing here (this process allocated nothing
    # through it), so the driver has nothing to clear and the copy engines copy.
    if available():
        cases = ((0.01, 0.0, 0), (5.0, 0.0, 0), (None, 0.0, None))
    else:
        cases = ((0.01, 1.0, None), (5.0, 0.0, None), (None, 0.0, None))
    for since_s, pull, released in cases:
        with torch.no_grad():
            dst.model_runner.model.proj.weight.zero_()
        copied = dst.spswap_copy(None, since_s)
        assert (copied["pull"], copied["released_bytes"]) == (pull, released)
        assert copied["worker_s"] >= copied["seconds"] > 0
        assert copied["worker_s"] >= copied["prepare_s"] + copied["copy_call_s"] - 1e-6
        assert copied["copy_call_s"] >= copied["seconds"]
        assert dst.spswap_verify(str(pool.pool_dir), "tiny")["differ"] == []
    assert dst.spswap_detach() == {"detached": True}
    assert [e.users for e in pool.entries()] == [[]]
    with pytest.raises(EngineError, match="spswap_attach"):
        dst.spswap_copy()


def test_a_trim_drops_cublas_workspaces_only_without_cuda_graphs() -> None:
    """Captured CUDA graphs point into cuBLAS's workspaces (a replay after dropping them
    failed with an illegal memory access): only an eager engine's trim drops them."""
    worker = _Worker(_Tiny())
    assert worker._spswap_no_cuda_graphs() is False  # not said: graphs, to be safe

    def mode(name: str) -> SimpleNamespace:
        return SimpleNamespace(compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(name=name)), parallel_config=None)  # fmt: skip

    worker.vllm_config = mode("NONE")  # vLLM's enforce_eager sets it
    assert worker._spswap_no_cuda_graphs() is True
    worker.vllm_config = mode("FULL_AND_PIECEWISE")
    assert worker._spswap_no_cuda_graphs() is False


def test_a_lowered_thread_stack_is_set_back_once_to_its_first_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trim's stack bookkeeping (the real driver's in the GPU test below): the size
    set back is the one before the first trim, once; a driver that refuses changes
    nothing and owes nothing."""
    limit = {"stack": 1024, "refuse": False}

    def set_stack(size_bytes: int) -> bool:
        if limit["refuse"]:
            return False
        limit["stack"] = size_bytes
        return True

    monkeypatch.setattr(cuda_limits, "stack_bytes", lambda: limit["stack"])
    monkeypatch.setattr(cuda_limits, "set_stack_bytes", set_stack)
    worker = _Worker(_Tiny())
    assert worker._spswap_restore_thread_stack() is None  # nothing lowered yet
    assert worker._spswap_lower_thread_stack() == 1024
    assert limit["stack"] == cuda_limits.TRIMMED_STACK_BYTES
    assert worker._spswap_lower_thread_stack() is None  # already down
    limit["stack"] = 64  # a launch grew it again before the next trim
    assert worker._spswap_lower_thread_stack() == 64
    assert worker._spswap_restore_thread_stack() == 1024 and limit["stack"] == 1024
    assert worker._spswap_restore_thread_stack() is None  # once
    limit["refuse"] = True
    assert worker._spswap_lower_thread_stack() is None and limit["stack"] == 1024
    assert worker._spswap_restore_thread_stack() is None


def test_without_a_driver_the_stack_is_unknown_and_left_alone() -> None:
    if cuda_limits._driver() is not None:
        pytest.skip("an NVIDIA driver is here: the GPU test covers it")
    assert cuda_limits.stack_bytes() is None
    assert cuda_limits.set_stack_bytes(16) is False


def test_a_wake_reuses_the_weights_lookup_until_the_model_changes(pool: Pool) -> None:
    """The weights' tensors are looked up once per model (a wake's copy spent 3-6 ms
    walking the model on the GPU); a model vLLM replaced is looked up again, so the copy
    never writes into a model that is gone."""
    torch.manual_seed(0)
    src = _Worker(_Tiny())
    out = src.spswap_export(str(pool.pool_dir), "tiny", {"engine": "vllm"})
    dst = _Worker(_Tiny())
    dst.spswap_attach(str(pool.pool_dir), out["digest"])
    first = dst._spswap_tensors()
    dst.spswap_copy()
    assert dst._spswap_tensors() is first  # the same lookup
    dst.model_runner.model = _Tiny()  # vLLM loaded the model again
    dst.spswap_copy()
    assert dst._spswap_tensors() is not first
    assert dst.spswap_verify(str(pool.pool_dir), "tiny")["differ"] == []  # the new model
    dst.spswap_detach()


def test_worker_first_copy_variants_write_what_they_say(tmp_path: Path, pool: Pool) -> None:
    torch.manual_seed(0)
    src = _Worker(_Tiny())
    out = src.spswap_export(str(pool.pool_dir), "tiny", {"engine": "vllm"})
    dst = _Worker(_Tiny())
    dst.spswap_attach(str(pool.pool_dir), out["digest"])
    assert dst.spswap_first_copy("memset")["gb_per_s"] > 0
    assert float(dst.model_runner.model.proj.weight.detach().abs().sum()) == 0.0
    for variant in ("direct", "staged"):
        dst.spswap_first_copy("memset")
        r = dst.spswap_first_copy(variant, 0.01)
        assert r["variant"] == variant and r["wait_s"] == 0.01 and r["seconds"] > 0
        assert dst.spswap_verify(str(pool.pool_dir), "tiny")["differ"] == []
    with pytest.raises(EngineError, match="unknown variant"):
        dst.spswap_first_copy("teleport")
    dst.spswap_detach()


def test_worker_attach_refuses_an_entry_of_another_layout(tmp_path: Path, pool: Pool) -> None:
    with pool.writer("other") as w:
        w.add("x", "U8", (4,), b"abcd")
    with pytest.raises(TransferError, match="does not fit"):
        _Worker(_Tiny()).spswap_attach(str(pool.pool_dir), "other")
    assert [e.users for e in pool.entries()] == [[]]


@pytest.mark.skipif(available(), reason="vLLM is installed here")
def test_without_vllm_loading_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="reference engine"):
        VllmEngine(_model_dir(tmp_path)).load_from_checkpoint(_model_dir(tmp_path))


# -- a real vLLM on a GPU ------------------------------------------------------------------
NO_VLLM = "vLLM is not installed (put a vLLM kit on PYTHONPATH: scripts/gpu/README)"
gpu_vllm = [
    pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.skipif(not available(), reason=NO_VLLM),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]  # fmt: skip
PROMPTS = [[(7 * i + 13 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate((8, 17, 33))]
NEW_TOKENS = 12
SETTINGS = VllmSettings(gpu_memory_utilization=0.3, max_model_len=512)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("SPSWAP_TEST_VLLM_MODEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("models")
    return Path(make_models.write_model(out, "0.5b", seed=0, shard_bytes=4 << 30)["dir"])


@pytest.fixture(scope="module")
def cold(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pool = Pool(Path(os.environ.get("SPSWAP_TEST_POOL", tmp_path_factory.mktemp("pool"))))
    eng = VllmEngine(vllm_model, SETTINGS)
    eng.load_from_checkpoint(vllm_model)
    reference = eng.generate(PROMPTS, NEW_TOKENS)
    manifest = eng.export_weights(pool, "test-qwen2-0.5b")
    eng.attach(pool, manifest.digest)
    yield SimpleNamespace(engine=eng, reference=reference, pool=pool, manifest=manifest)
    eng.close()


def _apply(f: Any) -> Any:
    for m in gpu_vllm:
        f = m(f)
    return f


@_apply
def test_cold_outputs_are_deterministic(cold: Any) -> None:
    assert all(len(o) == NEW_TOKENS for o in cold.reference)
    assert cold.engine.generate(PROMPTS, NEW_TOKENS) == cold.reference


@_apply
def test_sleep_wake_cycles_give_the_cold_outputs(cold: Any) -> None:
    eng = cold.engine
    for _ in range(3):
        eng.sleep()
        report = eng.wake()
        assert report.registered and report.size_bytes == cold.manifest.tensor_bytes
        assert eng.generate(PROMPTS, NEW_TOKENS) == cold.reference
    print(f"last wake: {eng.last_wake}", file=sys.stderr)


@_apply
def test_a_trim_lowers_the_thread_stack_and_the_wake_sets_it_back(cold: Any) -> None:
    """An eager engine's trim drops cuBLAS's workspaces and lowers the context's
    per-thread stack (its local memory goes back to the driver: 264 MiB on an H100);
    the wake's copy sets the stack back before any kernel, and the answers stay."""
    eng = cold.engine
    eng.sleep()
    trimmed = eng.trim()
    lowered = trimmed["stack_lowered_from_bytes"]
    assert trimmed["cublas_cleared"] is True, trimmed
    assert lowered is not None and lowered > cuda_limits.TRIMMED_STACK_BYTES, trimmed
    eng.wake()
    assert eng.last_wake is not None
    assert eng.last_wake.copy["stack_restored_bytes"] == lowered, eng.last_wake.copy
    assert eng.generate(PROMPTS, NEW_TOKENS) == cold.reference
    print(f"trim: {trimmed}", file=sys.stderr)


@_apply
def test_export_round_trip_byte_for_byte(cold: Any) -> None:
    m = cold.manifest
    assert m.identity["engine"] == "vllm" and m.identity["rank"] == 0
    assert any("qkv_proj" in t.name for t in m.tensors)  # the form vLLM holds: fused
    res = cold.engine.rpc("spswap_verify", str(cold.pool.pool_dir), m.digest)
    assert res["differ"] == [] and res["checked"] == len(m.tensors)


@_apply
def test_start_without_disk_gives_the_cold_outputs(cold: Any, vllm_model: Path) -> None:
    with VllmEngine(vllm_model, SETTINGS) as eng:
        started = eng.start(cold.pool, "unused-name")
        assert started["from"] == "pool"
        assert eng.generate(PROMPTS, NEW_TOKENS) == cold.reference
        eng.sleep()
        eng.wake()
        assert eng.generate(PROMPTS, NEW_TOKENS) == cold.reference


@_apply
def test_packed_weights_give_the_cold_outputs_from_fewer_allocations(
    cold: Any, vllm_model: Path
) -> None:
    """``VllmEngine.pack``: the weights in one allocation of vLLM's sleep-mode pool (its
    own bookkeeping, with fewer allocations for the weights after), the same answers,
    and every later wake copies the entry in one host copy into it."""
    with VllmEngine(vllm_model, SETTINGS) as eng:
        eng.start(cold.pool, "unused-name")
        packed = eng.pack()
        assert packed["packed"] and packed["rebound"] >= packed["tensors"] > 0, packed
        assert packed["layout_checked"] is True, packed
        assert packed["after"]["weights"] < packed["before"]["weights"], packed
        assert packed["after"]["kv_cache"] == packed["before"]["kv_cache"], packed
        assert eng.generate(PROMPTS, NEW_TOKENS) == cold.reference
        for _ in range(2):
            eng.sleep()
            eng.wake()
            assert eng.last_wake is not None and eng.last_wake.copy["packed"] is True
            assert eng.generate(PROMPTS, NEW_TOKENS) == cold.reference
        res = eng.rpc("spswap_verify", str(cold.pool.pool_dir), cold.manifest.digest)
        assert res["differ"] == [], res
        print(f"pack: {packed}; last wake: {eng.last_wake}", file=sys.stderr)


def test_pull_share_pulls_only_while_the_driver_clears_what_the_sleep_freed() -> None:
    from spswap.engines.vllm_pull import (
        COPY_BYTES_PER_S,
        PULL_BYTES_PER_S,
        PULL_WINDOW_S,
        SCRUB_BYTES_PER_S,
        SCRUB_FREE_BYTES,
        SCRUBBING_COPY_BYTES_PER_S,
        copy_engines_s,
        pull_bytes_per_s,
        pull_share,
        scrub_busy_s,
    )  # fmt: skip

    big = 57_567_000_000  # 1.5B weights + a 54 GB KV cache: copy engines slow ~0.45 s
    assert scrub_busy_s(big) == (big - SCRUB_FREE_BYTES) / SCRUB_BYTES_PER_S
    assert 0.4 < scrub_busy_s(big) < 0.6
    assert pull_share(0.02, big) == 1.0  # the in-process cycle: copy engines at half rate
    assert pull_share(scrub_busy_s(big) + 0.01, big) == 0.0  # cleared by now
    small = 7_596_000_000  # the same weights + a 4 GiB KV cache: full rate at once
    assert scrub_busy_s(small) == 0.0 and pull_share(0.02, small) == 0.0
    # the pool's size not known: the fixed window
    assert pull_share(0.05) == 1.0 and pull_share(PULL_WINDOW_S + 0.1) == 0.0
    assert pull_share(None, big) == 0.0  # never slept (a restored or new process)
    assert pull_share(-3.0, big) == 0.0  # another boot's clock: not right after a sleep
    # the copy's size weighed: pulled where that beats the copy engines' slowed copy
    assert pull_share(0.02, big, 3_554_000_000) == 1.0  # the 1.5B of `big` itself
    assert pull_share(0.02, big, 1_260_335_232) == 1.0  # a 0.5B after as large a sleep
    # 7B after a 4 GiB KV cache (H100, 2026-12-05: pulled 34 GB/s, 0.45 s): the clearing
    # ends early in its copy; the copy engines' full rate wins
    seven_b, freed = 15_231_233_472, 19_702_743_040
    assert copy_engines_s(seven_b, scrub_busy_s(freed)) < seven_b / PULL_BYTES_PER_S
    assert pull_share(0.02, freed, seven_b) == 0.0 and pull_share(0.02, freed) == 1.0
    # the H200's cores pull faster (49 GB/s, 0.31 s): there the same 7B is pulled
    h200 = pull_bytes_per_s("NVIDIA H200")
    assert h200 > PULL_BYTES_PER_S and pull_share(0.02, freed, seven_b, h200) == 1.0
    assert pull_bytes_per_s("NVIDIA H100 80GB HBM3") == PULL_BYTES_PER_S
    assert pull_bytes_per_s("NVIDIA A100-SXM4-80GB") == PULL_BYTES_PER_S  # not measured
    assert pull_bytes_per_s("NVIDIA GH200 480GB") == PULL_BYTES_PER_S  # a word, not a part
    assert copy_engines_s(10 << 30, 0.0) == (10 << 30) / COPY_BYTES_PER_S
    assert copy_engines_s(1 << 30, 1.0) == (1 << 30) / SCRUBBING_COPY_BYTES_PER_S
