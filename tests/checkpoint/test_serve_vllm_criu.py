"""The checkpoint path of ``spswap serve --engine vllm``, end to end on CPU: the real CRIU,
a real spswapd, and a stand-in for vLLM's OpenAI server (tests/serve/vllm_standin.py,
running spswap's real worker extension) as the child the dump must carry along.

Run 0 starts the server from the checkpoint (exporting the weights), answers through the
TCP front, and on USR1 sleeps the server and is dumped by spswapd together with the
server process; run 1 (restart count 1) has spswapd restore the whole tree and stands in
for it; the restored process wakes the server (weights from the pool), reopens the front
and answers as before. The real vLLM server's tree (engine core, CUDA) was dumped the same
way by scripts/gpu/vllm_skeleton.py on the H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon.client import Client

pytest.importorskip("torch")
from tests.serve.vllm_standin import fake_vllm_metadata, save_model  # noqa: E402

from .test_serve_criu import _wait  # noqa: E402

pytestmark = [pytest.mark.criu, pytest.mark.slow]
JOB = "4343"
STANDIN = Path(__file__).resolve().parents[1] / "serve" / "vllm_standin.py"


def _serve(cfg: Config, tmp: Path, model: Path, restart: int, log: str,
           cgroup: Path | None = None) -> subprocess.Popen:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    site = fake_vllm_metadata(tmp / "site")
    env.update(SPSWAP_ROOT=str(cfg.root), SLURM_JOB_ID=JOB, SLURM_RESTART_COUNT=str(restart),
               PYTHONPATH=os.pathsep.join([str(site), str(STANDIN.parents[2])]),
               STANDIN_SEMAPHORE="1")  # fmt: skip
    out = open(tmp / log, "w")  # a regular file, as a Slurm job's output is
    return subprocess.Popen(
        [sys.executable, "-m", "spswap.cli", "serve", str(model), "--engine", "vllm",
         "--state-dir", str(tmp / "state"), "--port", "0", "--json", "--kv-cache-gib", "0.5",
         "--launcher", f"{sys.executable} {STANDIN}"],
        env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        preexec_fn=(lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
        if cgroup else None,
    )  # fmt: skip


def _endpoint(tmp: Path) -> dict | None:
    path = tmp / "state" / "endpoint.json"
    return json.loads(path.read_text()) if path.exists() else None


def _complete(endpoint: dict, prompt: list[int]) -> list[int]:
    port = int(endpoint["http"].rsplit(":", 1)[1].split("/")[0])
    key = Path(endpoint["api_key_file"]).read_text().strip()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": 6}),
                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, data
    return list(data["choices"][0]["token_ids"])


@pytest.fixture
def job_cgroup() -> Iterator[Path | None]:
    """A stand-in for Slurm's job cgroup (as in test_faults), for the kept variant."""
    from .test_cgroups import stand_in_job_cgroup

    with stand_in_job_cgroup("spswap-vllm-job") as path:
        yield path


@pytest.mark.parametrize("kept", [False, True], ids=["image", "kept"])
def test_the_server_tree_is_dumped_and_restored_into_the_next_run(
    node: Config,
    tmp_path: Path,
    kept: bool,
    request: pytest.FixtureRequest,
) -> None:
    """image: the dump ends the tree and CRIU restores it. kept: run 0 is in a job
    cgroup, so spswapd parks it, leaves it running after the dump (its semaphore's links
    kept by the dump's action script) and freezes it; run 1 gets it back without CRIU."""
    cgroup = request.getfixturevalue("job_cgroup") if kept else None
    model = tmp_path / "model"
    save_model(model)
    Client(node).call("job.register", job_id=JOB, uid=0, user="root")
    prompts = [[1, 2, 3], [9, 4], [17]]

    run0 = _serve(node, tmp_path, model, 0, "run0.log", cgroup)
    ep0 = _wait("run 0's endpoint", lambda: _endpoint(tmp_path) or run0.poll() is not None)
    assert run0.poll() is None, (tmp_path / "run0.log").read_text()
    vllm_log = (tmp_path / "state" / "vllm.log").read_text()
    assert f"--kv-cache-memory-bytes {1 << 29}" in vllm_log, vllm_log[-2000:]
    before = [_complete(ep0, p) for p in prompts]
    server_pid = ep0["server_pid"]
    run0.send_signal(signal.SIGUSR1)
    if not kept:
        run0.wait(timeout=120)
    status = _wait("the dump to finish", lambda: (
        st if (st := Client(node).call("checkpoint.status", job_id=JOB))["state"]
        not in ("none", "dumping") else None))  # fmt: skip
    assert status["state"] == "saved", (status, (tmp_path / "run0.log").read_text())
    assert status["kept"] is kept
    image = next(node.paths.images.glob(f"job{JOB}-*"))
    assert json.loads((image / "spswap-dump.json").read_text())["link_remaps"]  # the semaphore
    if kept:
        assert run0.poll() is None and Path(f"/proc/{server_pid}").exists()  # frozen
    else:
        assert run0.returncode == -signal.SIGKILL  # CRIU ends a dumped process
        # the server went with it (init may take a moment to reap it)
        _wait("the server to be gone", lambda: not Path(f"/proc/{server_pid}").exists(), 15)

    run1 = _serve(node, tmp_path, model, 1, "run1.log")
    try:
        ep1 = _wait(
            "the restored endpoint",
            lambda: e if (e := _endpoint(tmp_path)) and e["pid"] == ep0["pid"] else None,
        )
        assert ep1["server_pid"] == server_pid  # the same server process, restored
        assert ep1["api_key_file"] == ep0["api_key_file"]
        after = [_complete(ep1, p) for p in prompts]
        assert after == before
    finally:
        run1.send_signal(signal.SIGTERM)  # forwarded by the stand-in run to the restored one
        assert run1.wait(timeout=120) == 0, (tmp_path / "run1.log").read_text()
    log1 = (tmp_path / "run1.log").read_text()
    summary = json.loads(log1[log1.index("\n{\n") :])
    assert summary["restored_pid"] == status["pid"] and summary["stopped_by"] == "SIGTERM"
    _wait("the restored tree to end", lambda: not Path(f"/proc/{server_pid}").exists(), 30)
    events = Client(node).call("events.tail", n=50)
    done = [e for e in events if e["kind"] == "restore.done"]
    assert done and done[0]["detail"]["kept"] is kept, events
    if kept:
        kinds = [e["kind"] for e in events]
        assert "checkpoint.kept" in kinds and "restore.joined_job" in kinds, kinds
        # the kept run 0 served run 1; the forwarded SIGTERM parked it again, and run 1's
        # process is in no job cgroup here: that dump is not kept, and CRIU ended it
        assert run0.wait(timeout=30) == -signal.SIGKILL
        assert kinds.count("checkpoint.saved") == 2, kinds
    # the job ends for good: its last image goes, and with it the name of the semaphore
    # its dead tree held (the tree's resource tracker, which unlinks it, died in the dump)
    (last,) = node.paths.images.glob(f"job{JOB}-*")
    records = json.loads((last / "spswap-dump.json").read_text())["link_remaps"]
    assert any(n.startswith("sem.") for r in records for n in _names_of(r)), records
    assert Client(node).call("job.end", job_id=JOB, requeued=False)["fate"] == "gone"
    assert [n for r in records for n in _names_of(r)] == [], records


def _names_of(record: dict) -> list[str]:
    """The names in the record's directory of the file it re-linked (its dev and inode)."""
    names = []
    for p in Path(record["dir"]).iterdir():
        try:
            st = p.lstat()
        except OSError:  # (somebody's file, gone meanwhile)
            continue
        if (st.st_dev, st.st_ino) == (record["dev"], record["ino"]):
            names.append(p.name)
    return names


def test_a_restored_instance_that_dies_is_replaced_by_a_cold_start(
    node: Config, tmp_path: Path
) -> None:
    """Run 1 has run 0's tree restored; then the restored `spswap serve` is killed and its
    server lives on, orphaned (on a GPU: holding its memory). Run 1 ends that server,
    starts from the pool itself, says why, and answers as run 0 did."""
    from spswap.serve.run_log import RunPath, read_runs
    from tests.helpers.restore import running

    model = tmp_path / "model"
    save_model(model)
    Client(node).call("job.register", job_id=JOB, uid=0, user="root")
    prompts = [[1, 2, 3], [9, 4]]
    run0 = _serve(node, tmp_path, model, 0, "run0.log")
    ep0 = _wait("run 0's endpoint", lambda: _endpoint(tmp_path) or run0.poll() is not None)
    assert run0.poll() is None, (tmp_path / "run0.log").read_text()
    before = [_complete(ep0, p) for p in prompts]
    run0.send_signal(signal.SIGUSR1)
    run0.wait(timeout=120)
    status = _wait("the dump to finish", lambda: (
        st if (st := Client(node).call("checkpoint.status", job_id=JOB))["state"]
        not in ("none", "dumping") else None))  # fmt: skip
    assert status["state"] == "saved", (status, (tmp_path / "run0.log").read_text())
    server_pid = ep0["server_pid"]
    _wait("the server to be gone", lambda: not Path(f"/proc/{server_pid}").exists(), 15)

    run1 = _serve(node, tmp_path, model, 1, "run1.log")
    try:
        _wait(
            "the restored endpoint",
            lambda: e if (e := _endpoint(tmp_path)) and e["pid"] == ep0["pid"] else None,
        )
        assert running(server_pid)  # restored with its instance
        os.kill(ep0["pid"], signal.SIGKILL)  # the instance dies, its server lives on
        ep2 = _wait(
            "run 1's own endpoint",
            lambda: e if (e := _endpoint(tmp_path)) and e["pid"] == run1.pid else None,
        )
        assert not running(server_pid) and ep2["server_pid"] != server_pid
        assert [_complete(ep2, p) for p in prompts] == before
    finally:
        run1.send_signal(signal.SIGTERM)  # it serves itself now: parked and dumped
        run1.wait(timeout=120)
    log1 = (tmp_path / "run1.log").read_text()
    assert f"ended what it left running (pid {server_pid}" in log1, log1
    runs = read_runs(tmp_path / "state")
    assert [r.path for r in runs] == [RunPath.COLD, RunPath.IMAGE, RunPath.POOL], runs
    assert runs[-1].reason is not None and "ended on its own" in runs[-1].reason
