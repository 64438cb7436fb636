"""No request ends `spswap serve` (a real server process, the real reference engine):
token ids outside the vocabulary, answers past the model's length, malformed lines and
random input get an error answer while good requests before and after are answered as
the cold model answers them; a request that was being answered when a run died is
quarantined, not replayed into the next run; the state directory is private."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from spswap.serve.front import ask
from spswap.serve.spool import Request, Spool

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402
from tests.helpers.serve import cpu_serve_argv  # noqa: E402


def _serve(model: Path, state: Path, sock: Path, root: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SPSWAP_ROOT"] = str(root)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spswap.cli", "serve", str(model), "--state-dir", str(state),
         "--device", "cpu", "--socket", str(sock)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 90
    while not sock.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the server did not open its socket"
        time.sleep(0.05)
    return proc


def _raw(sock: Path, line: bytes) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock))
        s.sendall(line)
        return json.loads(s.makefile("rb").readline())


def test_bad_requests_get_errors_and_the_server_goes_on(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    vocab, max_len = preset("tiny").vocab_size, preset("tiny").max_seq_len
    sock = Path(tempfile.mkdtemp(prefix="spbad-", dir="/tmp")) / "s.sock"
    proc = _serve(model, tmp_path / "state", sock, tmp_path / "root")
    try:
        good = ask(sock, {"id": "good1", "prompt_ids": [4, 5, 6], "max_new_tokens": 6})
        assert good["ok"] and good["output_ids"] == cold_answers(model, [[4, 5, 6]], 6)[0]
        far = ask(sock, {"id": "far", "prompt_ids": [99999], "max_new_tokens": 4})
        assert not far["ok"] and f"token ids must lie in [0, {vocab})" in far["error"]
        long = ask(sock, {"id": "long", "prompt_ids": [1, 2], "max_new_tokens": max_len})
        assert not long["ok"] and "more than the model's 256 positions" in long["error"]
        rng = random.Random(7)
        lines = [b"not json\n", b"{}\n", b'{"prompt_ids": "x"}\n', b"[1, 2]\n",
                 b'{"prompt_ids": [1], "max_new_tokens": -3}\n']  # fmt: skip
        for i in range(40):  # random ids, lengths and sizes, some out of range
            ids = [rng.randint(-5, vocab + 5) for _ in range(rng.randint(1, 40))]
            n = rng.choice([rng.randint(1, 6), max_len + rng.randint(0, 9), 5000])
            lines.append(
                json.dumps({"id": f"fz{i}", "prompt_ids": ids, "max_new_tokens": n}).encode()
                + b"\n"
            )
        for line in lines:
            answer = _raw(sock, line)
            assert answer.get("ok") or answer.get("error"), answer
            assert proc.poll() is None, f"the server exited on {line!r}"
        again = ask(sock, {"id": "good2", "prompt_ids": [4, 5, 6], "max_new_tokens": 6})
        assert again["output_ids"] == good["output_ids"]
        outbox = tmp_path / "state" / "outbox"
        assert json.loads((outbox / "far.json").read_text())["output_ids"] is None
        # the user's data is the user's alone
        assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
        assert {p.stat().st_mode & 0o777 for p in outbox.iterdir()} == {0o600}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_request_a_run_died_in_is_quarantined_not_replayed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    spool = Spool(state)
    spool.create()
    req = Request(id="crashy", prompt_ids=[1, 2], max_new_tokens=3)
    spool.submit(req)
    spool.submit(Request(id="fine", prompt_ids=[3], max_new_tokens=3))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    spool.running(req, 0)
    note = json.loads((state / "running.json").read_text())
    note.update(pid=dead.pid, pid_start=1)  # the run that was answering it is gone
    (state / "running.json").write_text(json.dumps(note))
    assert spool.quarantine_crashed() == "crashy"
    answer = spool.answer("crashy")
    assert answer is not None and answer["quarantined"] is True
    assert "ended while answering this request" in answer["error"]
    assert [r.id for r in spool.pending()] == ["fine"]
    # a request this (live) process answers is left alone
    spool.running(Request(id="fine", prompt_ids=[3], max_new_tokens=3), 1)
    assert spool.quarantine_crashed() is None and [r.id for r in spool.pending()] == ["fine"]


def test_a_group_writable_state_directory_is_refused(tmp_path: Path) -> None:
    from spswap.errors import PermissionDenied

    shared = tmp_path / "project"
    shared.mkdir()
    shared.chmod(0o2775)  # a group project directory: a member could swap .spswap
    with pytest.raises(PermissionDenied, match="not private: .*writable by group.*--state-dir"):
        Spool(shared / ".spswap" / "7").create()


def _read_as_other(path: str) -> str:
    try:
        with open(path) as f:
            f.read()
        return "read"
    except PermissionError:
        return "refused"


def _list_as_other(path: str) -> str:
    try:
        os.listdir(path)
        return "listed"
    except PermissionError:
        return "refused"


def test_another_user_cannot_read_the_answers(tmp_path: Path, user_uid: int) -> None:
    """Debian's homes are 0755: the job's state directory must still be the user's alone
    (before: 0755 and answers 0644, which a second user listed and read)."""
    from tests.uids import spawn_as

    home = Path(tempfile.mkdtemp(prefix="sphome-", dir="/tmp"))
    try:
        home.chmod(0o755)
        spool = Spool(home / ".spswap" / "9")
        spool.create()
        req = Request(id="secret", prompt_ids=[1, 2], max_new_tokens=2)
        spool.submit(req)
        spool.complete(req, [5, 6])
        outbox = str(spool.outbox / "secret.json")
        assert spawn_as(user_uid, _read_as_other, outbox).result() == "refused"
        assert spawn_as(user_uid, _list_as_other, str(spool.state_dir)).result() == "refused"
    finally:
        import shutil

        shutil.rmtree(home, ignore_errors=True)


def test_a_stop_drains_a_long_request_within_the_limit_and_saves_it(tmp_path: Path) -> None:
    """SIGTERM while a long answer is being generated: after --drain-s the request stops
    unfinished, its client is told it is saved, the run ends; the next run answers it as
    the cold model does (before: the stop waited for the whole answer)."""
    import threading

    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    sock = Path(tempfile.mkdtemp(prefix="spdrain-", dir="/tmp")) / "s.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SPSWAP_ROOT"] = str(tmp_path / "root")
    argv = cpu_serve_argv(model, tmp_path / "state", "--socket", str(sock), "--drain-s", "0.2")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    got: dict = {}
    try:
        deadline = time.monotonic() + 90
        while not sock.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server did not open its socket"
            time.sleep(0.05)
        long_req = {"id": "long", "prompt_ids": [1, 2, 3], "max_new_tokens": 250}
        asker = threading.Thread(target=lambda: got.update(ask(sock, long_req)))
        asker.start()
        running = tmp_path / "state" / "running.json"
        while not running.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        stop_s = time.monotonic() - t0
        asker.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped unfinished after 0.2 s of drain" in out, out
    assert stop_s < 10, f"the stop took {stop_s:.1f} s"
    assert got.get("saved") is True and "next run" in got["error"], got
    assert [p.stem for p in (tmp_path / "state" / "inbox").iterdir()] == ["long"]
    # the next run answers it, as the cold model would
    again = subprocess.run([*argv[:-2], "--exit-when-idle"], env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr
    answer = json.loads((tmp_path / "state" / "outbox" / "long.json").read_text())
    assert answer["output_ids"] == cold_answers(model, [[1, 2, 3]], 250)[0]


def test_at_a_stop_a_client_whose_answer_came_gets_it_not_saved(tmp_path: Path) -> None:
    import threading

    from spswap.serve.front import Front

    spool = Spool(tmp_path / "state")
    spool.create()
    sock = Path(tempfile.mkdtemp(prefix="spclose-", dir="/tmp")) / "s.sock"
    front = Front(spool, sock)
    front.open()
    got: dict = {}
    t = threading.Thread(
        target=lambda: got.update(ask(sock, {"id": "q", "prompt_ids": [1], "max_new_tokens": 2}))
    )
    t.start()
    deadline = time.monotonic() + 10
    while not list(spool.pending()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (req,) = list(spool.pending())
    spool.complete(req, [7, 8])  # answered just as the stop begins
    front.close("the server is stopping (SIGTERM) before it answered")
    t.join(10)
    assert got.get("ok") is True and got["output_ids"] == [7, 8], got
