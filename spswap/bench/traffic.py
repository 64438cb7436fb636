"""``spswap bench traffic``: Poisson traffic against a multi-model job's endpoint.

For each model count, the router serves that many models (reference models made here,
seeds differing, unless model directories are given; vLLM needs them given) on one
device; for each number of awake models (``awake``: e.g. two-resident, then
one-resident, on the same engines) and each rate, requests arrive as a Poisson process
for ``duration_s``, each sent on its own thread to the job's socket as a client would.
Latency is arrival to answer; swaps are the router's own (demand swaps during the rate's
run). With ``check``, every answer is compared with the model's cold answer: read from
the checkpoint by a fresh engine (reference), or, for vLLM, asked of each model right
after its first start from its files, before anything swapped it (a model already in
the pool gets a cold engine of its own first: :mod:`spswap.bench.traffic_cold`).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.bench.traffic_cold import ColdAnswers, reference_cold
from spswap.bench.traffic_plan import (
    Arrival,
    RateRow,
    arrivals,
    highest_within,
    prompt_set,
    summarize,
)
from spswap.config import Config
from spswap.engines.vllm_engine import VllmSettings
from spswap.errors import ConfigError
from spswap.fsutil import atomic_write_json
from spswap.multi import http_api
from spswap.multi.engine_settings import check_engine
from spswap.multi.http_api import ApiServer
from spswap.multi.serve import MultiOptions, start_router

PROMPTS = 16  # a vLLM run's fixed prompts (each model's cold answers made once)


@dataclass(frozen=True)
class TrafficOptions:
    model_counts: tuple[int, ...] = (2, 4, 6)
    rates_per_min: tuple[float, ...] = (30.0, 60.0)  # for every model count
    rates_by_count: tuple[tuple[int, tuple[float, ...]], ...] = ()  # and for one count
    duration_s: float = 30.0
    max_new_tokens: int = 8
    p95_target_s: float = 2.0
    units_per_model: int = 2
    awake: tuple[int, ...] = ()  # awake models at once, run after run; (): as units allow
    preset: str = "tiny"
    models: tuple[Path, ...] = ()  # given model directories (the first N are used)
    check: bool = True
    seed: int = 0
    engine: str = "reference"
    vllm: VllmSettings | None = None  # (vllm) each model's settings (default: from units)
    vllm_args: str = ""
    out: Path | None = None  # the report, rewritten after every rate (a cut run keeps its rows)

    def rates(self, n_models: int) -> tuple[float, ...]:
        """The rates run with ``n_models`` models."""
        return self.rates_per_min + dict(self.rates_by_count).get(n_models, ())


def _given_models(opts: TrafficOptions, n: int) -> list[Path] | None:
    """The first ``n`` of ``--models`` (None: none given, the reference engine makes
    them); ConfigError where they are too few or vLLM has none."""
    if opts.models:
        if len(opts.models) < n:
            given = len(opts.models)
            raise ConfigError(f"--models gives {given} director{'y' if given == 1 else 'ies'} "
                              f"but a run with {n} models was asked (--model-counts)")  # fmt: skip
        return list(opts.models[:n])
    if opts.engine == "vllm":
        raise ConfigError("bench traffic --engine vllm serves model directories you give: "
                          "--models DIR (repeat; Hugging Face-style, e.g. made by "
                          "scripts/gpu/make_models.py)")  # fmt: skip
    return None


def _models(opts: TrafficOptions, n: int, scratch: Path) -> list[Path]:
    given = _given_models(opts, n)
    if given is not None:
        return given
    from spswap.engines.reference import save_checkpoint
    from spswap.engines.reference_model import preset

    return [save_checkpoint(preset(opts.preset, seed=1000 + i), scratch / f"model{i}")
            if not (scratch / f"model{i}").exists() else scratch / f"model{i}"
            for i in range(n)]  # fmt: skip


def run_rate(socket_path: Path, router: Any, models: list[Path], plan: list[Arrival],
             cold: Callable[[int, tuple[int, ...]], list[int] | None], *, rate: float,
             opts: TrafficOptions, awake: int = 0) -> tuple[RateRow, str]:  # fmt: skip
    """One rate's run of ``plan``; the row and the /metrics text read at its end.
    ``cold(model, prompt)``: the cold answer an answer must equal (None: not checked)."""
    latencies: list[float] = []
    failures: list[str] = []
    wrong: list[int] = []
    lock = threading.Lock()
    swaps_before = len(router.swap_log_s)

    def one(a: Arrival, sent_s: float) -> None:
        try:
            answer = http_api.complete(socket_path, models[a.model].name, list(a.prompt_ids),
                                       opts.max_new_tokens)  # fmt: skip
            took = time.monotonic() - sent_s
            ok = answer["status"] == 200
            ids = answer["choices"][0]["token_ids"] if ok else None
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            ok, ids, took, answer = False, None, 0.0, {"error": str(e)}
        with lock:
            if not ok:
                failures.append(str(answer.get("error")))
                return
            latencies.append(took)
            expected = cold(a.model, a.prompt_ids) if opts.check else None
            if opts.check and ids != expected:
                wrong.append(a.model)

    threads = []
    start = time.monotonic()
    for a in plan:
        delay = start + a.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(a, time.monotonic()), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(600)
    swaps = router.swap_log_s[swaps_before:]
    row = summarize(len(models), rate, latencies, len(failures), len(wrong), swaps,
                    opts.duration_s, awake=awake)  # fmt: skip
    _, raw = http_api.request(socket_path, "GET", "/metrics")
    return row, raw.decode()


def bench_traffic(cfg: Config, opts: TrafficOptions, *, scratch: Path | None = None,
                  log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:  # fmt: skip
    """Every (model count, awake, rate) row, the highest rate within the p95 target, how
    each model started, and the last run's metrics text."""
    vllm = opts.engine == "vllm"
    check_engine(opts.engine, "cuda" if vllm else "cpu")  # said before any model starts
    for model in opts.models:  # an input error (exit 2), not a failure of the run
        if not model.is_dir():
            raise ConfigError(f"--models {model}: no such directory; give a model directory "
                              "(config.json + model.safetensors)")  # fmt: skip
    _given_models(opts, max(opts.model_counts))  # (its refusal came after the smaller runs)
    rows: list[RateRow] = []
    report: dict[str, Any] = {"engine": opts.engine, "p95_target_s": opts.p95_target_s,
                              "duration_s": opts.duration_s,
                              "max_new_tokens": opts.max_new_tokens, "rows": [],
                              "starts": [], "metrics": ""}  # fmt: skip
    prompts = prompt_set(PROMPTS, seed=opts.seed) if vllm else None
    colds = ColdAnswers(cfg, opts.max_new_tokens, log=log)
    with tempfile.TemporaryDirectory(prefix="spswap-traffic-") as tmp:
        work = scratch or Path(tmp)
        for n in opts.model_counts:
            models = _models(opts, n, work)
            mopts = MultiOptions(models=tuple(models), socket_path=Path(tmp) / "s" / f"{n}.sock",
                                 state_dir=Path(tmp) / "state", engine=opts.engine,
                                 device="cuda" if vllm else "cpu",
                                 units_per_model=opts.units_per_model,
                                 max_awake=max(opts.awake) if opts.awake else None,
                                 vllm=opts.vllm, vllm_args=opts.vllm_args)  # fmt: skip
            if vllm and opts.check:
                assert prompts is not None
                colds.before_start(mopts, prompts)
            log(f"bench traffic: starting {n} models ({opts.engine})")
            router = start_router(cfg, mopts, log=log, on_started=colds.on_started(
                mopts.models, prompts) if vllm and opts.check else None)  # fmt: skip
            report["starts"] += [{"models": n, "model": name, **proc.hello}
                                 for name, proc in router.procs.items()]  # fmt: skip
            api = ApiServer(router, mopts.socket_path)
            try:
                api.start()
                for asked in opts.awake or (0,):
                    if asked:
                        router.set_awake(asked)
                    awake = router.placement.slots  # as --units allows, where not asked
                    if asked > awake:  # said, not silently lowered (a walk's surprise)
                        log(f"bench traffic: --awake {asked}: {awake} awake with {n} models "
                            "(at most one per model, and as --units allows)")  # fmt: skip
                    for rate in opts.rates(n):
                        plan = arrivals(rate, opts.duration_s, n, seed=opts.seed,
                                        prompts=prompts)  # fmt: skip
                        cold = colds.lookup(models) if vllm else reference_cold(
                            models, plan, opts.max_new_tokens, opts.check)  # fmt: skip
                        log(f"bench traffic: {n} models, {awake} awake, {rate:g}/min, "
                            f"{len(plan)} request{'' if len(plan) == 1 else 's'} over "
                            f"{opts.duration_s:g} s")  # fmt: skip
                        row, report["metrics"] = run_rate(mopts.socket_path, router, models,
                                                          plan, cold, rate=rate, opts=opts,
                                                          awake=awake)  # fmt: skip
                        rows.append(row)
                        log(f"bench traffic: {row.line()}")
                        _save(report, rows, opts)
            finally:
                api.stop()
                router.close()
    return _save(report, rows, opts)


def _save(report: dict[str, Any], rows: list[RateRow], opts: TrafficOptions) -> dict[str, Any]:
    """The report with its rows so far, written to ``opts.out`` when given."""
    report["rows"] = [r.to_json() for r in rows]
    report["highest_rate_within_target"] = highest_within(rows, opts.p95_target_s)
    if opts.out is not None:
        atomic_write_json(opts.out, report)
    return report
