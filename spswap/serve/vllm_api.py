"""vLLM's OpenAI-compatible server as a child of ``spswap serve --engine vllm``.

The server listens on a Unix socket in a directory only the job's user can enter (mode
0700), never on a network port: its development endpoints (``/sleep``, ``/wake_up``,
``/collective_rpc``; on with ``VLLM_SERVER_DEV_MODE=1``) are how spswap drives the engine,
and they are for the job's user and spswapd (root) only. Users reach the OpenAI API on
the same socket (``curl --unix-socket``, or an httpx transport), or through spswap's
authenticated TCP front (:mod:`spswap.serve.http_front`), which forwards the OpenAI
paths only.

A swap through the server is the same as :class:`~spswap.engines.vllm_engine.VllmEngine`'s:
``/sleep?level=2``, then the one wake sequence of :mod:`spswap.engines.vllm_wake`
(``/wake_up?tags=weights``, ``spswap_copy`` through ``/collective_rpc``,
``/wake_up?tags=kv_cache``, ``/reset_prefix_cache`` with prefix caching on). This module
imports neither vLLM nor torch: the server is another process.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from spswap.engines.vllm_engine import WORKER_EXTENSION, VllmSettings, engine_env
from spswap.engines.vllm_wake import WakeTimes, wake
from spswap.errors import EngineError, StopRequested
from spswap.install_hint import not_yours_text, pip_install_hint, prefix_writable

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Options spswap sets itself; a user passing one of them after `--` would break the swap.
RESERVED_ARGS = ("--uds", "--host", "--port", "--enable-sleep-mode", "--worker-extension-cls",
                 "--load-format", "--model")  # fmt: skip
READY_POLL_S = 0.25


# vLLM options `spswap serve` sets from its own (it records them with the pool entry and
# the checkpoint, and sizes the GPU slot by them): given after -- too, vLLM would take
# the later one behind spswap's back. Option -> what to do instead.
_INSTEAD = "before -- (SERVE_ARGS in the vLLM template) instead"
OWN_ARGS = {
    "--max-model-len": f"give spswap serve --max-model-len N {_INSTEAD}",
    "--gpu-memory-utilization": f"give spswap serve --units (or --gpu-memory-utilization) "
    f"{_INSTEAD}",  # fmt: skip
    "--enforce-eager": f"give spswap serve --eager (its default) {_INSTEAD}",
    "--no-enforce-eager": f"give spswap serve --no-eager {_INSTEAD}",
    "--dtype": "spswap serve runs vLLM in bfloat16 (as the pool entry records it)",
    "--tensor-parallel-size": "spswap serve runs vLLM on one GPU per model",
    "-tp": "spswap serve runs vLLM on one GPU per model",
}


def check_user_args(args: Sequence[str]) -> None:
    """Refuse vLLM options spswap owns (see :data:`RESERVED_ARGS` and :data:`OWN_ARGS`),
    naming the fix."""
    for a in args:
        key = a.split("=", 1)[0]
        if key in ("--port", "--host"):
            raise EngineError(
                f"vLLM option {key} is set by spswap serve (the server listens on a private "
                f"Unix socket); for TCP give spswap serve {key} before -- (SERVE_ARGS in "
                "the vLLM template), each request then with the job's key")  # fmt: skip
        if key in RESERVED_ARGS:
            raise EngineError(
                f"vLLM option {key} is set by spswap serve (the server listens on a private "
                "Unix socket, sleep mode and the weights come from the pool); remove it from "
                "the arguments after --"
            )
        if key in OWN_ARGS:
            raise EngineError(f"vLLM option {key} is one spswap serve sets itself: "
                              f"{OWN_ARGS[key]}; remove it from the arguments after "
                              "--")  # fmt: skip


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_dir: Path) -> bool:
    """Whether the model directory carries a tokenizer (else the server takes token ids)."""
    return any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES)


def default_launcher() -> tuple[str, ...]:
    """How vLLM's OpenAI server is started: this Python, ``-m`` the server module."""
    return (sys.executable, "-m", API_SERVER_MODULE)


def api_server_argv(
    model_dir: Path, uds: Path, settings: VllmSettings, user_args: Sequence[str] = (), *,
    dummy: bool, tokenizer: bool = True, launcher: Sequence[str] | None = None,
) -> list[str]:  # fmt: skip
    """The command line of vLLM's OpenAI server for spswap: the model, the private socket,
    sleep mode with spswap's worker extension, dummy weights when the pool fills them,
    the settings, then the user's own arguments (which may override the settings).
    Without a ``tokenizer`` the server takes and returns token ids only. ``launcher``:
    the command before the options (default :func:`default_launcher`; e.g. a container
    wrapper around it)."""
    check_user_args(user_args)
    argv = [
        *(launcher or default_launcher()), "--model", str(model_dir), "--uds", str(uds),
        "--enable-sleep-mode", "--worker-extension-cls", WORKER_EXTENSION,
        "--load-format", "dummy" if dummy else "auto",
        "--dtype", settings.dtype,
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        "--max-model-len", str(settings.max_model_len), "--seed", str(settings.seed),
        "--attention-backend", settings.attention_backend,
    ]  # fmt: skip
    if settings.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(int(settings.kv_cache_memory_bytes))]
    if not tokenizer:
        argv.append("--skip-tokenizer-init")
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    argv.append("--enable-prefix-caching" if settings.enable_prefix_caching
                else "--no-enable-prefix-caching")  # fmt: skip
    return argv + list(user_args)


# vLLM names its IPC sockets <VLLM_RPC_BASE_PATH>/<uuid4>; a socket path has 107 bytes
RPC_BASE_MAX_BYTES = 107 - 1 - 36


def api_server_env(settings: VllmSettings, base: dict[str, str] | None = None,
                   rpc_dir: Path | None = None) -> dict[str, str]:  # fmt: skip
    """The server's environment: the engine's (:func:`engine_env`), plus the development
    endpoints, which are safe only because the socket is private. ``rpc_dir``: where
    vLLM's own IPC sockets go (VLLM_RPC_BASE_PATH; not the temp directory, which may be a
    job-private TMPDIR gone by the time a checkpoint is restored: CRIU binds them again),
    unless the user set it or the path is too long for a socket name."""
    env = dict(os.environ if base is None else base)
    env.update(engine_env(settings))
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if rpc_dir is not None and "VLLM_RPC_BASE_PATH" not in env and rpc_dir_fits(rpc_dir):
        env["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    return env


def rpc_dir_fits(rpc_dir: Path) -> bool:
    """Whether vLLM's socket names under ``rpc_dir`` fit a Unix socket's 107 bytes."""
    return len(os.fsencode(rpc_dir)) <= RPC_BASE_MAX_BYTES


def installed_vllm_version() -> str:
    """vLLM's version from its package metadata (no import: importing vLLM takes seconds
    and this process never runs it)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise EngineError(
            "vLLM is not installed here (no vllm package metadata); it runs on a node with "
            f"a CUDA GPU: there, install it (`{pip_install_hint('vllm')}`"
            f"{not_yours_text(prefix_writable())}); without a GPU, "
            "try spswap on a model of its reference engine (`spswap models make --preset "
            "tiny DIR`, then `spswap serve DIR`)"
        ) from None


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self.socket_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def uds_request(
    path: Path, method: str, url: str, body: Any = None, *, timeout_s: float = 600.0
) -> tuple[int, Any]:
    """One HTTP request over the Unix socket ``path``; returns (status, JSON or text).
    The connection is closed before returning: nothing stays connected across a dump."""
    conn = _UnixHTTPConnection(path, timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, url, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return resp.status, raw.decode(errors="replace")


IN_FLIGHT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def requests_in_flight(metrics_text: str) -> int:
    """Running + waiting requests from vLLM's Prometheus ``/metrics`` text (summed over
    engines)."""
    total = 0.0
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in IN_FLIGHT_GAUGES:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return int(total)


class VllmApiServer:
    """One vLLM OpenAI server process on a private Unix socket, driven by spswap."""

    def __init__(
        self, model_dir: Path, socket_dir: Path, settings: VllmSettings | None = None,
        user_args: Sequence[str] = (), *, log_path: Path | None = None,
        launcher: Sequence[str] | None = None,
    ) -> None:  # fmt: skip
        check_user_args(user_args)
        self.launcher = tuple(launcher) if launcher else default_launcher()
        self.model_dir = Path(model_dir)
        self.socket_dir = Path(socket_dir)
        self.uds = self.socket_dir / "vllm.sock"
        self.settings = settings or VllmSettings()
        self.user_args = list(user_args)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.sleep_s = 0.0  # the last sleep's seconds
        self.last_wake: WakeTimes | None = None
        self._slept_at: float | None = None  # monotonic time of the last level-2 sleep

    # -- process ------------------------------------------------------------------------
    def start(self, *, dummy: bool, timeout_s: float = 900.0,
              cancel: threading.Event | None = None) -> float:  # fmt: skip
        """Start the server and wait until ``/health`` answers; returns seconds. A set
        ``cancel`` (the run was told to stop) ends the wait with an EngineError."""
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.socket_dir, 0o700)  # the socket's only guard: the directory's mode
        if self.uds.exists():
            self.uds.unlink()
        argv = api_server_argv(self.model_dir, self.uds, self.settings, self.user_args,
                               dummy=dummy, tokenizer=has_tokenizer(self.model_dir),
                               launcher=self.launcher)  # fmt: skip
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        start = time.perf_counter()
        try:
            self.proc = subprocess.Popen(argv, env=api_server_env(self.settings,
                                                                  rpc_dir=self.socket_dir),
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        self.wait_ready(timeout_s, cancel)
        return time.perf_counter() - start

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> None:
        """Until ``/health`` answers 200; EngineError (with the log's tail) if the server
        exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"the vLLM server exited with {self.proc.returncode} while "
                                  f"starting{self._log_tail()}")  # fmt: skip
            if self.uds.exists():
                try:
                    status, _ = uds_request(self.uds, "GET", "/health", timeout_s=5.0)
                    if status == 200:
                        return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise EngineError(f"the vLLM server did not answer /health within {timeout_s:.0f}"
                                  f" s{self._log_tail()}")  # fmt: skip
            if cancel is not None and cancel.is_set():
                raise StopRequested("stopped while the vLLM server was starting")
            time.sleep(READY_POLL_S)

    def _log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"; last lines of {self.log_path}:\n" + "\n".join(tail)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the socket file is removed."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.uds.exists():
            self.uds.unlink()

    # -- control ------------------------------------------------------------------------
    def call(self, method: str, url: str, body: Any = None, timeout_s: float = 600.0) -> Any:
        status, data = uds_request(self.uds, method, url, body, timeout_s=timeout_s)
        if status != 200:
            raise EngineError(f"vLLM server {method} {url} answered {status}: {str(data)[:500]}")
        return data

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        """``collective_rpc`` of a worker-extension method; rank 0's dict."""
        data = self.call("POST", "/collective_rpc", {"method": method, "args": list(args)})
        results = (data or {}).get("results") if isinstance(data, dict) else None
        tp = self.settings.tensor_parallel_size
        if not isinstance(results, list) or len(results) != tp or not all(
                isinstance(r, dict) for r in results):  # fmt: skip
            raise EngineError(
                f"collective_rpc({method!r}) answered {str(data)[:300]}: expected "
                f"one dict per rank ({tp}); is the worker extension loaded?"
            )
        return dict(results[0])

    def sleep(self) -> float:
        """Level-2 sleep (weights and KV cache freed); in-flight requests are aborted
        (their clients see an error and retry). Returns seconds."""
        t0 = time.perf_counter()
        self.call("POST", "/sleep?" + urlencode({"level": 2, "mode": "abort"}))
        self.sleep_s = time.perf_counter() - t0
        self._slept_at = time.monotonic()
        return self.sleep_s

    def wake(self) -> dict[str, Any]:
        """The one wake sequence (:func:`spswap.engines.vllm_wake.wake`) through the
        server's endpoints. Returns the copy's report (a TransferReport dict);
        :attr:`last_wake` holds the breakdown."""
        self.last_wake = wake(self, prefix_caching=self.settings.enable_prefix_caching,
                              slept_at=self._slept_at)  # fmt: skip
        return self.last_wake.copy

    # the calls a wake is made of (vllm_wake.WakeOps), as development endpoints
    def wake_up(self, tags: list[str]) -> None:
        self.call("POST", "/wake_up?" + urlencode({"tags": tags}, doseq=True))

    def reset_prefix_cache(self) -> None:
        self.call("POST", "/reset_prefix_cache")

    def in_flight(self) -> int | None:
        """Requests the engine is running or has queued (from ``/metrics``); None when the
        server does not say."""
        try:
            status, data = uds_request(self.uds, "GET", "/metrics", timeout_s=5.0)
        except OSError:
            return None
        if status != 200 or not isinstance(data, str):
            return None
        return requests_in_flight(data)

    def is_sleeping(self) -> bool:
        data = self.call("GET", "/is_sleeping")
        return bool(isinstance(data, dict) and data.get("is_sleeping"))
