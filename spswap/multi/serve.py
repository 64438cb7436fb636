"""``spswap serve --models A B C``: one job, one endpoint, several models: the options,
the models into the pool, and the router started with its swap budget checked. The run
itself (slot, stop, checkpoint of the whole job, restore) is
:mod:`spswap.multi.backend`'s, through the one serve lifecycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spswap.access import PoolAccess
from spswap.config import Config
from spswap.engines.vllm_engine import VllmSettings
from spswap.errors import ConfigError
from spswap.multi.engine_settings import check_engine, model_settings
from spswap.multi.placement import awake_slots, budget_refusal
from spswap.multi.procs import ModelSpec
from spswap.multi.router import Router
from spswap.multi.startup import Started
from spswap.multi.vllm_start import vllm_specs
from spswap.serve.weights_pack import pack_skipped, pack_slot_share


@dataclass(frozen=True)
class MultiOptions:
    """What ``spswap serve --models`` was asked to do."""

    models: tuple[Path, ...]
    socket_path: Path
    state_dir: Path
    engine: str = "reference"
    device: str = "cpu"
    units_per_model: int = 2  # quarter units of a device per awake model
    devices: int = 1  # the models share one device (the job's first GPU)
    slot_gpus: tuple[int, ...] = ()  # the job's GPUs (slot table indexes); none: no slot
    slot_timeout_s: float = 600.0
    max_awake: int | None = None
    idle_timeout_s: float | None = None
    latency_target_s: float | None = None
    swap_s: float | None = None  # the budget's swap estimate; None: measured at start
    port: int | None = None
    host: str = "127.0.0.1"
    drain_s: float = 5.0  # at a stop: how long the answers being made may still run
    vllm: VllmSettings | None = None  # (vllm) each model's: engine_settings.model_settings
    vllm_args: str = ""  # (vllm) vLLM's own options for every model, one string
    pack: bool = True  # (vllm, eager) each model's weights packed once up (--no-pack: not)

    def vllm_settings(self) -> VllmSettings:
        """The vLLM models' settings (given, else those of ``units_per_model``)."""
        if self.vllm is not None:
            return self.vllm
        return model_settings(self.units_per_model)

    def pack_slot_share(self) -> float | None:
        """(vLLM) The share of the GPU an eager model's engine, its packing's second copy
        included, stays inside: its units (:func:`~spswap.serve.weights_pack.pack_slot_share`);
        None where a single model's run would not try either
        (:func:`~spswap.serve.weights_pack.pack_skipped`: ``--no-pack``, CUDA graphs)."""
        if pack_skipped(self.vllm_settings().enforce_eager, self.pack) is not None:
            return None
        return pack_slot_share(self.units_per_model)


def check_names(paths: tuple[Path, ...]) -> None:
    """ConfigError unless the models are at least one, each named once (requests name a
    model by its directory's name)."""
    if len(paths) < 1:
        raise ConfigError("--models needs at least one model directory")
    same = sorted({str(p) for p in paths if paths.count(p) > 1})
    if same:  # the same directory twice: one is a slip
        raise ConfigError(f"{', '.join(same)} {'are' if len(same) > 1 else 'is'} given more "
                          "than once after --models: give each model directory once")  # fmt: skip
    names = [p.name for p in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"more than one model directory is named {', '.join(twice)}: "
                          "requests name a model by its directory's name; rename one")  # fmt: skip


def import_models(cfg: Config, opts: MultiOptions, job_id: str | None) -> list[ModelSpec]:
    """Each model's spec with its pool entry: the reference engine's imported from the
    model's files the first time; vLLM's found by its identity ("" where its first start
    is to export it)."""
    check_names(opts.models)
    pool = PoolAccess(cfg, job_id=job_id)
    if opts.engine == "vllm":
        return vllm_specs(pool, opts.models, opts.vllm_settings())[0]
    return [ModelSpec(p.name, p, pool.import_checkpoint(p).digest) for p in opts.models]


def start_router(cfg: Config, opts: MultiOptions, *, job_id: str | None = None,
                 log: Callable[[str], None] = print,
                 on_state: Callable[[str, bool], None] | None = None,
                 specs: list[ModelSpec] | None = None,
                 on_started: Started | None = None) -> Router:  # fmt: skip
    """The router with every model started and the swap budget checked (a refused set
    ends its engines and raises ConfigError with the reason). ``specs``: the models
    with their pool entries (else found, or imported, here). ``on_started``: each model
    up, before it is placed."""
    check_engine(opts.engine, opts.device)  # before any model is read into the pool
    if specs is None:
        specs = import_models(cfg, opts, job_id)
    slots = awake_slots(len(specs), opts.units_per_model, opts.devices, opts.max_awake)
    vllm = opts.engine == "vllm"
    router = Router(specs, slots=slots, engine=opts.engine, device=opts.device,
                    root=cfg.root, job_id=job_id, idle_timeout_s=opts.idle_timeout_s,
                    log=log, on_state=on_state, on_started=on_started,
                    engine_settings=opts.vllm_settings().to_json() if vllm else None,
                    vllm_args=opts.vllm_args if vllm else "",
                    pack_slot_share=opts.pack_slot_share() if vllm else None)  # fmt: skip
    router.start()
    if opts.latency_target_s is not None:
        swap_s = opts.swap_s if opts.swap_s is not None else router.measure_swap_s()
        refusal = budget_refusal(len(specs), slots, opts.latency_target_s, swap_s)
        if refusal is not None:
            router.close()
            raise ConfigError(refusal)
        log(
            f"spswap serve: swap budget met ({len(specs)} models, {slots} awake, "
            f"swap {swap_s:.3f} s, target {opts.latency_target_s:g} s)"
        )
    return router
