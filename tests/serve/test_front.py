"""The Unix-socket front of `spswap serve`, with a real server process and the real engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from spswap.errors import SpswapError
from spswap.serve.front import ask

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402
from tests.helpers.serve import cpu_serve_argv  # noqa: E402


def test_ask_over_the_socket(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    sock = Path(tempfile.mkdtemp(prefix="spf-", dir="/tmp")) / "s.sock"  # short path
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SPSWAP_ROOT"] = str(tmp_path / "root")
    proc = subprocess.Popen(
        cpu_serve_argv(model, tmp_path / "state", "--socket", str(sock), "--json"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        a = ask(sock, {"id": "q1", "prompt_ids": [4, 5, 6], "max_new_tokens": 6})
        assert a["ok"] and a["output_ids"] == cold_answers(model, [[4, 5, 6]], 6)[0]
        again = ask(sock, {"id": "q1", "prompt_ids": [4, 5, 6], "max_new_tokens": 6})
        assert again["output_ids"] == a["output_ids"]  # answered once, kept
        assert ask(sock, {"id": "q1"})["output_ids"] == a["output_ids"]  # by its id alone
        unknown = ask(sock, {"id": "q2"})
        assert not unknown["ok"] and unknown["error"].startswith("bad request: no request q2 ")
        other = ask(sock, {"id": "q1", "prompt_ids": [7, 8], "max_new_tokens": 6})
        assert not other["ok"] and other["error"] == (
            "bad request: request q1 was asked before with the prompt 4,5,6: ask with that "
            "prompt (and --max-new-tokens) to get its answer, or use a new --id")  # fmt: skip
        bad = ask(sock, {"id": "../x", "prompt_ids": [1]})
        assert not bad["ok"] and "bad request" in bad["error"]
        with socket.socket(socket.AF_UNIX) as raw:  # garbage, then the server still answers
            raw.connect(str(sock))
            raw.sendall(b"not json\n")
            assert b"bad request" in raw.recv(4096)
        assert ask(sock, {"prompt_ids": [1, 2], "max_new_tokens": 2})["ok"]
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
        assert json.loads(out)["stopped_by"] == "SIGUSR1", err
        assert not sock.exists()
        with pytest.raises(SpswapError, match="is the job running"):
            ask(sock, {"prompt_ids": [1]})
    finally:
        if proc.poll() is None:
            proc.kill()


def test_front_refuses_a_socket_directory_others_can_write(tmp_path: Path) -> None:
    from spswap.serve.front import Front
    from spswap.serve.spool import Spool

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(SpswapError, match="not a private directory of yours"):
        Front(Spool(tmp_path / "state"), shared / "s.sock").open()


def test_the_socket_file_appears_only_once_it_takes_connections(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's script waits for the socket file and connects at once: the file must not
    exist before the socket listens (a bound socket refuses connections until then)."""
    from spswap.serve import front

    top = Path(tempfile.mkdtemp(prefix="spf-", dir="/tmp"))  # short paths
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    path = top / "sock" / "s.sock"
    path.parent.mkdir(mode=0o700)
    seen_at_listen: list[bool] = []

    class Watched(socket.socket):
        def listen(self, *args: object) -> None:
            seen_at_listen.append(path.exists())
            super().listen(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(front.socket, "socket", Watched)
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a stale socket of a last run
    old.bind(str(path))
    old.close()
    sock = front.listen_private_socket(path)
    try:
        assert seen_at_listen == [True]  # the stale file stayed until the rename replaced it
        path.unlink()
        sock.close()
        seen_at_listen.clear()
        sock = front.listen_private_socket(path)
        assert seen_at_listen == [False]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(p.name for p in path.parent.iterdir()) == ["s.sock"]  # staging gone
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(path))
    finally:
        sock.close()
    # a path that fits a socket only as it is (no room for the staging name) still works
    deep = top / ("d" * (107 - len(str(top)) - 4))  # + "/ab": 106
    deep.mkdir(mode=0o700)
    sock = front.listen_private_socket(deep / "ab")
    sock.close()
    assert [p.name for p in deep.iterdir()] == ["ab"]


def test_socket_auto_skips_a_runtime_dir_that_is_not_yours(tmp_path: Path, monkeypatch) -> None:
    """sbatch exports the login shell's XDG_RUNTIME_DIR: on the compute node it may be
    missing or another uid's; the state directory's private sock/ is used instead."""
    from spswap.serve.front import default_socket_path

    state = tmp_path / "st"
    theirs = tmp_path / "run-user-1001"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    for xdg in (str(theirs), str(tmp_path / "missing"), ""):
        monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
        assert default_socket_path("7", state) == state / "sock" / "serve.sock"
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))
    assert default_socket_path("7", state) == mine / "serve-7.sock"
    deep = tmp_path / ("d" * 120)  # too long for a socket: /tmp/spswap-$UID
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert default_socket_path("7", deep) == Path(f"/tmp/spswap-{os.getuid()}/serve-7.sock")


def test_a_socket_that_cannot_be_made_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    from spswap.serve.front import Front
    from spswap.serve.spool import Spool

    with pytest.raises(SpswapError, match="cannot listen on /proc/spswap-no/s.sock"):
        Front(Spool(tmp_path / "state"), Path("/proc/spswap-no/s.sock")).open()


def test_serve_socket_auto_with_a_foreign_runtime_dir(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    state = Path(tempfile.mkdtemp(prefix="spa-", dir="/tmp")) / "st"  # short path
    theirs = tmp_path / "run-user-1001"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SPSWAP_ROOT=str(tmp_path / "root"), XDG_RUNTIME_DIR=str(theirs))
    proc = subprocess.Popen(
        cpu_serve_argv(model, state, "--socket", "auto", "--json"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sock = state / "sock" / "serve.sock"
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (
            ask(sock, {"prompt_ids": [4, 5], "max_new_tokens": 3})["output_ids"]
            == cold_answers(model, [[4, 5]], 3)[0]
        )
        assert not list(theirs.iterdir())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert f"requests on {sock}" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ask_at_an_openai_endpoint_says_how_to_ask_it(tmp_path: Path) -> None:
    """A multi-model job's socket answers HTTP (the same handler class as its endpoint):
    `spswap ask` names the way to ask it instead of a JSON traceback."""
    import http.server
    import socketserver
    import threading

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    path = tmp_path / "multi.sock"
    server = Server(str(path), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        said = r"is a multi-model job.s OpenAI endpoint .*POST /v1/completions"
        with pytest.raises(SpswapError, match=said):
            ask(path, {"prompt_ids": [1, 2, 3], "max_new_tokens": 2}, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()


def test_a_multi_model_jobs_state_directory_is_refused_by_spswap_ask_with_the_way_in(
    tmp_path: Path,
) -> None:
    """`spswap ask --job N` on a `--models` job waited its whole timeout for a spool that
    never comes and then said the server had not started."""
    from spswap.serve.spool_ask import not_a_spool, write_multi_endpoint

    assert not_a_spool(tmp_path) is None
    write_multi_endpoint(tmp_path, Path("/run/x/api.sock"), ["m1", "m2"])
    assert not_a_spool(tmp_path) == (
        "this job serves several models (spswap serve --models) and spswap ask asks a single "
        f"model's job (its state directory {tmp_path} has no request queue for it). Its "
        "endpoint is /run/x/api.sock. Ask it with POST /v1/completions naming the model (its "
        "models: m1, m2) (docs/multi.md), e.g.: curl --unix-socket /run/x/api.sock "
        "http://localhost/v1/completions -H 'content-type: application/json' -d "
        '\'{"model": "m1", "prompt": [1, 2, 3], "max_tokens": 8}\''
    )
    # a job that has ended: its socket is gone, so no curl line that can only fail
    assert not_a_spool(tmp_path, "CANCELLED") == (
        "this job served several models (spswap serve --models) and has ended (CANCELLED): "
        "nothing answers for it any more; submit it again to ask its models (through its "
        "endpoint: docs/multi.md)"
    )
