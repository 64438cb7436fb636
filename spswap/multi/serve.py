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
from spswap.errors import ConfigError
from spswap.multi.placement import awake_slots, budget_refusal
from spswap.multi.procs import ModelSpec
from spswap.multi.router import Router
from spswap.multi.worker import make_engine


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


def check_names(paths: tuple[Path, ...]) -> None:
    """ConfigError unless the models are at least one, each named once (requests name a
    model by its directory's name)."""
    if len(paths) < 1:
        raise ConfigError("--models needs at least one model directory")
    names = [p.name for p in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"more than one model directory is named {', '.join(twice)}: "
                          "requests name a model by its directory's name; rename one")  # fmt: skip


def import_models(cfg: Config, paths: tuple[Path, ...], job_id: str | None) -> list[ModelSpec]:
    """Each model in the pool (read from disk the first time); its spec."""
    check_names(paths)
    pool = PoolAccess(cfg, job_id=job_id)
    return [ModelSpec(p.name, p, pool.import_checkpoint(p).digest) for p in paths]


def start_router(cfg: Config, opts: MultiOptions, *, job_id: str | None = None,
                 log: Callable[[str], None] = print,
                 on_state: Callable[[str, bool], None] | None = None,
                 specs: list[ModelSpec] | None = None) -> Router:  # fmt: skip
    """The router with every model started and the swap budget checked (a refused set
    ends its engines and raises ConfigError with the reason). ``specs``: the models
    already in the pool (else they are imported here)."""
    if opts.engine != "reference":  # before any model is read into the pool
        make_engine(opts.engine, opts.models[0], opts.device, opts.models[0].name)
    if specs is None:
        specs = import_models(cfg, opts.models, job_id)
    slots = awake_slots(len(specs), opts.units_per_model, opts.devices, opts.max_awake)
    router = Router(specs, slots=slots, engine=opts.engine, device=opts.device,
                    root=cfg.root, job_id=job_id, idle_timeout_s=opts.idle_timeout_s,
                    log=log, on_state=on_state)  # fmt: skip
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
