"""``spswap serve --engine vllm`` with the real vLLM OpenAI server on a GPU (skipped with a
reason elsewhere; CPU tests of the same runs: tests/serve/test_vllm_serve.py).

Two runs of a job on a Qwen2 0.5B-shaped model with real safetensors: the first starts
from the checkpoint and exports the weights to the pool, the second starts without disk
from the pool; both answer the same token-id prompts through the OpenAI API on the
private socket with the same greedy tokens, and so does the second after a level-2 sleep
and a wake from the pool driven through the server's development endpoints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spswap.config import Config  # noqa: E402
from spswap.engines.vllm_engine import VllmSettings, available  # noqa: E402
from spswap.serve.vllm_api import uds_request  # noqa: E402
from spswap.serve.vllm_run import ENDPOINT_FILE, VllmServe, VllmServeOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="vLLM is not installed (put a vLLM kit on "
                       "PYTHONPATH: scripts/gpu/README)"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]  # fmt: skip
PROMPTS = [[(7 * i + 13 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate((8, 17, 33))]


def _model(tmp_path: Path) -> Path:
    given = os.environ.get("SPSWAP_TEST_VLLM_MODEL")
    if given:
        return Path(given)
    spec = importlib.util.spec_from_file_location("mm", ROOT / "scripts/gpu/make_models.py")
    assert spec and spec.loader
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    return Path(mm.write_model(tmp_path / "models", "0.5b", seed=0, shard_bytes=4 << 30)["dir"])


def _answers(uds: Path, model: Path) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        status, data = uds_request(uds, "POST", "/v1/completions", {
            "model": str(model), "prompt": p, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }, timeout_s=120)  # fmt: skip
        assert status == 200, data
        out.append(list(data["choices"][0]["token_ids"]))
    return out


def _run(cfg: Config, model: Path, state: Path, during: Any = None) -> dict[str, Any]:
    opts = VllmServeOptions(model=model, state_dir=state, start_timeout_s=400,
                            settings=VllmSettings(gpu_memory_utilization=0.3,
                                                  max_model_len=512))  # fmt: skip
    run = VllmServe(cfg, opts, log=print)
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.update(result=run.run()))
    th.start()
    deadline = time.monotonic() + 420
    while not (state / ENDPOINT_FILE).exists():
        log = state / "vllm.log"
        assert th.is_alive() and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    uds = Path(json.loads((state / ENDPOINT_FILE).read_text())["uds"])
    out["answers"] = _answers(uds, model)
    if during is not None:
        out["during"] = during(run, uds)
    run.handle_signal(signal.SIGTERM)
    th.join(120)
    assert "result" in out, (state / "vllm.log").read_text()[-3000:]
    return out


def test_two_runs_of_a_job_and_a_swap_through_the_server(tmp_path: Path) -> None:
    model = _model(tmp_path)
    cfg = Config.from_env({}, root=Path(os.environ.get("SPSWAP_TEST_ROOT", tmp_path / "root")))
    first = _run(cfg, model, tmp_path / "s1")
    assert first["result"]["from"] == "checkpoint"

    def swap(run: VllmServe, uds: Path) -> dict[str, Any]:
        sleep_s = run.server.sleep()
        copy = run.server.wake()
        return {"sleep_s": sleep_s, "copy": copy, "answers": _answers(uds, model),
                "times": vars(run.server.times)}  # fmt: skip

    second = _run(cfg, model, tmp_path / "s2", during=swap)
    print(json.dumps({"first": first["result"], "second": second["result"],
                      "swap": {k: v for k, v in second["during"].items() if k != "answers"}},
                     default=str))  # fmt: skip
    assert second["result"]["from"] == "pool"
    assert second["result"]["digest"] == first["result"]["digest"]
    assert second["answers"] == first["answers"]
    assert second["during"]["answers"] == first["answers"]
    assert second["during"]["copy"]["size_bytes"] > 0
