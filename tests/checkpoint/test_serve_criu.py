"""The checkpoint path of `spswap serve`, end to end on CPU, with the real CRIU and a real
spswapd (no Slurm needed: the job is registered with the daemon as its prolog would).

Run 0 serves, is told to stop (USR1), sleeps its engine, parks, and is dumped by the
daemon; run 1 (restart count 1) asks the daemon to restore it, and the restored process
wakes its weights from the pool and answers the rest: every answer equal to the model's
cold greedy answer. Then the faults: an image changed by one byte, or made under another
identity, is never restored: the run cold-starts and says why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.pool.store import Pool

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402
from tests.helpers.serve import cpu_serve_argv  # noqa: E402

pytestmark = [pytest.mark.criu, pytest.mark.slow]
MAX_NEW = 12
N_REQ = 16
JOB = "4242"


def _setup(cfg: Config, tmp: Path) -> tuple[Path, list[list[int]]]:
    model = tmp / "model"
    save_checkpoint(preset("small"), model)
    prompts = [[2 + i, 5, 3 * i + 1, 8] for i in range(N_REQ)]
    (tmp / "req.jsonl").write_text(
        "".join(
            json.dumps({"id": f"q{i:02d}", "prompt_ids": p, "max_new_tokens": MAX_NEW}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    Client(cfg).call("job.register", job_id=JOB, uid=0, user="root")
    return model, prompts


def _serve(cfg: Config, tmp: Path, model: Path, restart: int, log: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SPSWAP_ROOT=str(cfg.root), SLURM_JOB_ID=JOB, SLURM_RESTART_COUNT=str(restart))
    out = open(tmp / log, "w")  # a regular file, as a Slurm job's output is
    return subprocess.Popen(
        cpu_serve_argv(
            model,
            tmp / "state",
            "--requests",
            str(tmp / "req.jsonl"),
            "--exit-when-idle",
            "--json",
        ),
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


def _answers(tmp: Path) -> dict[str, list[int]]:
    box = tmp / "state" / "outbox"
    return {p.stem: json.loads(p.read_text())["output_ids"] for p in box.glob("*.json")}


def _wait(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _dump_run0(cfg: Config, tmp: Path, model: Path) -> dict:
    first = _serve(cfg, tmp, model, 0, "run0.log")
    _wait("the first answers", lambda: len(_answers(tmp)) >= 2 or first.poll() is not None)
    assert first.poll() is None, (tmp / "run0.log").read_text()
    first.send_signal(signal.SIGUSR1)
    first.wait(timeout=120)
    # CRIU ends the process before the daemon has written the image's meta: wait for it
    status = _wait(
        "the dump to finish",
        lambda: (
            st
            if (st := Client(cfg).call("checkpoint.status", job_id=JOB))["state"] != "dumping"
            else None
        ),
    )
    assert status["state"] == "saved", (status, (tmp / "run0.log").read_text())
    assert first.returncode == -signal.SIGKILL  # CRIU ends a dumped process
    assert 0 < len(_answers(tmp)) < N_REQ
    return status


def test_stop_dump_restore_answers_like_cold(node: Config, tmp_path: Path) -> None:
    model, prompts = _setup(node, tmp_path)
    status = _dump_run0(node, tmp_path, model)
    assert status["size_bytes"] > 0 and "criu_dump" in status["timings_s"]
    before = len(_answers(tmp_path))
    from typer.testing import CliRunner

    from spswap.cli.app import app

    listed = CliRunner().invoke(app, ["images", "ls", "--json", "--root", str(node.root)])
    (image,) = json.loads(listed.stdout)["images"]
    assert image["model"] == Pool.from_config(node).entries()[0].manifest.name
    assert (image["job_id"], image["state"]) == (JOB, "saved") and image["size_bytes"] > 0
    assert image["identity"]["engine"] == "reference" and image["identity"]["uid"] == 0
    # what the image holds by kind of memory: as `images show` reads it, and as spswapd's
    # event recorded it after the dump, after "saved" (reading it delays no restore)
    shown = CliRunner().invoke(app, ["images", "show", JOB, "--json", "--root", str(node.root)])
    layout = json.loads(shown.stdout)

    def layout_recorded() -> list[dict] | None:
        events = Client(node).call("events.tail", n=50)
        return events if any(e["kind"] == "checkpoint.layout" for e in events) else None

    events = _wait("the image's layout event", layout_recorded)
    kinds = [e["kind"] for e in events]
    assert kinds.index("checkpoint.layout") > kinds.index("checkpoint.saved"), kinds
    assert "layout" not in events[kinds.index("checkpoint.saved")]["detail"]["image"]
    recorded = events[kinds.index("checkpoint.layout")]["detail"]
    assert recorded["key"] == image["key"] and recorded["read_s"] >= 0
    recorded = recorded["layout"]  # the event's summary: no largest areas
    assert recorded["bytes_by_kind"] == layout["bytes_by_kind"]
    assert recorded["processes"] == [{k: p[k] for k in ("pid", "dumped_bytes", "bytes_by_kind")}
                                     for p in layout["processes"]]  # fmt: skip
    assert 0 < sum(layout["bytes_by_kind"].values()) <= image["size_bytes"]

    second = _serve(node, tmp_path, model, 1, "run1.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "run1.log").read_text()
    log1 = (tmp_path / "run1.log").read_text()
    summary = json.loads(log1[log1.index("\n{\n") :])
    assert summary["events"][0]["restored_pid"] == status["pid"], log1
    assert summary["pending_left"] == 0
    answers = _answers(tmp_path)
    assert len(answers) == N_REQ > before
    assert [answers[f"q{i:02d}"] for i in range(N_REQ)] == cold_answers(model, prompts, MAX_NEW)
    # the restored process writes on in run 0's output: how many saved requests it took
    # up, and at its end what it answered in run 1 alone (its count of run 0 apart)
    log0 = (tmp_path / "run0.log").read_text()
    assert "into run 1; weights back in" in log0 and \
        f"; {N_REQ - before} saved request(s) to resume" in log0, log0  # fmt: skip
    summary0 = json.loads(log0[log0.rindex("\n{\n") :])
    assert (summary0["resumed"], summary0["answered_before"], summary0["answered"]) == (
        N_REQ - before, before, N_REQ), log0  # fmt: skip
    kinds = [e["kind"] for e in Client(node).call("events.tail", n=50)]
    assert "checkpoint.saved" in kinds and "restore.done" in kinds
    # a process image is single use
    assert not any(p.name.startswith(f"job{JOB}-") for p in node.paths.images.iterdir())


@pytest.mark.parametrize("fault", ["flip-one-byte", "cut-short", "other-identity"])
def test_a_damaged_or_foreign_image_is_never_restored(
    node: Config, tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte changed in place is found by the full check (SPSWAP_IMAGE_CHECK=full: every
    byte hashed); the default quick check finds a file cut short (names and sizes), and
    leaves a byte changed in place to the restored instance's check prompt
    (tests/checkpoint/test_faults.py: a damaged pool entry)."""
    model, prompts = _setup(node, tmp_path)
    _dump_run0(node, tmp_path, model)
    (image,) = [p for p in node.paths.images.iterdir() if p.name.startswith(f"job{JOB}-")]
    target = max((p for p in image.iterdir() if p.name.startswith("pages")),
                 key=lambda p: p.stat().st_size)  # fmt: skip
    if fault == "flip-one-byte":
        with open(target, "r+b") as f:
            f.seek(target.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
        needle = "changed since it was dumped (sha256"
        lifecycle.stop(node, timeout_s=5.0)  # the node's admin asks for the full check
        monkeypatch.setenv("SPSWAP_IMAGE_CHECK", "full")
        lifecycle.start(node, wait_s=15.0)
    elif fault == "cut-short":
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size - 4096)
        needle = "a file is missing, added or of another size"
    else:
        meta = json.loads((image / "meta.json").read_text())
        meta["identity"]["torch"] = "0.0.1"
        (image / "meta.json").write_text(json.dumps(meta))
        needle = "another identity"

    second = _serve(node, tmp_path, model, 1, "run1.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "run1.log").read_text()
    log1 = (tmp_path / "run1.log").read_text()
    assert "starts anew" in log1 and needle in log1, log1
    answers = _answers(tmp_path)
    assert [answers[f"q{i:02d}"] for i in range(N_REQ)] == cold_answers(model, prompts, MAX_NEW)
    assert not image.exists()  # a rejected image is deleted, never retried
    from spswap.status import collect_status

    (shown,) = collect_status(node, gpus=[])["checkpoints"]  # the reason, in spswap status
    assert shown["state"] == "rejected" and needle in shown["reason"]
    kinds = [e["kind"] for e in Client(node).call("events.tail", n=50)]
    assert "restore.rejected" in kinds


def test_the_socket_front_answers_again_after_a_restore(node: Config, tmp_path: Path) -> None:
    """A server (no exit when idle) with a socket: asked, checkpointed, restored by the
    next run; the restored process listens again and answers like the cold model."""
    from spswap.serve.front import ask

    model, _ = _setup(node, tmp_path)
    sock = Path(tempfile.mkdtemp(prefix="spsk-", dir="/tmp")) / "s.sock"

    def start(restart: int, log: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SPSWAP_ROOT=str(node.root), SLURM_JOB_ID=JOB, SLURM_RESTART_COUNT=str(restart))
        return subprocess.Popen(
            cpu_serve_argv(model, tmp_path / "state", "--socket", str(sock)),
            env=env,
            stdout=open(tmp_path / log, "w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    first = start(0, "run0.log")
    _wait("the socket", sock.exists, 60)
    a1 = ask(sock, {"id": "s1", "prompt_ids": [9, 8, 7], "max_new_tokens": MAX_NEW})
    first.send_signal(signal.SIGUSR1)
    first.wait(timeout=120)
    saved = _wait(
        "the dump to finish",
        lambda: (
            st
            if (st := Client(node).call("checkpoint.status", job_id=JOB))["state"] != "dumping"
            else None
        ),
    )
    assert saved["state"] == "saved", (saved, (tmp_path / "run0.log").read_text())
    assert not sock.exists()  # closed before the dump: no connection may be dumped

    second = start(1, "run1.log")
    try:
        _wait("the restored process to listen again", sock.exists, 120)
        a2 = ask(sock, {"id": "s2", "prompt_ids": [1, 2, 3], "max_new_tokens": MAX_NEW})
        assert a1["ok"] and a2["ok"], (a1, a2)
        cold = cold_answers(model, [[9, 8, 7], [1, 2, 3]], MAX_NEW)
        assert [a1["output_ids"], a2["output_ids"]] == cold
        restored_log = (tmp_path / "run0.log").read_text()  # the restored process's output
        assert "restored from its image into run 1" in restored_log
    finally:
        second.send_signal(signal.SIGTERM)  # forwarded to the restored process
        second.wait(timeout=120)
