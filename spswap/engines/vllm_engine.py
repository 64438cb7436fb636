"""The vLLM engine: a stock vLLM ``LLM`` (no fork, no patched files) driven through the
same protocol as the reference engine.

The ``LLM`` is created with sleep mode on and spswap's worker extension
(:class:`spswap.engines.vllm_worker.SpswapWorkerExtension`), which exports the loaded
weights to the pool and copies them back. A swap is::

    sleep:  llm.sleep(level=2)         weights and KV cache discarded
    wake:   spswap.engines.vllm_wake   weights' memory, the copy from the pool mapping,
                                       the KV cache, the prefix cache (the one sequence,
                                       shared with ``spswap serve --engine vllm``)

Start without disk: :meth:`VllmEngine.load_from_pool` builds the engine with
``load_format="dummy"`` and fills it from a pool entry exported earlier by an engine
of the same identity (:func:`engine_identity`). vLLM is imported lazily: this module
imports without it, and :func:`available` says whether it is there.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spswap.engines.protocol import EngineInfo
from spswap.engines.vllm_identity import (
    find_entry,
    identity_matches,
    model_config_hash,
    weights_fingerprint,
)
from spswap.engines.vllm_wake import WakeTimes, wake
from spswap.errors import EngineError
from spswap.install_hint import pip_install_hint
from spswap.instance.state import Instance, Primitive, State

ENGINE_KIND = "vllm"
WORKER_EXTENSION = "spswap.engines.vllm_worker.SpswapWorkerExtension"


def available() -> bool:
    """Whether vLLM can be imported here (it is not on CPU-only machines)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_version() -> str:
    """The installed vLLM's version; :class:`EngineError` when it is not installed."""
    try:
        import vllm
    except ImportError as e:
        raise EngineError(
            f"vLLM is not importable ({e}); install it (`{pip_install_hint('vllm')}`), or use "
            "the reference engine (--engine reference)"
        ) from None
    return str(vllm.__version__)


@dataclass(frozen=True)
class VllmSettings:
    """How the ``LLM`` is built. The defaults favour fast starts and exact greedy
    identity (eager, no prefix caching) over peak throughput."""

    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.4
    # The KV cache's size in bytes, instead of what gpu_memory_utilization leaves for it
    # (vLLM's kv_cache_memory_bytes); None: vLLM sizes it.
    kv_cache_memory_bytes: int | None = None
    max_model_len: int = 1024
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    attention_backend: str = "FLASH_ATTN"
    seed: int = 0
    multiprocessing: bool = True  # engine core in its own process (clean teardown)
    v2_model_runner: bool = False
    # more ``vllm.LLM`` keyword arguments, e.g. from vLLM's own command-line options
    # (``spswap serve --models ... --vllm-args``); they override the ones above
    llm_overrides: tuple[tuple[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def kv_cache_bytes(kv_cache_gib: float | None) -> int | None:
    """``--kv-cache-gib`` as :attr:`VllmSettings.kv_cache_memory_bytes` (None: vLLM
    sizes the KV cache)."""
    return None if kv_cache_gib is None else int(kv_cache_gib * (1 << 30))


def engine_env(settings: VllmSettings) -> dict[str, str]:
    """Environment vLLM reads at start: no hub, no telemetry, no flashinfer sampler
    (not shipped everywhere), the V1 model runner, in/out-of-process engine core
    started by spawn."""
    return {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_USE_V2_MODEL_RUNNER": "1" if settings.v2_model_runner else "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if settings.multiprocessing else "0",
        # A parent that touched CUDA (even torch.cuda.is_available()) poisons fork.
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }  # fmt: skip


def llm_kwargs(model_dir: Path, settings: VllmSettings, *, dummy: bool) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for ``model_dir``: real weights from its
    safetensors, or dummy ones to be filled from the pool."""
    kv = settings.kv_cache_memory_bytes
    return {
        **({"kv_cache_memory_bytes": int(kv)} if kv is not None else {}),
        "model": str(model_dir), "load_format": "dummy" if dummy else "auto",
        "skip_tokenizer_init": True, "enable_sleep_mode": True,
        "worker_extension_cls": WORKER_EXTENSION, "dtype": settings.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_model_len": settings.max_model_len, "seed": settings.seed,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "attention_config": {"backend": settings.attention_backend},
        **dict(settings.llm_overrides),
    }  # fmt: skip


def engine_identity(
    model_dir: Path, settings: VllmSettings, version: str, *, rank: int = 0
) -> dict[str, Any]:
    """What a pool entry of vLLM-held weights must match to be loaded into an engine."""
    return {
        "engine": ENGINE_KIND, "vllm": version, "tp_size": settings.tensor_parallel_size,
        "rank": rank, "dtype": settings.dtype, "model_config_hash": model_config_hash(model_dir),
        "weights": weights_fingerprint(model_dir),
    }  # fmt: skip


def rank_result(results: list[Any], method: str, tp_size: int) -> dict[str, Any]:
    """Rank 0's reply of a ``collective_rpc`` call, after checking every rank replied
    with a dict."""
    if len(results) != tp_size or not all(isinstance(r, dict) for r in results):
        raise EngineError(
            f"collective_rpc({method!r}) returned {results!r:.300}: expected one dict per "
            f"rank ({tp_size}); is {WORKER_EXTENSION} the engine's worker_extension_cls?"
        )
    return dict(results[0])


def transfer_report(d: dict[str, Any]) -> Any:
    """A :class:`~spswap.transfer.copy.TransferReport` from the worker's dict."""
    from spswap.transfer.copy import TransferReport

    keys = ("size_bytes", "seconds", "device", "tensors", "registered", "register_s")
    return TransferReport(**{k: d[k] for k in keys})


class VllmEngine:
    """One vLLM model in this process (its engine core may be a child process)."""

    def __init__(
        self, model_dir: Path, settings: VllmSettings | None = None, *, name: str | None = None
    ) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings or VllmSettings()
        self.name = name or self.model_dir.name
        self.instance = Instance(name=self.name, state=State.UP)
        self.last_start_s = 0.0
        self.last_wake: WakeTimes | None = None
        self._llm: Any = None
        self._attached: dict[str, Any] | None = None
        self._slept_at: float | None = None  # monotonic time of the last level-2 sleep
        self._source = ""

    # -- building -----------------------------------------------------------------------
    def identity(self, rank: int = 0) -> dict[str, Any]:
        """This engine's pool identity (see :func:`engine_identity`)."""
        return engine_identity(self.model_dir, self.settings, vllm_version(), rank=rank)

    def _build(self, *, dummy: bool) -> float:
        self.close()
        os.environ.update(engine_env(self.settings))
        vllm_version()  # a clear error when vLLM is missing
        from vllm import LLM

        start = time.perf_counter()
        self._llm = LLM(**llm_kwargs(self.model_dir, self.settings, dummy=dummy))
        self.instance = Instance(name=self.name, state=State.UP)
        return time.perf_counter() - start

    def load_from_checkpoint(self, path: Path) -> float:
        """Cold start: a fresh ``LLM`` reading the safetensors in ``path`` (the model
        directory); returns seconds."""
        if Path(path).resolve() != self.model_dir.resolve():
            self.model_dir = Path(path)
        self.last_start_s = self._build(dummy=False)
        self._source = str(self.model_dir)
        return self.last_start_s

    def load_from_pool(self, pool: Any, ref: str) -> Any:
        """Start without disk: a fresh ``LLM`` with dummy weights, then every weight
        copied from pool entry ``ref`` (kept mapped for later wakes). Returns the
        TransferReport; :attr:`last_start_s` holds the whole start."""
        start = time.perf_counter()
        self._build(dummy=True)
        manifest = pool.find(ref)
        if not identity_matches(manifest.identity, self.identity()):
            raise EngineError(
                f"pool entry {manifest.name} ({manifest.digest[:12]}) has identity "
                f"{manifest.identity}, this engine needs {self.identity()}: export it from "
                "an engine with the same vLLM version, dtype, parallel layout and config"
            )
        loaded = self.rpc("spswap_load", str(pool.pool_dir), manifest.digest)
        self._attached = loaded["attach"]
        self._source = f"pool:{manifest.digest}"
        self.last_start_s = time.perf_counter() - start
        return transfer_report(loaded["copy"])

    def start(self, pool: Any, name: str) -> dict[str, Any]:
        """From the pool when an entry of this identity is there, else cold from the
        checkpoint and export (once) as ``name``; attached either way."""
        entry = find_entry(pool, self.identity())
        if entry is not None:
            report = self.load_from_pool(pool, entry.digest)
            return {"from": "pool", "start_s": self.last_start_s, "copy": report.to_json()}
        self.load_from_checkpoint(self.model_dir)
        manifest = self.export_weights(pool, name)
        attach = self.attach(pool, manifest.digest)
        return {"from": "checkpoint", "start_s": self.last_start_s, "attach": attach}

    def attach(self, pool: Any, ref: str) -> dict[str, Any]:
        """Map and register pool entry ``ref`` in the worker, so :meth:`wake` can copy."""
        self._attached = self.rpc("spswap_attach", str(pool.pool_dir), ref)
        return self._attached

    # -- Sleep <-> Up -------------------------------------------------------------------
    def sleep(self) -> float:
        """Up -> Sleep: ``sleep(level=2)`` (weights and KV cache freed); returns seconds."""
        llm = self._loaded()
        if self._attached is None:
            raise EngineError(
                f"{self.name}: cannot sleep at level 2: no pool entry is attached, so "
                "nothing could bring the weights back; export_weights then attach first"
            )
        with self.instance.step(Primitive.SLEEP):
            llm.sleep(level=2)
        self._slept_at = time.monotonic()
        return self.instance.last_duration_s

    def wake(self) -> Any:
        """Sleep -> Up through the one wake sequence (:func:`spswap.engines.vllm_wake.wake`):
        weights memory back, weights copied from the pool, the KV cache, an empty prefix
        cache. Returns the copy's TransferReport; :attr:`last_wake` holds the breakdown."""
        self._loaded()
        with self.instance.step(Primitive.WAKE):
            t = wake(self, prefix_caching=self.settings.enable_prefix_caching,
                     slept_at=self._slept_at)  # fmt: skip
        self.last_wake = t
        return transfer_report(t.copy)

    # the calls a wake is made of (vllm_wake.WakeOps)
    def wake_up(self, tags: list[str]) -> None:
        self._loaded().wake_up(tags=tags)

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        """A worker-extension method on every rank; rank 0's reply."""
        results = self._loaded().collective_rpc(method, args=args)
        return rank_result(results, method, self.settings.tensor_parallel_size)

    def reset_prefix_cache(self) -> None:
        self._loaded().reset_prefix_cache()

    def pack(self, slot_share: float | None = None,
             max_bytes: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Up, attached: the weights into one allocation of vLLM's sleep-mode pool, laid
        out as the attached entry (``spswap_pack``: fewer driver calls in every sleep
        and wake, one host copy in every wake; the second copy it holds for a moment must
        fit beside what the engine holds in ``slot_share`` of the GPU, its slot's; weights
        of more than ``max_bytes`` stay as loaded); returns what it did, or why not."""
        if self._attached is None or self.state is not State.UP:
            raise EngineError(f"{self.name}: pack an awake engine with an attached entry")
        return self.rpc("spswap_pack", slot_share, max_bytes)

    def trim(self) -> dict[str, Any]:
        """Asleep, before a CUDA checkpoint: return cached device blocks to the driver
        (see ``spswap_trim``); returns the device's memory figures."""
        if self.state is not State.SLEEP:
            raise EngineError(f"{self.name} is {self.state.value}: trim only after sleep()")
        return self.rpc("spswap_trim")

    @property
    def state(self) -> State:
        return self.instance.state

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` itself (benchmarks drive vLLM's own sleep paths through it)."""
        return self._loaded()

    # -- serving ------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int,
                 abort: Callable[[], bool] | None = None) -> list[list[int]]:  # fmt: skip
        """Greedy continuations (new token ids only; EOS ignored, so exactly
        ``max_new_tokens`` each); one batch in vLLM, so ``abort`` is not asked."""
        llm = self._loaded()
        if self.state is not State.UP:
            raise EngineError(f"{self.name} is {self.state.value}: wake it first")
        if any(not p for p in prompt_ids):
            raise EngineError("an empty prompt has nothing to continue; give a token")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # -- export, health, teardown -------------------------------------------------------
    def export_weights(self, pool: Any, name: str) -> Any:
        """Write the weights as vLLM holds them (rank by rank) as pool entry ``name``;
        returns rank 0's Manifest."""
        if self.state is not State.UP:
            raise EngineError(f"{self.name} is {self.state.value}: wake it before exporting")
        tp = self.settings.tensor_parallel_size
        entry_name = name if tp == 1 else f"{name}.tp{tp}"
        identity = {k: v for k, v in self.identity().items() if k not in ("rank", "tp_size")}
        out = self.rpc("spswap_export", str(pool.pool_dir), entry_name, identity)
        return pool.find(out["digest"])

    def weights_info(self) -> dict[str, Any]:
        """Rank 0's weight bytes, tensor count and dtypes."""
        return self.rpc("spswap_weights_info")

    def pinned_copy_limit(self, size_bytes: int) -> dict[str, Any]:
        """Host->GPU rate from a pinned buffer in the engine's own process (best of 5)."""
        return self.rpc("spswap_pinned_copy_limit", int(size_bytes))

    def health(self) -> EngineInfo:
        """State and footprint now."""
        info = self.weights_info() if self._llm is not None else {"size_bytes": 0}
        size = int(info["size_bytes"])
        return EngineInfo(
            name=self.name, kind=ENGINE_KIND, device="cuda", state=self.state,
            weight_bytes=size, resident_bytes=size if self.state is State.UP else 0,
            source=self._source,
            details={"settings": self.settings.to_json(), "attached": self._attached},
        )  # fmt: skip

    def close(self) -> None:
        """Detach the pool entry, shut the engine core down and free the GPU."""
        llm, self._llm = self._llm, None
        self._attached = None
        self._source = ""
        if llm is None:
            return
        try:
            llm.collective_rpc("spswap_detach")
        finally:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
            gc.collect()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loaded(self) -> Any:
        if self._llm is None:
            raise EngineError(
                f"{self.name} has no running vLLM: call load_from_checkpoint or load_from_pool"
            )
        return self._llm
