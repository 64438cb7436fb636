"""``spswap serve --models --engine vllm`` preempted whole on a GPU (skipped with a reason
elsewhere; the same job with the reference engine under the CI's Slurm:
tests/slurm/test_multi_preempt.py).

Two Qwen2 0.5B-shaped vLLM models (other weights each) behind one router, both awake, run
as a job would run them with a real spswapd: run 0 answers, is stopped by USR1 and its
whole tree (the router and one engine process per model, each CUDA-checkpointed) dumped;
run 1 gets the tree back and every model answers as in run 0, no model started again.
image: CRIU ends the tree and restores it. kept: run 0 runs in a stand-in job cgroup, so
spswapd parks the tree, dumps it with --leave-running and keeps it frozen; run 1 thaws it
without CRIU. Models: SPSWAP_TEST_VLLM_MODELS (two directories), else made here by
scripts/gpu/make_models.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spswap.config import Config  # noqa: E402
from spswap.engines.vllm_engine import available  # noqa: E402
from spswap.multi import http_api  # noqa: E402
from spswap.serve.run_log import read_runs  # noqa: E402
from tests.helpers.gpu_criu import criu_ready, job_env, wait_logged, wait_saved  # noqa: E402
from tests.helpers.vllm_models import vllm_test_models  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="vLLM is not installed (put a vLLM kit on "
                       "PYTHONPATH: scripts/gpu/README.md)"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]  # fmt: skip
PROMPTS = [[11, 23, 5, 42], [1, 2, 3], [7] * 8]
MAX_NEW = 12


def _answers(sock: Path, models: list[Path], tag: str) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for m in models:
        out[m.name] = []
        for i, p in enumerate(PROMPTS):
            a = http_api.complete(sock, m.name, p, MAX_NEW, request_id=f"{tag}-{m.name}-{i}",
                                  timeout_s=120)  # fmt: skip
            assert a["status"] == 200, a
            out[m.name].append(list(a["choices"][0]["token_ids"]))
    return out


@pytest.mark.parametrize("fate", ["image", "kept"])
def test_a_preempted_vllm_multi_model_job_comes_back_whole(tmp_path: Path, fate: str) -> None:
    from spswap.checkpoint.proctree import process_tree_pids
    from spswap.daemon import lifecycle
    from spswap.daemon.client import Client
    from tests.checkpoint.test_cgroups import stand_in_job_cgroup
    from tests.helpers.leftovers import end_all_under

    reason = criu_ready()
    if reason:
        pytest.skip(reason)
    kept = fate == "kept"
    cgroups = contextlib.ExitStack()
    cgroup = cgroups.enter_context(stand_in_job_cgroup("spswap-gpu-multi")) if kept else None
    models = vllm_test_models(tmp_path, 2)
    root = Path(tempfile.mkdtemp(prefix="spsm-", dir="/tmp"))
    os.chmod(root, 0o755)
    cfg = Config.from_env({}, root=root)
    lifecycle.start(cfg, wait_s=15.0)
    job = "5252"
    state = root / "state"  # short: vLLM's IPC sockets fit under it
    sock = root / "api" / "api.sock"  # a new directory: serve makes it private (0700)

    def serve(restart: int) -> subprocess.Popen:
        env = job_env(root, job, restart)
        log = open(tmp_path / f"run{restart}.log", "w")
        return subprocess.Popen(
            [sys.executable, "-m", "spswap.cli", "serve", "--models", *map(str, models),
             "--engine", "vllm", "--state-dir", str(state), "--socket", str(sock),
             "--kv-cache-gib", "2", "--max-model-len", "512"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=(lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
            if cgroup is not None and restart == 0 else None,
        )  # fmt: skip

    def serving(restart: int) -> bool:
        proc = run0 if restart == 0 else run1
        log = (tmp_path / f"run{restart}.log").read_text()
        assert proc is None or proc.poll() is None, f"run {restart} ended: {log[-3000:]}"
        # a restored tree writes where it wrote before its dump (run 0's output, as a
        # requeued Slurm job's output file): its "serving" line is run 0's second one
        logs = "".join((tmp_path / f"run{r}.log").read_text() for r in range(restart + 1))
        return len(re.findall(r"serving 2 models on \S+ \(", logs)) > restart and sock.exists()

    def wait(what: str, check: Any, timeout_s: float) -> Any:
        return wait_logged(what, check, timeout_s, tmp_path)

    run0 = run1 = None
    try:
        Client(cfg).call("job.register", job_id=job, uid=0, user="root")
        run0 = serve(0)
        wait("run 0's models", lambda: serving(0), 600)
        before = _answers(sock, models, "r0")
        tree = process_tree_pids(run0.pid)
        t0 = time.monotonic()
        run0.send_signal(signal.SIGUSR1)
        status = wait_saved(cfg, job, tmp_path)
        dump_s = time.monotonic() - t0
        assert status["kept"] is kept, status
        if not kept:  # the restore needs the dumped pids free
            run0.wait(timeout=300)
            wait("the dumped tree's pids to be free",
                 lambda: not any(Path(f"/proc/{p}").exists() for p in tree), 60)  # fmt: skip
        run1 = serve(1)
        t1 = time.monotonic()
        wait("run 1's models", lambda: serving(1), 300)
        restore_s = time.monotonic() - t1
        after = _answers(sock, models, "r1")
        (back,) = [r for r in read_runs(state) if r.restart_count == 1]
        events = Client(cfg).call("events.tail", n=80)
        done = [e for e in events if e["kind"] == "restore.done"]
        print(json.dumps({"fate": fate, "stop_to_saved_s": round(dump_s, 2),
                          "run1_start_to_serving_s": round(restore_s, 2),
                          "image_bytes": status.get("size_bytes"),
                          "timings_s": status.get("timings_s"),
                          "restore": done[-1]["detail"] if done else None}))  # fmt: skip
        # run 1's own log, and what the restored tree wrote into run 0's after the dump
        log1 = (tmp_path / "run1.log").read_text() + (tmp_path / "run0.log").read_text().split(
            "stopped by SIGUSR1", 1)[-1]  # fmt: skip
        assert back.path.value == fate, (back, log1[-3000:])
        assert after == before, log1[-3000:]
        assert "up from the pool" not in log1 and "started cold" not in log1, log1[-3000:]
        run1.send_signal(signal.SIGTERM)
        assert run1.wait(timeout=300) == 0, log1[-3000:]
    finally:
        # after a failure nothing may keep the GPU for the later steps of the GPU run
        for proc in (run0, run1):
            if proc is not None and proc.poll() is None:
                proc.kill()
        lifecycle.stop(cfg, timeout_s=10.0)
        cgroups.close()  # ends whatever is left in the stand-in job cgroup
        end_all_under(root)  # a restored or kept tree is nobody's child here
        shutil.rmtree(root, ignore_errors=True)
