"""``spswap serve --engine vllm``: the server's command line (exact), the private socket,
and whole runs against a stand-in for vLLM's OpenAI server that hosts spswap's real worker
extension (tests/serve/vllm_standin.py; the real server runs on the GPU machine:
tests/engines/test_vllm_serve_gpu.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spswap.config import Config  # noqa: E402
from spswap.engines.vllm_engine import VllmSettings  # noqa: E402
from spswap.errors import EngineError  # noqa: E402
from spswap.pool.store import Pool  # noqa: E402
from spswap.serve.backend import ServeResult  # noqa: E402
from spswap.serve.lifecycle import ServeRun  # noqa: E402
from spswap.serve.run_log import RunPath  # noqa: E402
from spswap.serve.vllm_api import (  # noqa: E402
    VllmApiServer,
    api_server_argv,
    api_server_env,
    check_user_args,
    has_tokenizer,
    uds_request,
)
from spswap.serve.vllm_run import ENDPOINT_FILE, VllmBackend, VllmServeOptions, vllm_run  # noqa: E402
from tests.serve.vllm_standin import save_model  # noqa: E402

STANDIN = (sys.executable, str(Path(__file__).with_name("vllm_standin.py")))


def test_api_server_argv_is_exact(tmp_path: Path) -> None:
    s = VllmSettings(gpu_memory_utilization=0.45, max_model_len=2048)
    argv = api_server_argv(Path("/m/qwen"), Path("/s/vllm.sock"), s, ["--max-num-seqs", "8"],
                           dummy=True, tokenizer=False, launcher=("py", "-m", "x"))  # fmt: skip
    assert argv == [
        "py", "-m", "x", "--model", "/m/qwen", "--uds", "/s/vllm.sock",
        "--enable-sleep-mode", "--worker-extension-cls",
        "spswap.engines.vllm_worker.SpswapWorkerExtension", "--load-format", "dummy",
        "--dtype", "bfloat16", "--tensor-parallel-size", "1",
        "--gpu-memory-utilization", "0.45", "--max-model-len", "2048", "--seed", "0",
        "--attention-backend", "FLASH_ATTN", "--skip-tokenizer-init", "--enforce-eager",
        "--no-enable-prefix-caching", "--max-num-seqs", "8",
    ]  # fmt: skip
    argv = api_server_argv(Path("/m"), Path("/s"), VllmSettings(enforce_eager=False,
                           enable_prefix_caching=True), dummy=False)  # fmt: skip
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert "auto" in argv and "--enforce-eager" not in argv and "--skip-tokenizer-init" \
        not in argv and argv[-1] == "--enable-prefix-caching"  # fmt: skip
    sized = api_server_argv(
        Path("/m"), Path("/s"), VllmSettings(kv_cache_memory_bytes=4 << 30), dummy=True
    )
    at = sized.index("--kv-cache-memory-bytes")
    assert sized[at + 1] == str(4 << 30) and "--kv-cache-memory-bytes" not in argv


@pytest.mark.parametrize("arg", ["--port", "--host=0.0.0.0", "--uds", "--load-format",
                                 "--enable-sleep-mode", "--worker-extension-cls"])  # fmt: skip
def test_options_spswap_owns_are_refused(arg: str) -> None:
    with pytest.raises(EngineError, match="set by spswap serve"):
        check_user_args(["--max-num-seqs", "4", arg])
    check_user_args(["--max-num-seqs", "4", "--port-range-is-not-port"])


def test_options_spswap_serve_sets_from_its_own_are_refused_naming_them() -> None:
    """Given after -- too, vLLM would take the later value behind spswap's back (its
    records, the pool entry's identity and the GPU slot would say otherwise)."""
    with pytest.raises(EngineError) as e:
        check_user_args(["--max-model-len=512"])
    assert str(e.value) == (
        "vLLM option --max-model-len is one spswap serve sets itself: give spswap serve "
        "--max-model-len N before -- (SERVE_ARGS in the vLLM template) instead; remove it "
        "from the arguments after --"
    )
    with pytest.raises(EngineError, match="--no-eager before --"):
        check_user_args(["--no-enforce-eager"])
    with pytest.raises(EngineError, match="--units .* before --"):
        check_user_args(["--gpu-memory-utilization", "0.95"])
    with pytest.raises(EngineError, match="runs vLLM in bfloat16"):
        check_user_args(["--dtype", "float16"])
    with pytest.raises(EngineError, match="for TCP give spswap serve --port before --"):
        check_user_args(["--port", "8000"])
    check_user_args(["--kv-cache-memory-bytes", "4294967296", "--max-num-seqs", "8"])


def test_env_turns_the_dev_endpoints_on_and_the_hub_off(tmp_path: Path) -> None:
    env = api_server_env(VllmSettings(), base={"PATH": "/bin"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PATH"] == "/bin" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert not has_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert has_tokenizer(tmp_path)


def test_vllms_ipc_sockets_go_to_the_private_socket_dir() -> None:
    env = api_server_env(VllmSettings(), base={}, rpc_dir=Path("/home/u/.spswap/7/sock"))
    assert env["VLLM_RPC_BASE_PATH"] == "/home/u/.spswap/7/sock"
    user = api_server_env(VllmSettings(), base={"VLLM_RPC_BASE_PATH": "/mine"},
                          rpc_dir=Path("/x"))  # fmt: skip
    assert user["VLLM_RPC_BASE_PATH"] == "/mine"  # the user's choice stands
    long_dir = Path("/p/" + "d" * 68)  # 71 bytes: a uuid4 name would pass 107
    assert "VLLM_RPC_BASE_PATH" not in api_server_env(VllmSettings(), base={},
                                                      rpc_dir=long_dir)  # fmt: skip
    assert "VLLM_RPC_BASE_PATH" in api_server_env(VllmSettings(), base={},
                                                  rpc_dir=Path("/p/" + "d" * 67))  # fmt: skip


def _complete(uds: Path, prompt: list[int]) -> list[int]:
    status, data = uds_request(uds, "POST", "/v1/completions",
                               {"prompt": prompt, "max_tokens": 6})  # fmt: skip
    assert status == 200, data
    return list(data["choices"][0]["token_ids"])


def test_sleep_and_wake_through_the_server(tmp_path: Path) -> None:
    model = tmp_path / "m"
    save_model(model)
    pool = Pool(tmp_path / "pool")
    srv = VllmApiServer(model, tmp_path / "sock", log_path=tmp_path / "s.log", launcher=STANDIN)
    try:
        srv.start(dummy=False, timeout_s=60)
        mode = stat.S_IMODE((tmp_path / "sock").stat().st_mode)
        assert mode == 0o700  # only the job's user (and root) reach the socket
        cold = _complete(srv.uds, [1, 2, 3])
        out = srv.rpc("spswap_export", str(pool.pool_dir), "m", {"engine": "vllm"})
        srv.rpc("spswap_attach", str(pool.pool_dir), out["digest"])
        assert srv.sleep() >= 0 and srv.is_sleeping()
        assert uds_request(srv.uds, "POST", "/v1/completions", {"prompt": [1]})[0] == 503
        copy = srv.wake()
        weights = sum(t.size_bytes for t in pool.find(out["digest"]).tensors)
        assert copy["size_bytes"] == weights and not srv.is_sleeping()
        assert _complete(srv.uds, [1, 2, 3]) == cold
        with pytest.raises(EngineError, match="no_such_method|answered 500"):
            srv.rpc("no_such_method")
    finally:
        srv.stop()
    assert not srv.uds.exists()


def test_a_server_that_dies_at_start_says_why(tmp_path: Path) -> None:
    srv = VllmApiServer(tmp_path, tmp_path / "sock", log_path=tmp_path / "s.log",
                        launcher=(sys.executable, "-c", "print('no GPU here'); raise "
                                  "SystemExit(3)"))  # fmt: skip
    with pytest.raises(EngineError, match="exited with 3") as exc:
        srv.start(dummy=False, timeout_s=30)
    assert "no GPU here" in str(exc.value)


def _run_in_thread(run: ServeRun[VllmBackend]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["result"] = run.run()
        except BaseException as e:  # reported by the test
            out["error"] = e

    th = threading.Thread(target=go)
    th.start()
    endpoint = run.backend.opts.state_dir / ENDPOINT_FILE
    deadline = time.monotonic() + 60
    while not endpoint.exists():
        assert "error" not in out, out.get("error")
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)
    return th, out


def test_first_run_exports_and_the_next_starts_from_the_pool(tmp_path: Path) -> None:
    model = tmp_path / "m"
    save_model(model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    requeued: list[str] = []

    def one_run(state: Path, sig: signal.Signals) -> tuple[ServeResult, list[int], dict]:
        opts = VllmServeOptions(model=model, state_dir=state, launcher=STANDIN,
                                start_timeout_s=60)  # fmt: skip
        run = vllm_run(cfg, opts, job_id="77", requeue=requeued.append,
                        vllm_version="0.26.0-standin", log=lambda s: None)  # fmt: skip
        th, out = _run_in_thread(run)
        endpoint = json.loads((state / ENDPOINT_FILE).read_text())
        answer = _complete(Path(endpoint["uds"]), [4, 5, 6])
        from spswap.instance.registry import InstanceRegistry

        registry = InstanceRegistry(cfg.paths.instances)
        [(rec, alive)] = registry.list()  # what `spswap status` shows
        assert (rec.engine, rec.state, rec.job_id, alive) == ("vllm", "up", "77", True)
        run.handle_signal(sig)
        th.join(30)
        assert "error" not in out, out.get("error")
        assert registry.list() == []
        assert not (state / ENDPOINT_FILE).exists() and not Path(endpoint["uds"]).exists()
        return out["result"], answer, endpoint

    first, cold, _ = one_run(tmp_path / "s1", signal.SIGUSR1)
    assert first.path is RunPath.COLD and first.stopped_by == "SIGUSR1"
    # an eager server's weights are packed after its start; on a CPU the worker says why not
    assert first.pack == {"packed": False, "why": "the weights are not on a CUDA GPU"}
    assert requeued == ["77"]  # USR1: the run asks for its requeue
    pool = Pool.from_config(cfg)
    [entry] = pool.entries()
    assert entry.manifest.identity["vllm"] == "0.26.0-standin"
    assert entry.manifest.identity["owner_uid"] == 0  # root exported it directly
    assert entry.users == []  # the run's use ended with it

    second, warm, _ = one_run(tmp_path / "s2", signal.SIGTERM)
    assert second.path is RunPath.POOL and second.digest == first.digest
    assert second.copy is not None and second.copy["size_bytes"] > 0
    assert warm == cold  # random dummy weights, then every byte from the pool
    assert second.pack == first.pack
    assert requeued == ["77"]  # SIGTERM: no requeue request


@pytest.mark.parametrize(
    ("eager", "pack", "why"),
    [(False, True, "--no-eager: vLLM's CUDA graphs hold their addresses"),
     (True, False, "--no-pack")],
)  # fmt: skip
def test_a_server_with_cuda_graphs_or_no_pack_is_not_asked_to_pack(
    tmp_path: Path, eager: bool, pack: bool, why: str
) -> None:
    """--no-eager (captured CUDA graphs hold the weights' addresses) or --no-pack: the run
    never asks the worker to move them (asked, the stand-in's worker would answer that
    the weights are not on a CUDA GPU), and its log and --json say why."""
    model = tmp_path / "m"
    save_model(model)
    opts = VllmServeOptions(model=model, state_dir=tmp_path / "s", launcher=STANDIN,
                            settings=VllmSettings(enforce_eager=eager), pack=pack,
                            start_timeout_s=60)  # fmt: skip
    logs: list[str] = []
    run = vllm_run(Config.from_env({}, root=tmp_path / "root"), opts,
                   vllm_version="0.26.0-standin", log=logs.append)  # fmt: skip
    th, out = _run_in_thread(run)
    run.handle_signal(signal.SIGTERM)
    th.join(30)
    assert "error" not in out, out.get("error")
    assert out["result"].pack == {"packed": False, "why": why}
    assert f"spswap serve: m's weights were not packed into one allocation ({why})" in logs


class _DirectPool:
    """The pool as a user's run sees it through PoolAccess, served directly (a user's
    Python cannot be started here: the interpreter lives under /root); the daemon's own
    stamping of owner_uid is tested in tests/security/test_pool_access.py."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.pool_dir, self.imports = pool, pool.pool_dir, []

    def entries(self) -> list[Any]:
        return self.pool.entries()

    def find_alias(self, key: str) -> Any:
        return self.pool.find_alias(key)

    def use(self, ref: str) -> Any:
        from spswap.liveness import Holder

        return self.pool.use(ref, Holder.current())

    def import_checkpoint(self, path: Path, *, name: str, identity: dict[str, Any]) -> Any:
        self.imports.append((path.name, identity))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the export file is private
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # in a private directory
        return self.pool.import_checkpoint(
            path, name=name, identity={**identity, "owner_uid": 1234}
        )


def test_a_users_export_goes_through_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not root: the worker writes its weights to a 0600 file in the state directory, the
    pool imports it with the layout identity, the file is removed, and the next run of
    the same user starts from that entry."""
    model = tmp_path / "m"
    save_model(model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    pool = _DirectPool(Pool(tmp_path / "pool"))
    monkeypatch.setattr("spswap.access.privileged", lambda: False)
    monkeypatch.setattr("os.getuid", lambda: 1234)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    results, answers = [], []
    for n in (1, 2):
        opts = VllmServeOptions(model=model, state_dir=tmp_path / f"s{n}", launcher=STANDIN,
                                start_timeout_s=60)  # fmt: skip
        run = vllm_run(cfg, opts, pool=pool, vllm_version="x", log=lambda s: None)
        th, out = _run_in_thread(run)
        answers.append(_complete(run.backend.server.uds, [7, 8]))
        run.handle_signal(signal.SIGTERM)
        th.join(30)
        assert "error" not in out, out.get("error")
        results.append(out["result"])
    assert [r.path for r in results] == [RunPath.COLD, RunPath.POOL] and answers[0] == answers[1]
    [(fname, identity)] = pool.imports
    assert fname == "vllm-m.safetensors" and identity["vllm"] == "x" and identity["rank"] == 0
    # the private export directory (mkdtemp under $TMPDIR) is gone with its file
    assert not list((tmp_path / "tmp").iterdir())


def test_port_opens_an_authenticated_front_named_in_the_endpoint(tmp_path: Path) -> None:
    import http.client

    model = tmp_path / "m"
    save_model(model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    state = tmp_path / "s"
    opts = VllmServeOptions(model=model, state_dir=state, launcher=STANDIN, start_timeout_s=60,
                            http_port=0)  # fmt: skip
    run = vllm_run(cfg, opts, vllm_version="x", log=lambda s: None)
    th, out = _run_in_thread(run)
    try:
        endpoint = json.loads((state / ENDPOINT_FILE).read_text())
        assert endpoint["http"].startswith("http://127.0.0.1:") and endpoint["http"].endswith("/v1")
        key = Path(endpoint["api_key_file"]).read_text().strip()
        assert stat.S_IMODE((state / ENDPOINT_FILE).stat().st_mode) == 0o600
        port = int(endpoint["http"].rsplit(":", 1)[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [4, 5, 6],
                     "max_tokens": 6}), headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200
        via_tcp = json.loads(resp.read())["choices"][0]["token_ids"]
        assert via_tcp == _complete(run.backend.server.uds, [4, 5, 6])
    finally:
        run.handle_signal(signal.SIGTERM)
        th.join(30)
    assert "error" not in out, out.get("error")
    assert run.backend.front is not None and run.backend.front.port == port


def test_in_flight_requests_from_metrics_text() -> None:
    from spswap.serve.vllm_api import requests_in_flight

    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running_total 9.0
vllm:num_requests_waiting_by_reason{reason="x"} 4.0
"""
    assert requests_in_flight(text) == 6
    assert requests_in_flight("") == 0


@pytest.mark.parametrize("drain_s", [5.0, 0.3])
def test_a_stop_drains_running_requests_first(tmp_path: Path, drain_s: float) -> None:
    """A request running at the stop (through the TCP front) finishes within drain_s;
    one that needs longer is aborted, and the run says so."""
    import http.client
    import threading

    model = tmp_path / "m"
    save_model(model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    state = tmp_path / "s"
    opts = VllmServeOptions(model=model, state_dir=state, launcher=STANDIN, start_timeout_s=60,
                            http_port=0, drain_s=drain_s)  # fmt: skip
    logs: list[str] = []
    run = vllm_run(cfg, opts, vllm_version="x", log=logs.append)
    th, out = _run_in_thread(run)
    endpoint = json.loads((state / ENDPOINT_FILE).read_text())
    key = Path(endpoint["api_key_file"]).read_text().strip()
    port = int(endpoint["http"].rsplit(":", 1)[1].split("/")[0])
    answer: dict[str, Any] = {}

    def slow_request() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": [4, 5, 6], "max_tokens": 6, "standin_delay_s": 1.5}),
                headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            answer["status"] = conn.getresponse().status
        except (OSError, http.client.HTTPException) as e:
            answer["error"] = repr(e)

    client = threading.Thread(target=slow_request)
    client.start()
    deadline = time.monotonic() + 10
    while run.backend.server.in_flight() != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    run.handle_signal(signal.SIGTERM)
    th.join(30)
    client.join(30)
    assert "error" not in out, out.get("error")
    drain = out["result"].drain
    assert drain is not None
    if drain_s > 1.5:
        assert answer == {"status": 200} and drain["aborted"] == 0 and drain["waited_s"] > 1
        with pytest.raises(OSError):  # no new connection was taken meanwhile
            http.client.HTTPConnection("127.0.0.1", port, timeout=2).connect()
    else:
        assert "error" in answer and drain["aborted"] >= 1, (answer, drain)
        assert any("still running after" in line for line in logs), logs


def test_the_check_prompt_asks_logprobs_only_of_an_idle_engine(tmp_path: Path) -> None:
    """The restore's check through the server: with nothing else running, 2 tokens and
    the log-probabilities; with a request still running (it would share the batch), 8
    tokens alone; after a restore it asks as the answer it is compared with was."""
    import threading

    from spswap.serve.restore_check import PROBE_PROMPT, CheckAnswer, difference

    model = tmp_path / "m"
    save_model(model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    opts = VllmServeOptions(model=model, state_dir=tmp_path / "s", launcher=STANDIN,
                            start_timeout_s=60)  # fmt: skip
    run = vllm_run(cfg, opts, vllm_version="x", log=lambda _m: None)
    th, out = _run_in_thread(run)
    try:
        backend = run.backend
        idle = backend.probe()
        assert idle is not None and len(idle.token_ids) == 2
        assert len(idle.logprobs) == len(PROBE_PROMPT) + 1  # 7 prompt tokens + 2 answers
        again = backend.probe(idle)
        assert again is not None and difference(idle, again) is None

        body = {"prompt": [4, 5, 6], "max_tokens": 2, "standin_delay_s": 2.0}
        slow = threading.Thread(target=lambda: backend.server.call(
            "POST", "/v1/completions", body, timeout_s=20))  # fmt: skip
        slow.start()
        deadline = time.monotonic() + 10
        while backend.server.in_flight() != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        busy = backend.probe()
        slow.join(30)
        assert busy is not None and len(busy.token_ids) == 8 and busy.logprobs == ()
        assert busy.token_ids[:2] == idle.token_ids
        after = backend.probe(busy)  # idle now, but asked as before: tokens alone
        assert after == busy and after != CheckAnswer(idle.token_ids)
    finally:
        run.handle_signal(signal.SIGTERM)
        th.join(30)
    assert "error" not in out, out.get("error")


def test_the_check_asks_no_logprobs_of_a_server_that_dies_of_them(tmp_path: Path) -> None:
    """vLLM's --kv-sharing-fast-prefill asserts on a request for prompt log-probabilities
    (vLLM 0.26's model runner): the check asks that server 8 tokens alone."""
    model = tmp_path / "m"
    save_model(model)
    opts = VllmServeOptions(model=model, state_dir=tmp_path / "s", launcher=STANDIN,
                            start_timeout_s=60,
                            vllm_args=("--kv-sharing-fast-prefill",))  # fmt: skip
    run = vllm_run(Config.from_env({}, root=tmp_path / "root"), opts, vllm_version="x",
                   log=lambda _m: None)  # fmt: skip
    th, out = _run_in_thread(run)
    try:
        answer = run.backend.probe()
        assert answer is not None and len(answer.token_ids) == 8 and answer.logprobs == ()
    finally:
        run.handle_signal(signal.SIGTERM)
        th.join(30)
    assert "error" not in out, out.get("error")


def test_a_taken_port_fails_a_first_run_before_its_model_loads(tmp_path: Path) -> None:
    """--port N held by another process (another job's server on the node): the first
    run says so at once, naming the fix, before any slot, pool or server start."""
    import socket

    from spswap.serve.http_front import port_taken

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert port_taken("127.0.0.1", port) == (
            f"127.0.0.1:{port} cannot be listened on (Address already in use)")  # fmt: skip
        model = tmp_path / "m"
        save_model(model)
        state = tmp_path / "s"
        opts = VllmServeOptions(model=model, state_dir=state, launcher=STANDIN,
                                start_timeout_s=60, http_port=port)  # fmt: skip
        run = vllm_run(Config.from_env({}, root=tmp_path / "root"), opts, vllm_version="x")
        with pytest.raises(EngineError) as e:
            run.run()
        assert str(e.value) == (
            f"--port {port}: 127.0.0.1:{port} cannot be listened on (Address already in use); "
            "choose another port, or --port 0 for a free one (endpoint.json names it)")  # fmt: skip
        assert not (state / "vllm.log").exists()  # no server was started
    assert port_taken("127.0.0.1", port) is None  # free again


def test_a_state_directory_others_could_swap_is_refused(tmp_path: Path) -> None:
    """The server's socket (dev endpoints included) goes under the state directory: a
    group-writable directory above it would let another user put their own in place."""
    import os

    shared = tmp_path / "project"
    shared.mkdir()
    os.chmod(shared, 0o2775)  # a group project directory
    opts = VllmServeOptions(model=tmp_path, state_dir=shared / ".spswap" / "77",
                            launcher=STANDIN)  # fmt: skip
    run = vllm_run(Config.from_env({}, root=tmp_path / "root"), opts, vllm_version="x")
    from spswap.errors import PermissionDenied

    with pytest.raises(PermissionDenied, match="not private: .*writable by group.*--state-dir"):
        run.run()


def test_a_restored_server_that_dies_is_replaced_by_a_cold_start(tmp_path: Path) -> None:
    """A requeued run stands in for its restored instance, which dies (killed) and leaves
    its vLLM server running: the run ends that server (on a GPU it holds the memory the
    new one needs), starts from the pool in the same run and serves, saying why in its
    log and runs.jsonl. spswapd's restore is played by tests/helpers/restore.py (with
    CRIU: tests/checkpoint/test_serve_vllm_criu.py; real vLLM: tests/engines)."""
    from spswap.serve.run_log import read_runs
    from tests.helpers.restore import RestoreStandIn, running

    model = tmp_path / "m"
    save_model(model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    state = tmp_path / "s"
    opts = VllmServeOptions(model=model, state_dir=state, launcher=STANDIN, start_timeout_s=60)
    first = vllm_run(cfg, opts, job_id="77", vllm_version="x", log=lambda s: None)
    th, out = _run_in_thread(first)  # run 0: exports the weights to the pool
    first.handle_signal(signal.SIGTERM)
    th.join(30)
    assert "error" not in out, out.get("error")
    # the restored instance: its server up on the job's socket, then killed
    restore = RestoreStandIn(f"""
import os, sys, time
from pathlib import Path
from spswap.serve.vllm_api import VllmApiServer
srv = VllmApiServer(Path({str(model)!r}), Path({str(state / "sock")!r}),
                    launcher={STANDIN!r})
srv.start(dummy=False, timeout_s=60)
print(srv.proc.pid, flush=True)
time.sleep(2.0)  # (the run reads its tree first, even on a loaded machine)
os._exit(9)
""")
    logs: list[str] = []
    run = vllm_run(
        cfg,
        opts,
        job_id="77",
        restart_count=1,
        vllm_version="x",
        log=logs.append,
        checkpointer=restore,
    )  # type: ignore[arg-type]
    try:
        th, out = _run_in_thread(run)
        left_server = int(restore.first_line)
        endpoint = json.loads((state / ENDPOINT_FILE).read_text())
        assert endpoint["pid"] == os.getpid() and endpoint["server_pid"] != left_server
        assert _complete(Path(endpoint["uds"]), [4, 5, 6])
        assert not running(left_server)
    finally:
        run.handle_signal(signal.SIGTERM)
        th.join(30)
        restore.kill()
        if running(left_server := int(restore.first_line or 0)):
            os.kill(left_server, signal.SIGKILL)
    assert "error" not in out, out.get("error")
    result = out["result"]
    reason = result.cold_reason
    assert reason == (f"starts anew: the restored instance (pid {result.restored_pid}) ended "
                      "on its own (its server was to serve until stopped); ended what it "
                      f"left running (pid {left_server})")  # fmt: skip
    assert f"spswap serve: {reason}" in logs and result.path is RunPath.POOL
    assert [(r.restart_count, r.path, r.reason) for r in read_runs(state)][-2:] == [
        (1, RunPath.IMAGE, None),
        (1, RunPath.POOL, reason),
    ]
