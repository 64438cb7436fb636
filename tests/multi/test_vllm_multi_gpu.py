"""``spswap serve --models --engine vllm`` on a GPU (skipped with a reason elsewhere): two
small Qwen2-shaped vLLM models behind one router, one awake at a time. The first router
starts both cold from their files (exporting them to the pool) and asks each its cold
answers right after its start; requests then swap them back and forth, and every answer
must equal the cold one. A second router starts both from the pool (no disk) and answers
the same. Models: SPSWAP_TEST_VLLM_MODELS (two directories), else two 0.5B ones made
here by scripts/gpu/make_models.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spswap.config import Config  # noqa: E402
from spswap.engines.vllm_engine import available  # noqa: E402
from spswap.multi.engine_settings import model_settings  # noqa: E402
from spswap.multi.serve import MultiOptions, start_router  # noqa: E402
from tests.helpers.vllm_models import vllm_test_models  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not available(), reason="vLLM is not installed (put a vLLM kit on "
                       "PYTHONPATH: scripts/gpu/run_vllm.sh)"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[11, 23, 5, 42], [1, 2, 3], [7] * 8]
MAX_NEW = 16


def test_two_vllm_models_swap_through_the_router_with_cold_answers(tmp_path: Path) -> None:
    models = vllm_test_models(tmp_path, 2)
    cfg = Config.from_env({}, root=Path(os.environ.get("SPSWAP_TEST_ROOT", tmp_path / "root")))
    opts = MultiOptions(models=tuple(models), socket_path=tmp_path / "s.sock",
                        state_dir=tmp_path / "state", engine="vllm", device="cuda",
                        units_per_model=2, max_awake=1,
                        vllm=model_settings(2, kv_cache_gib=1, max_model_len=512))  # fmt: skip
    cold: dict[str, list[list[int]]] = {}

    def started(name: str, proc: Any) -> None:
        if proc.hello.get("from") == "checkpoint":
            cold[name] = [proc.call("generate", prompt_ids=p, max_new_tokens=MAX_NEW)["token_ids"]
                          for p in PROMPTS]  # fmt: skip

    lines: list[str] = []
    a, b = (m.name for m in models)
    router = start_router(cfg, opts, log=lines.append, on_started=started)
    try:
        starts = {n: p.hello["from"] for n, p in router.procs.items()}
        if set(starts.values()) != {"checkpoint"}:
            pytest.skip(f"the pool at {cfg.root} holds these models already ({starts}): "
                        "give a fresh SPSWAP_TEST_ROOT")  # fmt: skip
        assert set(cold) == {a, b} and cold[a] != cold[b], cold  # the seeds answer apart
        # eager, room in each model's units: its weights packed into one allocation once up
        # (that packed weights answer as the loaded ones: tests/engines/test_vllm.py)
        packs = {n: p.hello.get("pack") for n, p in router.procs.items()}
        assert all(pk and pk["packed"] and pk["layout_checked"] for pk in packs.values()), packs
        assert [router.placement.states[n].value for n in (a, b)] == ["awake", "asleep"]
        for name in (b, a, b, a):
            got = [router.submit(name, p, MAX_NEW).result(300)["token_ids"] for p in PROMPTS]
            assert got == cold[name], (name, lines)
        assert len(router.swap_log_s) == 4, router.swap_log_s
        swaps = list(router.swap_log_s)
    finally:
        router.close()

    again = start_router(cfg, opts, log=lines.append)  # both from the pool now: no disk
    try:
        assert {p.hello["from"] for p in again.procs.values()} == {"pool"}, lines
        assert all(p.hello["pack"]["packed"] for p in again.procs.values()), lines
        for name in (b, a):
            got = [again.submit(name, p, MAX_NEW).result(300)["token_ids"] for p in PROMPTS]
            assert got == cold[name], (name, lines)
    finally:
        again.close()
    print(f"vllm multi: swaps {[round(s, 3) for s in swaps]} s; " + "; ".join(lines))
