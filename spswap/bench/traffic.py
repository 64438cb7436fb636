"""``spswap bench traffic``: Poisson traffic against a multi-model job's endpoint.

For each model count, the router serves that many models (reference models made here,
seeds differing, unless model directories are given) on one device; for each rate,
requests arrive as a Poisson process for ``duration_s``, each sent on its own thread to
the job's socket as a client would. Latency is arrival to answer; swaps are the router's
own (demand swaps during the rate's run). With ``check``, every answer is compared with
the model's cold answer (read from the checkpoint by a fresh engine).
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.bench.traffic_plan import RateRow, arrivals, highest_within, summarize
from spswap.config import Config
from spswap.errors import ConfigError
from spswap.multi import http_api
from spswap.multi.http_api import ApiServer
from spswap.multi.serve import MultiOptions, start_router


@dataclass(frozen=True)
class TrafficOptions:
    model_counts: tuple[int, ...] = (2, 4, 6)
    rates_per_min: tuple[float, ...] = (30.0, 60.0)
    duration_s: float = 30.0
    max_new_tokens: int = 8
    p95_target_s: float = 2.0
    units_per_model: int = 2
    preset: str = "tiny"
    models: tuple[Path, ...] = ()  # given model directories (the first N are used)
    check: bool = True
    seed: int = 0


def _models(opts: TrafficOptions, n: int, scratch: Path) -> list[Path]:
    if opts.models:
        if len(opts.models) < n:
            raise ConfigError(f"--models gives {len(opts.models)} directories but a run "
                              f"with {n} models was asked (--model-counts)")  # fmt: skip
        return list(opts.models[:n])
    from spswap.engines.reference import save_checkpoint
    from spswap.engines.reference_model import preset

    return [save_checkpoint(preset(opts.preset, seed=1000 + i), scratch / f"model{i}")
            if not (scratch / f"model{i}").exists() else scratch / f"model{i}"
            for i in range(n)]  # fmt: skip


def _cold(models: list[Path], prompts: dict[int, set[tuple[int, ...]]],
          max_new: int) -> dict[tuple[int, tuple[int, ...]], list[int]]:  # fmt: skip
    from spswap.engines.reference import ReferenceEngine, load_config

    out = {}
    for i, model in enumerate(models):
        eng = ReferenceEngine(load_config(model), "cpu")
        eng.load_from_checkpoint(model)
        try:
            for p in prompts.get(i, ()):
                out[(i, p)] = eng.generate([list(p)], max_new)[0]
        finally:
            eng.close()
    return out


def run_rate(socket_path: Path, router: Any, models: list[Path], rate: float,
             opts: TrafficOptions) -> tuple[RateRow, str]:  # fmt: skip
    """One rate's run; the row and the /metrics text read at its end."""
    plan = arrivals(rate, opts.duration_s, len(models), seed=opts.seed)
    wanted: dict[int, set[tuple[int, ...]]] = {}
    for a in plan:
        wanted.setdefault(a.model, set()).add(a.prompt_ids)
    cold = _cold(models, wanted, opts.max_new_tokens) if opts.check else {}
    latencies: list[float] = []
    failures: list[str] = []
    wrong: list[int] = []
    lock = threading.Lock()
    swaps_before = len(router.swap_log_s)

    def one(a: Any, sent_s: float) -> None:
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
            if opts.check and ids != cold[(a.model, a.prompt_ids)]:
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
                    opts.duration_s)  # fmt: skip
    _, raw = http_api.request(socket_path, "GET", "/metrics")
    return row, raw.decode()


def bench_traffic(cfg: Config, opts: TrafficOptions, *,
                  scratch: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Every (model count, rate) row, the highest rate within the p95 target, and the
    last run's metrics text."""
    rows: list[RateRow] = []
    metrics = ""
    with tempfile.TemporaryDirectory(prefix="spswap-traffic-") as tmp:
        work = scratch or Path(tmp)
        for n in opts.model_counts:
            models = _models(opts, n, work)
            mopts = MultiOptions(models=tuple(models), socket_path=Path(tmp) / "s" / f"{n}.sock",
                                 state_dir=Path(tmp) / "state",
                                 units_per_model=opts.units_per_model)  # fmt: skip
            router = start_router(cfg, mopts, log=lambda _m: None)
            api = ApiServer(router, mopts.socket_path)
            try:
                api.start()
                for rate in opts.rates_per_min:
                    row, metrics = run_rate(mopts.socket_path, router, models, rate, opts)
                    rows.append(row)
            finally:
                api.stop()
                router.close()
    best = highest_within(rows, opts.p95_target_s)
    return {"rows": [r.to_json() for r in rows], "p95_target_s": opts.p95_target_s,
            "duration_s": opts.duration_s,
            "highest_rate_within_target": {str(k): v for k, v in best.items()},
            "metrics": metrics}  # fmt: skip
