"""``spswap serve MODEL --engine vllm -- <vllm args>``: vLLM's OpenAI server inside a Slurm
job, its weights kept in the node's pool.

The run itself (slot, restore or start, stop, park, release) is
:class:`spswap.serve.lifecycle.ServeRun`'s; this module is its :class:`Backend` for vLLM:
  - prepare: the state directory private (the server's socket, with its development
    endpoints, lives there), the engine's pool identity (a clear error before any slot);
  - start: find the model's weights in the pool *as vLLM holds them* (same vLLM version,
    dtype, parallel layout and config, exported by this user or root): if there, start
    the server with dummy weights and fill them from the pool (no disk read); else start
    it from the checkpoint files and export its weights to the pool once (a user's export
    goes through spswapd), for every later start; an eager server's weights are then
    packed into one allocation (:mod:`spswap.serve.weights_pack`). It serves on a private
    Unix socket (:mod:`spswap.serve.vllm_api`), and with a port on an authenticated TCP
    front (:mod:`spswap.serve.http_front`); ``endpoint.json`` in the state directory says
    where;
  - serve: until stopped (an EngineError when the server exits under it);
  - drain: the TCP front takes no new connection; running requests get ``drain_s``;
  - sleep: the front closed, the server asleep (level 2) and its GPU memory trimmed: then
    spswapd CUDA-checkpoints and CRIU-dumps this process with the server's whole tree;
  - wake: in the restored process, the server's weights back from the pool, the front
    open again.
Without spswapd, or when the dump fails, the server is stopped and the requeued run
starts from the pool.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spswap.access import PoolAccess
from spswap.checkpoint.images import config_hash, process_identity
from spswap.config import Config
from spswap.engines.host_heap import release_free_heap
from spswap.engines.vllm_engine import VllmSettings, engine_identity
from spswap.engines.vllm_identity import find_entry, use_found_entry
from spswap.errors import EngineError, PoolEntryNotFound, SpswapError
from spswap.fsutil import atomic_write_json, make_private_dirs
from spswap.serve import restore_check
from spswap.serve.backend import Log, ServeResult
from spswap.serve.checkpointer import DaemonCheckpointer
from spswap.serve.http_front import HttpFront, new_key, port_taken
from spswap.serve.lifecycle import ServeRun, run_steps
from spswap.serve.run_log import RunPath
from spswap.serve.slot_hold import RunSlot, StopSignals
from spswap.serve.spool_ask import VLLM_ENDPOINT_FILE, VLLM_LOG_FILE
from spswap.serve.vllm_api import VllmApiServer, installed_vllm_version, rpc_dir_fits
from spswap.serve.vllm_export import export_weights
from spswap.serve.weights_pack import pack_line, pack_logged, pack_skipped, pack_slot_share
from spswap.units import fmt_bytes

ENDPOINT_FILE = VLLM_ENDPOINT_FILE  # (where `spswap ask --job` looks for it too)
PROBE_TIMEOUT_S = 5.0
API_KEY_FILE = "api_key"
HEAP_NOTE_BYTES = 64 << 20  # a heap release this large is logged before the dump


@dataclass
class VllmServeOptions:
    """What ``spswap serve --engine vllm`` was asked to do."""

    model: Path
    state_dir: Path  # the server's socket, log and endpoint.json live here (mode 0700)
    settings: VllmSettings = field(default_factory=VllmSettings)
    vllm_args: tuple[str, ...] = ()
    units: int = 4
    slot_gpus: tuple[int, ...] = ()
    slot_timeout_s: float = 600.0
    start_timeout_s: float = 900.0
    poll_interval_s: float = 0.2
    # the command that runs vLLM's OpenAI server module (default: this Python, -m the
    # module); e.g. a container wrapper: ("apptainer", "exec", "--nv", IMG, "python3", "-m", ...)
    launcher: tuple[str, ...] = ()
    http_port: int | None = None  # opt-in TCP front with an API key (0: any free port)
    http_host: str = "127.0.0.1"
    # at a stop: no new requests; those running get this long to finish, then are aborted
    drain_s: float = 5.0
    pack: bool = True  # (eager) the weights packed into one allocation once up (--no-pack)


class VllmBackend:
    """vLLM's OpenAI server's side of a run (see the module doc)."""

    engine = "vllm"
    device = "cuda"
    probe_at_start = True  # one model, idle at its start: the check with log-probabilities
    checks_several = False

    def __init__(self, cfg: Config, opts: VllmServeOptions, *, job_id: str | None,
                 stop: StopSignals, pool: Any, log: Log,
                 vllm_version: str | None) -> None:  # fmt: skip

        self.opts, self.stop, self.log, self.job_id = opts, stop, log, job_id
        self.state_dir = opts.state_dir
        self.vllm_version = vllm_version  # None: the installed vLLM's
        self.pool = pool if pool is not None else PoolAccess(cfg, job_id=job_id)
        self.server = VllmApiServer(
            opts.model, opts.state_dir / "sock", opts.settings, opts.vllm_args,
            log_path=opts.state_dir / VLLM_LOG_FILE, launcher=opts.launcher or None,
        )  # fmt: skip
        if "VLLM_RPC_BASE_PATH" not in os.environ and not rpc_dir_fits(opts.state_dir / "sock"):
            log(f"spswap serve: {opts.state_dir} is too long a path for vLLM's IPC sockets "
                "(over 70 bytes with /sock): they stay in the temp directory, which a "
                "checkpoint's restore needs again; use a shorter --state-dir")  # fmt: skip
        # this process holds the pool entry's use (via spswapd for a user); the worker maps it
        self._uses = contextlib.ExitStack()
        self.front: Any = None
        self.http_url: str | None = None
        self._digest = ""  # the pool entry the server's weights came from
        self.restart_count = 0
        self.damaged: str | None = None  # what check_pool found wrong with the entry
        self.reachable = False  # the TCP front and endpoint.json are there (see serve)

    @functools.cached_property
    def version(self) -> str:
        """The served vLLM's version: as given, else the installed package's."""
        return self.vllm_version or installed_vllm_version()

    def identity(self) -> dict[str, Any]:
        """What a pool entry must match to fill this server's weights."""
        return engine_identity(self.opts.model, self.opts.settings, self.version)

    # -- the backend --------------------------------------------------------------------
    def prepare(self, result: ServeResult) -> None:
        self.restart_count = result.restart_count
        # the server's socket (with its development endpoints) lives here: no one else
        # may be able to swap the directory, or a part above it, for their own
        make_private_dirs(self.opts.state_dir, os.getuid())
        self.identity()  # a clear error before any slot is taken
        port = self.opts.http_port
        # a first run's port is free now or fails the job now, not after the model loads
        # (a later run's restored instance may hold it already)
        if port and result.restart_count == 0:
            taken = port_taken(self.opts.http_host, port)
            if taken is not None:
                raise EngineError(f"--port {port}: {taken}; choose another port, or --port 0 "
                                  "for a free one (endpoint.json names it)")  # fmt: skip

    def checkpoint_identity(self) -> dict[str, str]:
        digest = self._digest
        if not digest:  # a requeued run, before it started anything: the pool's entry
            entry = find_entry(self.pool, self.identity())
            if entry is None:
                raise PoolEntryNotFound("the model's weights are not in the pool")
            digest = entry.digest
        cfg_hash = config_hash({
            "engine": "vllm", "model": str(self.opts.model),
            "settings": self.opts.settings.to_json(), "vllm_args": list(self.opts.vllm_args),
            "launcher": list(self.opts.launcher),
        })  # fmt: skip
        return process_identity(engine="vllm", engine_version=self.version, model_digest=digest,
                                config_hash=cfg_hash)  # fmt: skip

    def start(self, result: ServeResult) -> RunPath:
        """From the pool when an entry fits, else from disk and export once."""
        server, pool, opts = self.server, self.pool, self.opts
        if self.damaged is not None:  # never serve from it, nor export over it
            raise SpswapError(f"not started: {self.damaged}")
        identity = self.identity()
        t0 = time.perf_counter()
        entry, damaged = use_found_entry(pool, identity, self._uses)
        if damaged is not None:
            self.log(f"spswap serve: {damaged}")
        if entry is not None:
            server.start(dummy=True, timeout_s=opts.start_timeout_s, cancel=self.stop.stop_event)
            loaded = server.rpc("spswap_load", str(pool.pool_dir), entry.digest, False)
            self._digest, result.copy, path = entry.digest, loaded.get("copy"), RunPath.POOL
        else:
            server.start(dummy=False, timeout_s=opts.start_timeout_s, cancel=self.stop.stop_event)
            self._digest = export_weights(server, pool, identity, opts.model.name,
                                          opts.settings.tensor_parallel_size)  # fmt: skip
            self._uses.enter_context(pool.use(self._digest))
            server.rpc("spswap_attach", str(pool.pool_dir), self._digest, False)
            path = RunPath.COLD
        result.digest = self._digest
        skipped = pack_skipped(opts.settings.enforce_eager, opts.pack)
        if skipped is None:
            pack = functools.partial(server.rpc, "spswap_pack")
            result.pack = pack_logged(pack, opts.model.name, pack_slot_share(opts.units),
                                      self.log)  # fmt: skip
        else:
            result.pack = {"packed": False, "why": skipped}
            self.log(pack_line(opts.model.name, result.pack))
        self._reach()
        self.log(
            f"spswap serve: {opts.model.name} up ({path.value}) in "
            f"{time.perf_counter() - t0:.1f} s; OpenAI API on unix:{server.uds}"
        )
        return path

    def serve(self, result: ServeResult) -> None:
        if not self.reachable and not self.stop.stop_event.is_set():
            self._reach()  # restored: reachable again only once the check has passed
        while not self.stop.stop_event.wait(self.opts.poll_interval_s):
            proc = self.server.proc
            if proc is not None and proc.poll() is not None:
                raise EngineError(f"the vLLM server exited with {proc.returncode}; see "
                                  f"{self.server.log_path}")  # fmt: skip

    def drain(self, result: ServeResult) -> None:
        """The TCP front takes no new connection, and requests already running (through
        the front or the socket) get ``drain_s`` to finish before the sleep or the stop
        aborts them (preemption's GraceTime must cover this and the dump)."""
        t0 = time.monotonic()
        if self.front is not None:
            self.front.stop_accepting()
        left = 0
        while True:
            # a request through the front is counted by both: the larger count is the best
            # guess (the engine's alone misses a front connection still sending its body)
            engine = self.server.in_flight() or 0
            left = max(self.front.active() if self.front is not None else 0, engine)
            if left == 0 or time.monotonic() - t0 >= self.opts.drain_s:
                break
            time.sleep(0.1)
        waited_s = time.monotonic() - t0
        if left:
            self.log(f"spswap serve: {left} request(s) still running after {waited_s:.1f} s "
                     "of draining: aborted (their clients see an error and retry)")  # fmt: skip
        result.drain = {"waited_s": waited_s, "aborted": left}

    def sleep(self) -> None:
        if self.front is not None:  # a dump cannot keep client connections
            self.front.stop()
            self.front = None
        # endpoint.json exists while the run serves: not while parked or dumped
        (self.opts.state_dir / ENDPOINT_FILE).unlink(missing_ok=True)
        self.reachable = False
        self.server.sleep()
        try:
            trimmed = self.server.rpc("spswap_trim")
        except (SpswapError, OSError) as e:  # only a smaller image is lost
            self.log(f"spswap serve: could not trim the GPU memory before the dump ({e})")
        else:
            released = int(trimmed.get("heap_released_bytes") or 0)
            if released >= HEAP_NOTE_BYTES:  # worth a line: the image is that much smaller
                self.log(f"spswap serve: the engine gave back {fmt_bytes(released)} of freed "
                         "heap before the dump")  # fmt: skip
        release_free_heap()  # spswap serve's own process is dumped with the server

    def wake(self, result: ServeResult) -> dict[str, Any]:
        self.restart_count = result.restart_count
        copy = self.server.wake()  # (reachable again in serve(), after the check)
        return {"copy": copy}

    def probe(self, like: restore_check.CheckAnswer | None = None,
              ) -> restore_check.CheckAnswer | None:  # fmt: skip
        """vLLM's greedy answer to the check prompt, through its socket (the server is up,
        its fronts aside, when first up and after a wake): 2 tokens with the
        log-probabilities of the prompt's tokens and of its own where the engine runs
        nothing else (``like`` None: the first answer) or ran nothing else then (``like``
        has them), else 8 tokens alone (:func:`probe_request`)."""
        if like is None:  # a request still running would share the batch, and vLLM's
            # log-probabilities are not batch-invariant; tokens are.
            # With --kv-sharing-fast-prefill vLLM's model runner asserts on any request
            # for prompt log-probabilities: the engine would die of the check.
            fast_prefill = any(a.split("=", 1)[0] == "--kv-sharing-fast-prefill"
                               for a in self.opts.vllm_args)  # fmt: skip
            logprobs = not fast_prefill and self.server.in_flight() == 0
        else:
            logprobs = bool(like.logprobs)
        # a few tens of ms on a GPU; bounded: after a restore it is on the swap's path
        data = self.server.call("POST", "/v1/completions", probe_request(logprobs=logprobs),
                                timeout_s=PROBE_TIMEOUT_S)  # fmt: skip
        return probe_answer(data, logprobs=logprobs)

    def check_pool(self) -> str | None:
        entry = find_entry(self.pool, self.identity())
        problem = self.pool.check(entry.digest) if entry is not None else None
        if problem is None:
            return None
        if find_entry(self.pool, self.identity()) is not None:  # not removed: never read it
            self.damaged = problem
            return problem
        return f"{problem}; this run starts from the model's files and exports it again"

    def left_undone(self) -> str | None:
        return "its server was to serve until stopped"

    def close(self, result: ServeResult, *, served: bool) -> None:
        def stop_server() -> None:
            t0 = time.perf_counter()
            self.server.stop()
            result.stop_s = time.perf_counter() - t0

        steps: list[tuple[str, Callable[[], Any]]] = []
        if served:  # else the restored process owns the server (and its socket)
            if self.front is not None:
                steps.append(("stop the TCP front", self.front.stop))
            steps.append(("stop the vLLM server", stop_server))
        steps += [
            ("release the pool entry", self._uses.close),
            ("remove endpoint.json",
             lambda: (self.opts.state_dir / ENDPOINT_FILE).unlink(missing_ok=True)),
        ]  # fmt: skip
        run_steps(steps, self.log)

    # -- the ways in --------------------------------------------------------------------
    def _reach(self) -> None:
        """The TCP front (if asked for) and endpoint.json: how clients find the run."""
        self._open_front()
        self._write_endpoint()
        self.reachable = True

    def _open_front(self) -> None:
        """The opt-in TCP front, with a fresh API key in STATE_DIR/api_key."""
        if self.opts.http_port is None:
            return

        key = new_key(self.opts.state_dir / API_KEY_FILE)
        front = HttpFront(self.server.uds, key, self.opts.http_host, self.opts.http_port)
        try:
            port = front.start()
        except OSError as e:
            if self.restart_count == 0 or self._digest == "":
                raise
            # after a restore the port may have been taken meanwhile: a good restore is
            # not thrown away for it; the Unix socket still serves
            self.http_url = None
            self.log(
                f"spswap serve: could not listen on {self.opts.http_host}:"
                f"{self.opts.http_port} again ({e}); serving on the Unix socket only"
            )
            return
        self.front = front
        self.http_url = f"http://{self.opts.http_host}:{port}/v1"
        self.log(f"spswap serve: OpenAI API also on {self.http_url} (key in "
                 f"{self.opts.state_dir / API_KEY_FILE})")  # fmt: skip

    def _write_endpoint(self) -> None:
        atomic_write_json(self.opts.state_dir / ENDPOINT_FILE, {
            "uds": str(self.server.uds), "http": self.http_url,
            "api_key_file": str(self.opts.state_dir / API_KEY_FILE) if self.http_url else None,
            "pid": os.getpid(),
            "server_pid": self.server.proc.pid if self.server.proc else None,
            "model": str(self.opts.model), "job_id": self.job_id,
        }, mode=0o600)  # fmt: skip


def vllm_run(
    cfg: Config, opts: VllmServeOptions, *, job_id: str | None = None, restart_count: int = 0,
    requeue: Callable[[str], None] | None = None, pool: Any = None, log: Log = print,
    vllm_version: str | None = None, checkpointer: DaemonCheckpointer | None = None,
) -> ServeRun[VllmBackend]:  # fmt: skip
    """A run of vLLM's server (``run.backend`` is its :class:`VllmBackend`); then
    ``install_signal_handlers()`` and ``run()``."""
    stop = StopSignals(RunSlot(cfg, model=opts.model.name, units=opts.units,
                               gpus=opts.slot_gpus, job_id=job_id,
                               timeout_s=opts.slot_timeout_s))  # fmt: skip
    backend = VllmBackend(cfg, opts, job_id=job_id, stop=stop, pool=pool, log=log,
                          vllm_version=vllm_version)  # fmt: skip
    return ServeRun(cfg, backend, stop, model_name=opts.model.name, job_id=job_id,
                    restart_count=restart_count, requeue=requeue, checkpointer=checkpointer,
                    log=log)  # fmt: skip


def probe_request(*, logprobs: bool) -> dict[str, Any]:
    """The check prompt's request to vLLM's completions endpoint: greedy, the token ids
    back, no model named (the server's own, whatever ``--served-model-name`` says); with
    ``logprobs`` 2 tokens and (``echo`` with ``logprobs`` 0) the log-probability of each
    prompt token after the first and of each answer token, named by id (the server may
    have no tokenizer), else 8 tokens."""
    body: dict[str, Any] = {"prompt": list(restore_check.PROBE_PROMPT), "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if not logprobs:
        return {**body, "max_tokens": restore_check.PROBE_TOKENS}
    return {**body, "max_tokens": restore_check.PROBE_TOKENS_WITH_LOGPROBS, "echo": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


def probe_answer(data: Any, *, logprobs: bool) -> restore_check.CheckAnswer:
    """The check's answer from the completions response to :func:`probe_request`: the
    answer's token ids (``token_ids``) and, asked ``logprobs``, the log-probabilities in
    ``logprobs.token_logprobs``: one per prompt token (the first's null) and per answer
    token. Raises :class:`EngineError` for any other shape: a check that silently lost
    its log-probabilities would be weaker than the one it replaced."""
    choice = data["choices"][0]
    token_ids = tuple(int(t) for t in choice["token_ids"])
    if not logprobs:
        return restore_check.CheckAnswer(token_ids)
    found = (choice.get("logprobs") or {}).get("token_logprobs")
    want = len(restore_check.PROBE_PROMPT) + len(token_ids)
    if (not isinstance(found, list) or len(found) != want or found[0] is not None
            or not all(isinstance(x, (int, float)) for x in found[1:])):  # fmt: skip
        raise EngineError(f"vLLM answered the check prompt without its {want - 1} log-"
                          f"probabilities (logprobs.token_logprobs: {found!r:.120})")  # fmt: skip
    return restore_check.CheckAnswer(token_ids, tuple(float(x) for x in found[1:]))
