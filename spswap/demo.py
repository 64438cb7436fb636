"""``spswap demo``: the whole swap path on small random models, on this machine.

Makes ``models`` reference checkpoints (safetensors) in a temporary folder, loads each
cold once to record its greedy answers, imports them into a pool under a temporary
root, then swaps them on one device for ``rounds`` rounds (wake from the pool, answer,
sleep) and checks that every answer equals the model's cold answer. Needs torch.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from spswap.engines.reference import ReferenceEngine, default_device, save_checkpoint
from spswap.engines.reference_model import preset as make_preset
from spswap.errors import ConfigError
from spswap.pool.store import Pool
from spswap.units import fmt_bytes, fmt_seconds

MAX_NEW_TOKENS = 8


@dataclass
class ModelResult:
    """One model's numbers in the demo."""

    name: str
    weight_bytes: int
    cold_load_s: float  # safetensors -> device, model built
    import_s: float  # safetensors -> pool (once per node in real use)
    pool_load_s: float  # first load from the pool (maps the entry, registers on CUDA)
    restore_s: list[float] = field(default_factory=list)  # each wake: pool -> device
    restore_gb_per_s: list[float] = field(default_factory=list)
    sleep_s: list[float] = field(default_factory=list)
    answers_equal: list[bool] = field(default_factory=list)  # per round

    @property
    def restore_median_s(self) -> float:
        return statistics.median(self.restore_s) if self.restore_s else float("nan")

    @property
    def all_equal(self) -> bool:
        return bool(self.answers_equal) and all(self.answers_equal)


@dataclass
class DemoResult:
    device: str
    preset: str
    rounds: int
    max_new_tokens: int
    models: list[ModelResult]
    seconds: float = 0.0

    @property
    def all_equal(self) -> bool:
        return all(m.all_equal for m in self.models)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["all_equal"] = self.all_equal
        for m, dm in zip(self.models, d["models"], strict=True):
            dm["restore_median_s"] = m.restore_median_s
            dm["all_equal"] = m.all_equal
        return d


def _scratch_parent(root: Path | None, needed_bytes: int = 0) -> Path | None:
    """``root``, else /dev/shm when it has room for ``needed_bytes`` (a container's may be
    64 MB), else None (the system temp directory)."""
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        return root
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    st = os.statvfs(shm)
    return shm if st.f_bavail * st.f_frsize >= needed_bytes else None


def _prompts(vocab_size: int) -> list[list[int]]:
    return [[1, 2, 3, 4], [vocab_size - 1, 17, 42, 5], [7] * 4]  # one length: one batch


def run_demo(
    *,
    models: int = 2,
    rounds: int = 3,
    preset: str = "small",
    device: str | None = None,
    root: Path | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    progress: Callable[[str], None] | None = None,
) -> DemoResult:
    """Run the demo; everything it writes lives under a temporary folder (in ``root``,
    default /dev/shm) that is removed at the end."""
    if models < 1 or rounds < 1:
        raise ConfigError("the demo needs at least one model and one round")
    say = progress or (lambda _msg: None)
    dev = str(torch.device(device)) if device else default_device()
    started = time.perf_counter()
    configs = [make_preset(preset, seed=i) for i in range(models)]
    # checkpoints + pool entries, with room to spare
    needed = 3 * sum(c.weight_bytes for c in configs)
    with tempfile.TemporaryDirectory(prefix="spswap-demo-",
                                     dir=_scratch_parent(root, needed)) as tmp:  # fmt: skip
        work = Path(tmp)
        names = [f"model-{i}" for i in range(models)]
        prompts = _prompts(configs[0].vocab_size)
        results: list[ModelResult] = []
        expected: list[list[list[int]]] = []
        for name, cfg in zip(names, configs, strict=True):
            say(f"writing {name} ({fmt_bytes(cfg.weight_bytes)}) as safetensors")
            ckpt = save_checkpoint(cfg, work / "checkpoints" / name)
            with ReferenceEngine(cfg, dev, name=name) as cold:
                cold_s = cold.load_from_checkpoint(ckpt)
                expected.append(cold.generate(prompts, max_new_tokens))
            results.append(ModelResult(name, cfg.weight_bytes, cold_s, 0.0, 0.0))

        pool = Pool(work / "pool")
        engines: list[ReferenceEngine] = []
        try:
            for res, cfg in zip(results, configs, strict=True):
                say(f"importing {res.name} into the pool")
                t0 = time.perf_counter()
                pool.import_checkpoint(work / "checkpoints" / res.name, name=res.name)
                res.import_s = time.perf_counter() - t0
                eng = ReferenceEngine(cfg, dev, name=res.name)
                engines.append(eng)
                t0 = time.perf_counter()
                eng.load_from_pool(pool, res.name)
                res.pool_load_s = time.perf_counter() - t0
                eng.sleep()  # one model on the device at a time
            for r in range(rounds):
                say(f"round {r + 1}/{rounds}")
                for res, eng, want in zip(results, engines, expected, strict=True):
                    report = eng.wake()
                    res.restore_s.append(report.seconds)
                    res.restore_gb_per_s.append(report.gb_per_s)
                    res.answers_equal.append(eng.generate(prompts, max_new_tokens) == want)
                    res.sleep_s.append(eng.sleep())
        finally:
            for eng in engines:
                eng.close()
    return DemoResult(
        device=dev, preset=preset, rounds=rounds, max_new_tokens=max_new_tokens,
        models=results, seconds=time.perf_counter() - started,
    )  # fmt: skip


def render_demo(result: DemoResult) -> Group:
    """The demo's table and verdict."""
    table = Table(
        title=f"spswap demo: {len(result.models)} models x {result.rounds} rounds "
        f"on {result.device} (preset {result.preset})",
    )
    for col, just in (
        ("model", "left"), ("weights", "right"), ("cold load", "right"),
        ("pool restore", "right"), ("GB/s", "right"), ("speed-up", "right"),
        ("answers", "center"),
    ):  # fmt: skip
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for m in result.models:
        rate = statistics.median(m.restore_gb_per_s) if m.restore_gb_per_s else float("nan")
        speedup = m.cold_load_s / m.restore_median_s if m.restore_median_s > 0 else float("inf")
        ok = sum(m.answers_equal)
        verdict = f"[green]{ok}/{len(m.answers_equal)} yes[/]" if m.all_equal else (
            f"[bold red]{ok}/{len(m.answers_equal)} NO[/]"
        )  # fmt: skip
        table.add_row(
            m.name, fmt_bytes(m.weight_bytes), fmt_seconds(m.cold_load_s),
            fmt_seconds(m.restore_median_s), f"{rate:.2f}", f"{speedup:.1f}x", verdict,
        )  # fmt: skip
    line = (
        Text("Every answer equals the model's cold greedy answer.", style="green")
        if result.all_equal
        else Text(
            "Some answers differ from the cold answers: the swap path is broken.", style="bold red"
        )  # fmt: skip
    )
    note = Text(
        "cold load = build the model + read model.safetensors (already in page cache); "
        "pool restore = wake (re-allocate + copy from the pool), median of rounds; "
        f"answers = rounds whose {result.max_new_tokens}-token greedy answers equal the cold "
        f"ones; total {fmt_seconds(result.seconds)}",
        style="dim",
    )
    return Group(table, line, note)
