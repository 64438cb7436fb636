"""The engine processes of a multi-model job: one :class:`ModelProc` per model, each a
``python -m spswap.multi.worker`` child spoken to over its stdin/stdout, one request at a
time (its own lock: a call on one model never waits for another model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.errors import EngineError, RequestRejected

ASK_CLOSE_WAIT_S = 1.0  # how long a close waits for a call in flight before it is written


@dataclass(frozen=True)
class ModelSpec:
    """One model of the job: its name (the requests' ``model``), directory, pool entry."""

    name: str
    path: Path
    digest: str


def no_model_text(model: str, served: Iterable[str]) -> str:
    """The refusal of a request for a model the job does not serve (HTTP 404; exact
    text: tests/multi/test_router.py)."""
    return (f"no model {model!r} in this job; it serves: {', '.join(served)} (each named by "
            "its directory's name; GET /v1/models lists them)")  # fmt: skip


def start_hint(error: str) -> str:
    """What to change when a vLLM engine did not start for lack of device memory."""
    if "memory" not in error.lower():
        return ""
    return (
        "; the awake models' shares must fit the device together: lower --kv-cache-gib "
        "or --gpu-memory-utilization, or serve fewer awake (--awake, --units)"
    )


class ModelProc:
    """One model's engine process."""

    def __init__(self, spec: ModelSpec, *, engine: str, device: str, root: Path,
                 job_id: str | None = None, settings: dict[str, Any] | None = None,
                 vllm_args: str = "", wait_go: bool = False, cold: bool = False,
                 pack_slot_share: float | None = None) -> None:  # fmt: skip
        """``settings``/``vllm_args``: the vLLM engine's; ``wait_go``: the process
        imports its engine, then loads only at :meth:`go`; ``cold``: from the model's
        files, not the pool (a cold answer to compare with); ``pack_slot_share``: (vLLM)
        pack the weights once up, the second copy inside that share of the GPU (the
        model's units) beside what the engine holds."""
        self.spec = spec
        self._lock = threading.Lock()
        argv = [sys.executable, "-m", "spswap.multi.worker", "--name", spec.name,
                "--model", str(spec.path), "--digest", spec.digest, "--engine", engine,
                "--device", device, "--root", str(root)]  # fmt: skip
        if job_id:
            argv += ["--job-id", job_id]
        if settings is not None:
            argv += ["--settings", json.dumps(settings)]
        if vllm_args:
            argv += ["--vllm-args", vllm_args]
        argv += ["--wait-go"] if wait_go else []
        argv += ["--cold"] if cold else []
        if pack_slot_share is not None:
            argv += ["--pack-slot-share", str(pack_slot_share)]
        env = dict(os.environ)
        env.setdefault("SPSWAP_CPU_THREADS", "1")
        # A session of its own: a Ctrl-C at the job's terminal (SIGINT to its process
        # group) reaches the router, which stops the job and closes its engines, not the
        # engine processes, which would die of it on their own (vLLM's set their own
        # handler for it). Slurm signals a job's processes by its cgroup, not by group.
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env, bufsize=1,
                                      start_new_session=True)  # fmt: skip
        self.load_s: float | None = None
        self.hello: dict[str, Any] = {}  # the start's answer: load_s, from, digest

    @property
    def pid(self) -> int:
        return self._proc.pid

    def go(self) -> None:
        """A process started with ``wait_go``: load the model now."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write('{"op": "go"}\n')
            self._proc.stdin.flush()
        except OSError as e:
            raise EngineError(self._gone(f"({e})")) from None

    def wait_ready(self) -> float:
        """Wait for the model to be up (from the pool, or cold and exported); returns its
        load seconds (:attr:`hello` has where it came from)."""
        hello = self._read()
        if not hello.get("ok"):
            error = str(hello.get("error"))
            raise EngineError(f"model {self.spec.name} ({self.spec.path}) did not start: "
                              f"{error}{start_hint(error)}")  # fmt: skip
        self.hello = hello
        self.load_s = float(hello["load_s"])
        return self.load_s

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request to the engine; an answer with ``ok`` false raises EngineError."""
        with self._lock:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
                self._proc.stdin.flush()
            except OSError as e:
                raise EngineError(self._gone(f"({e})")) from None
            answer = self._read()
        if not answer.get("ok") and answer.get("rejected"):
            raise RequestRejected(f"model {self.spec.name}: {answer.get('error')}")
        if not answer.get("ok"):
            raise EngineError(f"model {self.spec.name}: {answer.get('error')}")
        return answer

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise EngineError(self._gone(""))
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _gone(self, detail: str) -> str:
        code = self._proc.poll()
        return (f"model {self.spec.name}'s engine process (pid {self._proc.pid}) ended"
                f"{f' with status {code}' if code is not None else ''} {detail}; its log "
                "is on the job's stderr").replace("  ", " ")  # fmt: skip

    def ask_close(self) -> None:
        """Ask the engine to close (it may take seconds: :meth:`close` waits for it).
        A call still waiting for its answer (one longer than the stop's drain) holds the
        lock: after :data:`ASK_CLOSE_WAIT_S` the close is written anyway (that call's
        request is written already; the engine reads the close after answering it)."""
        if self._proc.poll() is not None or self._proc.stdin is None or self._proc.stdin.closed:
            return
        locked = self._lock.acquire(timeout=ASK_CLOSE_WAIT_S)
        try:
            self._proc.stdin.write('{"op": "close"}\n')
            self._proc.stdin.close()
        except (OSError, ValueError):  # gone already, or closed by the other thread
            pass
        finally:
            if locked:
                self._lock.release()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to close, then end the process (killed after ``timeout_s``)."""
        self.ask_close()
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout):
            if f is not None:
                try:
                    f.close()
                except (OSError, ValueError):  # (a close that hit a broken pipe)
                    pass


def close_all(procs: Iterable[ModelProc], timeout_s: float) -> None:
    """End every engine process, all asked at once: a job's stop waits for the slowest
    engine, not for their sum (each takes a second or more to exit, and Slurm's KillWait
    leaves the whole job a few seconds). Each is killed ``timeout_s`` after the asking."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.ask_close()
    for proc in procs:
        proc.close(max(0.0, deadline - time.monotonic()))
