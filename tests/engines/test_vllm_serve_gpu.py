"""``spswap serve --engine vllm`` with the real vLLM OpenAI server on a GPU (skipped with a
reason elsewhere; CPU tests of the same runs: tests/serve/test_vllm_serve.py).

Two runs of a job on a Qwen2 0.5B-shaped model with real safetensors: the first starts
from the checkpoint and exports the weights to the pool, the second starts without disk
from the pool; both answer the same token-id prompts through the OpenAI API on the
private socket with the same greedy tokens, and so does the second after a level-2 sleep
and a wake from the pool driven through the server's development endpoints.
"""

from __future__ import annotations

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
from spswap.serve.lifecycle import ServeRun  # noqa: E402
from spswap.serve.run_log import RunPath  # noqa: E402
from spswap.serve.vllm_api import uds_request  # noqa: E402
from spswap.serve.vllm_run import ENDPOINT_FILE, VllmBackend, VllmServeOptions, vllm_run  # noqa: E402
from tests.helpers.gpu_criu import criu_ready, job_env, wait_logged, wait_saved  # noqa: E402
from tests.helpers.vllm_models import vllm_test_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="vLLM is not installed (put a vLLM kit on "
                       "PYTHONPATH: scripts/gpu/README)"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]  # fmt: skip
PROMPTS = [[(7 * i + 13 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate((8, 17, 33))]


def _answers(uds: Path, model: Path, times_s: list[float] | None = None) -> list[list[int]]:
    """The greedy answers to PROMPTS; ``times_s`` gets each request's seconds (the first
    one after a restore against the ones before: what a restore leaves slow)."""
    out = []
    for p in PROMPTS:
        t0 = time.monotonic()
        status, data = uds_request(uds, "POST", "/v1/completions", {
            "model": str(model), "prompt": p, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }, timeout_s=120)  # fmt: skip
        assert status == 200, data
        out.append(list(data["choices"][0]["token_ids"]))
        if times_s is not None:
            times_s.append(round(time.monotonic() - t0, 4))
    return out


def _events(cfg: Config, kind: str) -> list[dict[str, Any]]:
    """spswapd's recent events of ``kind``."""
    from spswap.daemon.client import Client

    return [e for e in Client(cfg).call("events.tail", n=200) if e["kind"] == kind]


def _run(cfg: Config, model: Path, state: Path, during: Any = None) -> dict[str, Any]:
    opts = VllmServeOptions(model=model, state_dir=state, start_timeout_s=400,
                            settings=VllmSettings(gpu_memory_utilization=0.3,
                                                  max_model_len=512))  # fmt: skip
    run = vllm_run(cfg, opts, log=print)
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
    model = vllm_test_model(tmp_path)
    cfg = Config.from_env({}, root=Path(os.environ.get("SPSWAP_TEST_ROOT", tmp_path / "root")))
    first = _run(cfg, model, tmp_path / "s1")
    assert first["result"].path is RunPath.COLD

    def swap(run: ServeRun[VllmBackend], uds: Path) -> dict[str, Any]:
        sleep_s = run.backend.server.sleep()
        copy = run.backend.server.wake()
        return {"sleep_s": sleep_s, "copy": copy, "answers": _answers(uds, model),
                "times": {"sleep_s": run.backend.server.sleep_s,
                          **vars(run.backend.server.last_wake)}}  # fmt: skip

    second = _run(cfg, model, tmp_path / "s2", during=swap)
    print(json.dumps({"first": first["result"].to_json(),
                      "second": second["result"].to_json(),
                      "swap": {k: v for k, v in second["during"].items() if k != "answers"}},
                     default=str))  # fmt: skip
    assert second["result"].path is RunPath.POOL
    assert second["result"].digest == first["result"].digest
    assert second["answers"] == first["answers"]
    assert second["during"]["answers"] == first["answers"]
    assert second["during"]["copy"]["size_bytes"] > 0
    # eager, with room in its slot: each run packed its weights, and the swap copied into them
    assert first["result"].pack["packed"] and second["result"].pack["packed"]
    # the room was judged beside what the engine holds (its weights at least)
    room = first["result"].pack["room"]
    print("pack room:", room)
    assert room["held_bytes"] >= first["result"].pack["size_bytes"], room
    assert second["result"].pack["layout_checked"] and second["during"]["copy"]["packed"]


@pytest.mark.parametrize("fate", ["image", "kept", "on_gpu", "dies", "damaged"])
def test_the_real_server_is_dumped_and_restored_into_the_next_run(
    tmp_path: Path, fate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spswap serve --engine vllm` as a job would run it, twice, with a real spswapd: run 0
    is preempted (USR1) and dumped with the whole server tree (API server, engine core,
    CUDA checkpoint); run 1 has it restored and answers like run 0. image: CRIU ends the
    tree and restores it. kept: run 0 runs in a stand-in job cgroup, so spswapd parks it,
    dumps it with --leave-running and freezes it; run 1 gets it back without CRIU (its
    GPU state woken early, at run 1's start, where the machine has one GPU). on_gpu: kept,
    with spswapd's SPSWAP_KEEP_ON_GPU=1: its GPU state back on the GPU right after the
    dump, so run 1 only unlocks it; after run 1's own dump, another job's reservation on
    the GPU moves that state back to host memory (the tree stays kept). dies:
    restored from its image, then the restored `spswap serve` is killed, its server left
    running with its GPU memory: run 1 ends that server, starts its own from the pool and
    answers like run 0 (before issue 14 the old server stayed up beside the new one).
    damaged: a whole tensor of the pool entry overwritten after the dump (the restored
    server maps the entry): the restored instance answers its check prompt otherwise than
    before its checkpoint and does not serve; run 1 has the entry checked (found damaged,
    removed: said with the tensor), starts its own server from the model's files, exports
    it again and answers like run 0."""
    import contextlib
    import shutil
    import subprocess
    import sys
    import tempfile

    from spswap.checkpoint.gpu_map import uuids_by_minor
    from spswap.daemon import lifecycle
    from spswap.daemon.client import Client
    from tests.checkpoint.test_cgroups import stand_in_job_cgroup
    from tests.helpers.leftovers import end_all_under

    reason = criu_ready()
    if reason:
        pytest.skip(reason)
    kept = fate in ("kept", "on_gpu")
    if fate == "on_gpu":  # (spswapd takes its caller's SPSWAP_* settings)
        monkeypatch.setenv("SPSWAP_KEEP_ON_GPU", "1")
    cgroups = contextlib.ExitStack()
    cgroup = cgroups.enter_context(stand_in_job_cgroup("spswap-gpu-job")) if kept else None
    model = vllm_test_model(tmp_path)
    root = Path(tempfile.mkdtemp(prefix="spsg-", dir="/tmp"))
    os.chmod(root, 0o755)
    cfg = Config.from_env({}, root=root)
    lifecycle.start(cfg, wait_s=15.0)
    job = "5151"
    state = root / "state"  # short: vLLM's IPC sockets fit under it (VLLM_RPC_BASE_PATH)

    def serve(restart: int) -> subprocess.Popen:
        env = job_env(root, job, restart)
        log = open(tmp_path / f"run{restart}.log", "w")
        return subprocess.Popen(
            [sys.executable, "-m", "spswap.cli", "serve", str(model), "--engine", "vllm",
             "--state-dir", str(state), "--gpu-memory-utilization", "0.3",
             "--max-model-len", "512", "--json"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # (on_gpu: run 1 too, so that its own dump parks the tree and keeps it)
            preexec_fn=(lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
            if cgroup is not None and (restart == 0 or fate == "on_gpu") else None,
        )  # fmt: skip

    def endpoint(pid: int | None = None) -> dict[str, Any] | None:
        path = state / ENDPOINT_FILE
        if not path.exists():
            return None
        ep: dict[str, Any] = json.loads(path.read_text())
        return ep if pid is None or ep["pid"] == pid else None

    def wait(what: str, check: Any, timeout_s: float) -> Any:
        return wait_logged(what, check, timeout_s, tmp_path)

    run0 = run1 = None
    try:
        # kept: registered with its GPU, as the prolog does under Slurm, so that run 1's
        # start (`job.starting`) wakes the kept tree's GPU state early, as a site's runs do
        minors = sorted(uuids_by_minor())
        gpus = minors if kept and len(minors) == 1 else []
        Client(cfg).call("job.register", job_id=job, uid=0, user="root", gpus=gpus)
        run0 = serve(0)
        ep0 = wait("run 0's server", endpoint, 420)
        assert "'s weights packed into one allocation" in (tmp_path / "run0.log").read_text()
        ipc = [p.name for p in (state / "sock").iterdir() if p.name != "vllm.sock"]
        assert ipc, "vLLM's IPC sockets belong in the private socket directory"
        before_s: list[float] = []
        before = _answers(Path(ep0["uds"]), model, before_s)
        t0 = time.monotonic()
        run0.send_signal(signal.SIGUSR1)
        if not kept:  # a kept run 0 stays, frozen, with its tree
            run0.wait(timeout=300)
        status = wait_saved(cfg, job, tmp_path)
        dump_s = time.monotonic() - t0
        if fate == "on_gpu":  # its GPU state back on the GPU after the dump, before run 1
            wait("the tree's GPU state kept on the GPU", lambda: _events(cfg, "kept.on_gpu"), 60)
        # what the image holds, as an admin sees it: each process's largest areas
        shown = subprocess.run(
            [sys.executable, "-m", "spswap.cli", "images", "show", job, "--json",
             "--root", str(root)], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        largest: Any = shown.stdout[-500:] + shown.stderr[-500:]  # what went wrong
        if shown.returncode == 0:
            largest = {p["pid"]: p.get("largest") for p in json.loads(shown.stdout)["processes"]}
        assert status["kept"] is kept, status
        if not kept:  # the restore needs the dumped pids free (the server's too: init reaps it)
            wait("the dumped server's pid to be free",
                 lambda: not Path(f"/proc/{ep0['server_pid']}").exists(), 60)  # fmt: skip
        if fate == "damaged":
            from spswap.pool.store import Pool
            from tests.helpers.damage import reverse_largest_tensor

            pool = Pool.from_config(cfg)
            (entry,) = pool.entries()
            tensor = reverse_largest_tensor(pool, entry.manifest)
        t1_wall = time.time()  # endpoint.json's mtime ends the restore: exact, not polled
        run1 = serve(1)
        if fate == "damaged":
            ep1 = wait("run 1's own server", lambda: (
                e if (e := endpoint()) and e["pid"] == run1.pid else None), 420)  # fmt: skip
        else:
            ep1 = wait("the restored server", lambda: endpoint(ep0["pid"]), 300)
        restore_s = (state / ENDPOINT_FILE).stat().st_mtime - t1_wall
        # where run 1's time went, from t1_wall: its steps (runs.jsonl's marks: the
        # command's start, the fork, the restore's answer) and the restored instance's
        # wake and check (its line in run 0's log)
        runs = [json.loads(line) for line in (state / "runs.jsonl").read_text().splitlines()
                if line.strip()]  # fmt: skip
        run1_line = [r for r in runs if r.get("restart_count") == 1][-1:]
        run1_marks = None
        if run1_line:  # marks_s count from the run's started_s
            r1 = run1_line[0]
            at = {
                "started": r1["started_s"],
                "serving": r1["serving_s"],
                **{k: r1["started_s"] + v for k, v in (r1.get("marks_s") or {}).items()},
            }
            run1_marks = {k: round(v - t1_wall, 4)
                          for k, v in sorted(at.items(), key=lambda kv: kv[1])}  # fmt: skip
        woken = [line for line in (tmp_path / "run0.log").read_text().splitlines()
                 if "into run 1; weights back" in line]  # fmt: skip
        if fate == "damaged":
            log0, log1 = ((tmp_path / f"run{r}.log").read_text() for r in (0, 1))
            # the restored tree wrote into run 0's output (a requeued job's output file)
            assert "the restored instance does not serve: it answered the check prompt" \
                in log0, log0[-3000:]  # fmt: skip
            assert f"tensor {tensor.name!r}" in log1 and "removed from the pool" in log1, \
                log1[-3000:]  # fmt: skip
            assert "starts from the model's files and exports it again" in log1, log1[-3000:]
            assert ep1["server_pid"] != ep0["server_pid"]
        if fate == "dies":
            os.kill(ep0["pid"], signal.SIGKILL)  # the instance dies, its server lives on
            ep1 = wait("run 1's own server", lambda: (
                e if (e := endpoint()) and e["pid"] == run1.pid else None), 420)  # fmt: skip
            assert (
                not Path(f"/proc/{ep0['server_pid']}").exists()
                or Path(f"/proc/{ep0['server_pid']}/stat").read_text().split(") ")[1][0] == "Z"
            )
            assert ep1["server_pid"] != ep0["server_pid"]
        after_s: list[float] = []
        after = _answers(Path(ep1["uds"]), model, after_s)
        # restored: forwarded, the restored run parks and is dumped (the proxy exits 0);
        # dies: run 1 serves itself, parks and is dumped (CRIU ends it)
        run1.send_signal(signal.SIGTERM)
        assert run1.wait(timeout=300) == (-signal.SIGKILL if fate in ("dies", "damaged") else 0), \
            (tmp_path / "run1.log").read_text()[-3000:]  # fmt: skip
        events = Client(cfg).call("events.tail", n=60)
        done = [e for e in events if e["kind"] == "restore.done"]
        saved = [e["detail"] for e in events if e["kind"] == "checkpoint.layout"]
        # spswapd's side of run 1, on the same clock: its start, the early wake, the restore
        daemon_s = {e["kind"]: round(e["ts"] - t1_wall, 4) for e in events if e["ts"] >= t1_wall
                    and e["kind"].startswith(("job.", "restore."))}  # fmt: skip
        layout = saved[0]["layout"] if saved else {}
        print(json.dumps({"kept": kept, "stop_to_saved_s": dump_s,
                          "image_bytes_by_kind": layout.get("bytes_by_kind"),
                          "image_processes": [(p["pid"], p["bytes_by_kind"])
                                              for p in layout.get("processes", [])],
                          "run1_start_to_serving_s": restore_s,
                          "run1_steps_s": run1_marks, "run1_daemon_s": daemon_s,
                          "restored_line": woken[-1:],
                          "image_largest_areas": largest,
                          "answers_s": {"before": before_s, "after": after_s},
                          "image_bytes": status.get("size_bytes"),
                          "timings_s": status.get("timings_s"),
                          "restore": done[0]["detail"] if done else None}))  # fmt: skip
        assert after == before
        assert done and done[0]["detail"]["kept"] is kept, events
        if fate == "on_gpu":  # on the GPU since the dump: run 1 only unlocked it
            assert "early_cuda_restore" in done[0]["detail"]["timings_s"], done
            assert not any(e["kind"] == "restore.woken_early" for e in events), events
            # run 1's dump kept it on the GPU again; another job's reservation there moves its
            # GPU state back to host memory (a CUDA checkpoint of the restored, locked tree)
            wait("the tree kept on the GPU again", lambda: len(_events(cfg, "kept.on_gpu")) > 1,
                 60)  # fmt: skip
            Client(cfg).call("job.register", job_id="5152", uid=0, user="root", gpus=gpus)
            Client(cfg).call("slots.reserve", model="other", units=4, job_id="5152",
                             allowed_gpus=gpus, timeout_s=30)  # fmt: skip
            moved = wait("the tree moved off the GPU for job 5152's reservation", lambda: [
                e for e in _events(cfg, "kept.off_gpu") if "job 5152 reserved" in
                e["detail"]["reason"]], 30)  # fmt: skip
            print(json.dumps({"on_gpu_moved_off": moved[0]["detail"]}))
            assert not _events(cfg, "kept.ended"), "kept, as after its dump"
        elif gpus:  # woken at run 1's start: the run's restore only unlocked it
            assert any(e["kind"] == "restore.woken_early" for e in events), events
        if fate == "dies":
            log1 = (tmp_path / "run1.log").read_text()
            assert f"ended what it left running (pid {ep0['server_pid']}" in log1, log1[-3000:]
        elif fate != "damaged":
            assert ep1["server_pid"] == ep0["server_pid"]
    finally:
        # after a failure nothing may keep the GPU for the later steps of the GPU run
        for proc in (run0, run1):
            if proc is not None and proc.poll() is None:
                proc.kill()
        ep = endpoint()
        if ep and ep.get("server_pid") and Path(f"/proc/{ep['server_pid']}").exists():
            os.kill(int(ep["server_pid"]), signal.SIGKILL)
        lifecycle.stop(cfg, timeout_s=10.0)
        cgroups.close()  # ends whatever is left in the stand-in job cgroup
        # a restored or kept server is nobody's child here (its own session, maybe frozen)
        end_all_under(root)
        shutil.rmtree(root, ignore_errors=True)
