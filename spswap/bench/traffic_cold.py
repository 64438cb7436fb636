"""``spswap bench traffic``'s reference answers: each model's cold answer (greedy, from
its own files) to every prompt the traffic asks it, which every answer must equal."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spswap.access import PoolAccess
from spswap.bench.traffic_plan import Arrival
from spswap.config import Config
from spswap.multi.procs import ModelProc, ModelSpec
from spswap.multi.serve import MultiOptions
from spswap.multi.startup import Started, close_timeout_s
from spswap.multi.vllm_start import vllm_specs

Cold = Callable[[int, tuple[int, ...]], "list[int] | None"]


def reference_cold(models: list[Path], plan: list[Arrival], max_new: int,
                   check: bool) -> Cold:  # fmt: skip
    """The reference engine's cold answers to ``plan``'s prompts: a fresh engine per
    model reads its checkpoint (the CPU is not shared with a device's memory)."""
    if not check:
        return lambda _m, _p: None
    from spswap.engines.reference import ReferenceEngine, load_config

    wanted: dict[int, set[tuple[int, ...]]] = {}
    for a in plan:
        wanted.setdefault(a.model, set()).add(a.prompt_ids)
    out: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, model in enumerate(models):
        eng = ReferenceEngine(load_config(model), "cpu")
        eng.load_from_checkpoint(model)
        try:
            for p in wanted.get(i, ()):
                out[(i, p)] = eng.generate([list(p)], max_new)[0]
        finally:
            eng.close()
    return lambda m, p: out.get((m, p))


class ColdAnswers:
    """vLLM models' cold answers, made once per model for the run's fixed prompts: asked
    right after the model's first start from its files (in the router, before anything
    put it to sleep), or, for a model already in the pool, of an engine of its own
    started cold before the router's (the device is free then)."""

    def __init__(self, cfg: Config, max_new_tokens: int,
                 log: Callable[[str], None] = lambda _m: None) -> None:  # fmt: skip
        self.cfg, self.max_new_tokens, self.log = cfg, max_new_tokens, log
        self.answers: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def has(self, model: Path) -> bool:
        return any(k[0] == str(model) for k in self.answers)

    def _ask(self, model: Path, proc: ModelProc, prompts: list[tuple[int, ...]]) -> None:
        for p in prompts:
            out = proc.call("generate", prompt_ids=list(p), max_new_tokens=self.max_new_tokens)
            self.answers[(str(model), p)] = list(out["token_ids"])

    def before_start(self, opts: MultiOptions, prompts: list[tuple[int, ...]]) -> None:
        """A cold engine of its own for each model the router would start from the pool
        and whose cold answers are not known yet."""
        specs, _ = vllm_specs(PoolAccess(self.cfg), opts.models, opts.vllm_settings())
        for spec in specs:
            if not spec.digest or self.has(spec.path):
                continue  # its router start is cold: on_started asks it
            self.log(f"bench traffic: {spec.name} is in the pool already: its cold answers "
                     "from an engine of its own, started from its files")  # fmt: skip
            proc = ModelProc(ModelSpec(spec.name, spec.path, ""), engine=opts.engine,
                             device=opts.device, root=self.cfg.root,
                             settings=opts.vllm_settings().to_json(),
                             vllm_args=opts.vllm_args, cold=True)  # fmt: skip
            try:
                proc.wait_ready()
                self._ask(spec.path, proc, prompts)
            finally:
                proc.close(close_timeout_s(opts.engine))

    def on_started(self, models: tuple[Path, ...],
                   prompts: list[tuple[int, ...]] | None) -> Started:  # fmt: skip
        """The router's hook: a model up from its files answers the prompts now."""
        by_name = {m.name: m for m in models}

        def started(name: str, proc: ModelProc) -> None:
            model = by_name[name]
            if prompts and not self.has(model) and proc.hello.get("from") == "checkpoint":
                self._ask(model, proc, prompts)

        return started

    def lookup(self, models: list[Path]) -> Cold:
        """``cold(model index, prompt)`` over the answers made so far."""
        return lambda m, p: self.answers.get((str(models[m]), p))
