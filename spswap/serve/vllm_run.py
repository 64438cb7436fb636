"""``spswap serve MODEL --engine vllm -- <vllm args>``: vLLM's OpenAI server inside a Slurm
job, its weights kept in the node's pool.

Life of a run:
  1. reserve a slot on the job's GPU (FIFO behind whoever holds it);
  2. find the model's weights in the pool *as vLLM holds them* (same vLLM version, dtype,
     parallel layout and config, exported by this user or root): if there, start the
     server with dummy weights and fill them from the pool (no disk read); else start it
     from the checkpoint files and export its weights to the pool once (a user's export
     goes through spswapd), for every later start;
  3. serve on a private Unix socket (see :mod:`spswap.serve.vllm_api`), and with a port
     on an authenticated TCP front (:mod:`spswap.serve.http_front`), until told to stop;
     ``endpoint.json`` in the state directory says where;
  4. on the preemption signal (USR1) or SIGTERM, with spswapd running: close the TCP
     front, sleep the server (level 2), release the slot and park: spswapd CUDA-checkpoints
     and CRIU-dumps this process with the server's whole tree and requeues the job; the
     requeued run asks spswapd to restore it and stands in for it, and the restored
     process wakes the server (weights from the pool) and serves on. Without spswapd, or
     when the dump fails: stop the server, release the slot, ask for the requeue (USR1),
     exit; the requeued run starts from the pool.

Signal handlers only set a flag; the loop does the work.
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

from spswap.config import Config
from spswap.engines.vllm_engine import VllmSettings, engine_identity, find_entry
from spswap.errors import EngineError, StopRequested
from spswap.fsutil import atomic_write_json
from spswap.serve.checkpointer import not_coming_back, restored_how
from spswap.serve.run_log import RunPath, note_run
from spswap.serve.slot_hold import RunSlot, StopSignals
from spswap.serve.vllm_api import VllmApiServer, installed_vllm_version, rpc_dir_fits

ENDPOINT_FILE = "endpoint.json"
API_KEY_FILE = "api_key"


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


class VllmServe(StopSignals):
    """One run of the vLLM server; construct, then :meth:`run`."""

    def __init__(
        self, cfg: Config, opts: VllmServeOptions, *, job_id: str | None = None,
        restart_count: int = 0, requeue: Callable[[str], None] | None = None,
        pool: Any = None, log: Callable[[str], None] = print, vllm_version: str | None = None,
        checkpointer: Any = None,
    ) -> None:  # fmt: skip
        from spswap.access import PoolAccess

        self.cfg = cfg
        self.opts = opts
        self.job_id = job_id
        self.restart_count = restart_count
        self.requeue = requeue
        self.log = log
        self.vllm_version = vllm_version  # None: the installed vLLM's
        self.checkpointer = checkpointer  # DaemonCheckpointer: stops dump, requeues restore
        self.pool = pool if pool is not None else PoolAccess(cfg, job_id=job_id)
        self.server = VllmApiServer(
            opts.model, opts.state_dir / "sock", opts.settings, opts.vllm_args,
            log_path=opts.state_dir / "vllm.log", launcher=opts.launcher or None,
        )  # fmt: skip
        if "VLLM_RPC_BASE_PATH" not in os.environ and not rpc_dir_fits(opts.state_dir / "sock"):
            log(f"spswap serve: {opts.state_dir} is too long a path for vLLM's IPC sockets "
                "(over 70 bytes with /sock): they stay in the temp directory, which a "
                "checkpoint's restore needs again; use a shorter --state-dir")  # fmt: skip
        super().__init__(RunSlot(cfg, model=opts.model.name, units=opts.units,
                                 gpus=opts.slot_gpus, job_id=job_id,
                                 timeout_s=opts.slot_timeout_s))  # fmt: skip
        self._uses = contextlib.ExitStack()
        self.front: Any = None
        self.http_url: str | None = None
        self._digest = ""
        from spswap.instance.registry import InstanceRegistry

        self.registry = InstanceRegistry(cfg.paths.run / "instances")
        self.instance_id = f"{job_id or 'local'}-{os.getpid()}"
        self.reason: str | None = None  # why this run started cold, when it did

    # -- the run ----------------------------------------------------------------------
    @functools.cached_property
    def version(self) -> str:
        """The served vLLM's version: as given, else the installed package's."""
        return self.vllm_version or installed_vllm_version()

    def identity(self) -> dict[str, Any]:
        """What a pool entry must match to fill this server's weights."""
        return engine_identity(self.opts.model, self.opts.settings, self.version)

    def run(self) -> dict[str, Any]:
        """Serve until stopped or the server ends; returns a summary (see module doc)."""
        opts = self.opts
        from spswap.fsutil import make_private_dirs

        # the server's socket (with its development endpoints) lives here: no one else
        # may be able to swap the directory, or a part above it, for their own
        make_private_dirs(opts.state_dir, os.getuid())
        result: dict[str, Any] = {"restart_count": self.restart_count, "stopped_by": None}
        identity = self.identity()  # a clear error before any slot is taken
        # this process holds the pool entry's use (via spswapd for a user); the worker maps it
        self._uses = contextlib.ExitStack()
        proxied = False
        try:
            self.slot.reserve(self.stop_signal)
            if self.restart_count and self.checkpointer is not None and self.job_id:
                proxied = self._restore_and_proxy(identity, result)
                if proxied:
                    return result
            result.update(self._start(identity))
            self._digest = str(result["digest"])
            self._open_front()
            self._write_endpoint()
            self._record("up")
            note_run(opts.state_dir, self.restart_count,
                     RunPath.POOL if result["from"] == "pool" else RunPath.COLD,
                     reason=self.reason, log=self.log)  # fmt: skip
            self.log(f"spswap serve: {opts.model.name} up ({result['from']}) in "
                     f"{result['start_s']:.1f} s; OpenAI API on unix:{self.server.uds}")
            while True:
                self._wait_for_stop()
                result["stopped_by"] = self.stop_signal
                result["drain"] = self._drain()
                if self.checkpointer is None or not self.job_id or not_coming_back(
                        self.job_id, self.stop_signal, self.restart_count, log=self.log) \
                        or not self._park(result):  # fmt: skip
                    break
        except StopRequested as e:  # stopped before anything served: a clean end
            result["stopped_by"] = self.stop_signal
            self.log(f"spswap serve: {e}; nothing to save")
        finally:
            self._end(result, proxied)
        return result

    def _end(self, result: dict[str, Any], proxied: bool) -> None:
        """Everything a run gives back, each step on its own (one failing, e.g. spswapd
        gone, must not skip the others), the requeue last: also after an error, a
        preempted job that is not requeued is lost work (a proxy's restored process asked
        for its own requeue when it parked)."""
        def stop_server() -> None:
            t0 = time.perf_counter()
            self.server.stop()
            result["stop_s"] = time.perf_counter() - t0

        steps: list[tuple[str, Any]] = []
        if not proxied:  # the restored process owns the server (and its socket)
            if self.front is not None:
                steps.append(("stop the TCP front", self.front.stop))
            steps.append(("stop the vLLM server", stop_server))
            steps.append(("drop the instance record",
                          lambda: self.registry.remove(self.instance_id)))  # fmt: skip
        steps += [
            ("release the GPU slot", self.slot.release),
            ("release the pool entry", self._uses.close),
            ("remove endpoint.json",
             lambda: (self.opts.state_dir / ENDPOINT_FILE).unlink(missing_ok=True)),
        ]  # fmt: skip
        if self.stop_signal == "SIGUSR1" and self.job_id and self.requeue and not proxied:
            job_id, requeue = self.job_id, self.requeue
            steps.append(("ask for the requeue", lambda: requeue(job_id)))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - logged; never hides the run's own error
                self.log(f"spswap serve: could not {what} ({e})")

    def _drain(self) -> dict[str, Any]:
        """At a stop: the TCP front takes no new connection, and requests already running
        (through the front or the socket) get ``drain_s`` to finish before the sleep or
        the stop aborts them (preemption's GraceTime must cover this and the dump)."""
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
        return {"waited_s": waited_s, "aborted": left}

    def _wait_for_stop(self) -> None:
        while not self.stop_event.wait(self.opts.poll_interval_s):
            proc = self.server.proc
            if proc is not None and proc.poll() is not None:
                raise EngineError(f"the vLLM server exited with {proc.returncode}; see "
                                  f"{self.server.log_path}")  # fmt: skip

    # -- checkpoint (CUDA checkpoint + CRIU, by spswapd) --------------------------------
    def checkpoint_identity(self, digest: str) -> dict[str, str]:
        """What this run names of itself at a dump and expects at a restore."""
        from spswap.checkpoint.images import config_hash, process_identity

        cfg_hash = config_hash({
            "engine": "vllm", "model": str(self.opts.model),
            "settings": self.opts.settings.to_json(), "vllm_args": list(self.opts.vllm_args),
            "launcher": list(self.opts.launcher),
        })  # fmt: skip
        return process_identity(engine="vllm", engine_version=self.version, model_digest=digest,
                                config_hash=cfg_hash)  # fmt: skip

    def _park(self, result: dict[str, Any]) -> bool:
        """Sleep the server and have spswapd dump this process tree (server included).
        True when a later run restored it (serving goes on here); False when the dump
        failed (the caller stops the server, as without a checkpointer)."""
        from spswap.errors import SpswapError
        from spswap.serve.checkpointer import ParkOutcome

        assert self.checkpointer is not None and self.job_id is not None
        if self.front is not None:  # a dump cannot keep client connections
            self.front.stop()
            self.front = None
        # endpoint.json exists while the run serves: not while parked or dumped
        (self.opts.state_dir / ENDPOINT_FILE).unlink(missing_ok=True)
        try:
            self.server.sleep()
        except (SpswapError, OSError) as e:  # the server is stopped by the caller
            result["checkpoint"] = {"state": "failed", "reason": f"sleep failed: {e}"}
            self.log(f"spswap serve: the server did not sleep ({e}); not checkpointed")
            return False
        try:
            result["trim"] = self.server.rpc("spswap_trim")
        except (SpswapError, OSError) as e:  # only a smaller image is lost
            self.log(f"spswap serve: could not trim the GPU memory before the dump ({e})")
        self.slot.release()
        self._record("checkpoint")
        requeue = self.stop_signal == "SIGUSR1"
        try:
            outcome = self.checkpointer.park(self.job_id, self.checkpoint_identity(self._digest),
                                             requeue=requeue)  # fmt: skip
        except (SpswapError, OSError) as e:
            outcome = ParkOutcome("failed", reason=str(e))
        if outcome.state != "restored":
            result["checkpoint"] = {"state": "failed", "reason": outcome.reason}
            self.log(f"spswap serve: no checkpoint image ({outcome.reason}); the next run "
                     "starts from the pool")  # fmt: skip
            return False
        # Restored into a later run of the job (its proxy holds the slot now).
        self.restart_count = outcome.restart_count
        self.clear_stop()
        t0 = time.perf_counter()
        copy = self.server.wake()
        wake_s = time.perf_counter() - t0
        self._open_front()
        self._write_endpoint()
        self._record("up")
        result.update(restart_count=self.restart_count, stopped_by=None)
        result.setdefault("restores", []).append(
            {"timings_s": outcome.timings_s, "wake_s": wake_s, "copy": copy})
        self.log(f"spswap serve: restored {restored_how(outcome.kept)} into run "
                 f"{self.restart_count}; weights back in {wake_s:.3f} s")  # fmt: skip
        return True

    def _restore_and_proxy(self, identity: dict[str, Any], result: dict[str, Any]) -> bool:
        """In a requeued run: have spswapd restore the job's dumped server and stand in for
        it until it exits (forwarding signals); False when there is nothing to restore."""
        from spswap.errors import SpswapError
        from spswap.serve.checkpointer import stand_in_for

        assert self.checkpointer is not None and self.job_id is not None
        entry = find_entry(self.pool, identity)
        if entry is None:
            result["cold_reason"] = self.reason = ("cold start: the model's weights are not in "
                                                   "the pool")  # fmt: skip
            return False
        try:
            info = self.checkpointer.restore(self.job_id, self.checkpoint_identity(entry.digest),
                                             self.restart_count)  # fmt: skip
        except SpswapError as e:
            result["cold_reason"] = self.reason = f"cold start: {e}"
            self.log(f"spswap serve: {result['cold_reason']}")
            return False
        pid = int(info["pid"])
        result.update(restored_pid=pid, restore_timings_s=info.get("timings_s"))
        note_run(self.opts.state_dir, self.restart_count,
                 RunPath.KEPT if info.get("kept") else RunPath.IMAGE, log=self.log)
        how = restored_how(bool(info.get("kept")))
        self.log(f"spswap serve: job {self.job_id} restored {how} as pid {pid} "
                 f"({info.get('timings_s')}); standing in for it")  # fmt: skip
        result["stopped_by"] = stand_in_for(pid, lambda: self.stop_signal)
        if result["stopped_by"] is None:
            result["cold_reason"] = self.reason = (f"cold start: the restored server (pid "
                                                   f"{pid}) ended on its own")  # fmt: skip
            self.log(f"spswap serve: {result['cold_reason']}")
            return False
        return True

    def _start(self, identity: dict[str, Any]) -> dict[str, Any]:
        """Start from the pool when an entry fits, else from disk and export once."""
        server, pool = self.server, self.pool
        entry = find_entry(pool, identity)
        t0 = time.perf_counter()
        if entry is not None:
            self._uses.enter_context(pool.use(entry.digest))
            server.start(dummy=True, timeout_s=self.opts.start_timeout_s,
                         cancel=self.stop_event)
            with_pool = server.rpc("spswap_load", str(pool.pool_dir), entry.digest, False)
            return {"from": "pool", "digest": entry.digest, "start_s": time.perf_counter() - t0,
                    "copy": with_pool.get("copy")}  # fmt: skip
        server.start(dummy=False, timeout_s=self.opts.start_timeout_s, cancel=self.stop_event)
        digest = self._export(identity)
        self._uses.enter_context(pool.use(digest))
        server.rpc("spswap_attach", str(pool.pool_dir), digest, False)
        return {"from": "checkpoint", "digest": digest, "start_s": time.perf_counter() - t0}

    def _export(self, identity: dict[str, Any]) -> str:
        """The running server's weights into the pool, once; returns the entry's digest.
        Root writes the pool directly; a user's export is a private file that spswapd
        imports through its descriptor, stamped with the user's uid."""
        from spswap.access import privileged

        name = f"vllm-{self.opts.model.name}"
        layout = {k: v for k, v in identity.items() if k not in ("rank", "tp_size")}
        if privileged():
            layout["owner_uid"] = os.getuid()
            out = self.server.rpc("spswap_export", str(self.pool.pool_dir), name, layout)
            from spswap.pool.store import alias_key

            # found by this identity next time, even if the bytes were there already
            self.pool.remember_alias(alias_key(identity, os.getuid()), str(out["digest"]))
            return str(out["digest"])
        if self.opts.settings.tensor_parallel_size != 1:
            raise EngineError(
                "exporting a tensor-parallel engine's weights through spswapd is not supported "
                "yet: run with --tensor-parallel-size 1, or export once as root"
            )
        import shutil
        import tempfile

        # mkdtemp: a fresh 0700 directory no one else can rename or fill (in $TMPDIR,
        # job-private under many Slurm setups), so the file imported is the one written
        export_dir = Path(tempfile.mkdtemp(prefix="spswap-export-"))
        path = export_dir / f"{name}.safetensors"
        try:
            self.server.rpc("spswap_export_file", str(path))
            manifest = self.pool.import_checkpoint(path, name=name, identity=identity)
        finally:
            shutil.rmtree(export_dir, ignore_errors=True)
        return str(manifest.digest)

    def _open_front(self) -> None:
        """The opt-in TCP front, with a fresh API key in STATE_DIR/api_key."""
        if self.opts.http_port is None:
            return
        from spswap.serve.http_front import HttpFront, new_key

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
            self.log(f"spswap serve: could not listen on {self.opts.http_host}:"
                     f"{self.opts.http_port} again ({e}); serving on the Unix socket only")
            return
        self.front = front
        self.http_url = f"http://{self.opts.http_host}:{port}/v1"
        self.log(f"spswap serve: OpenAI API also on {self.http_url} (key in "
                 f"{self.opts.state_dir / API_KEY_FILE})")  # fmt: skip

    def _record(self, state: str) -> None:
        from spswap.instance.registry import InstanceRecord

        self.registry.put_best_effort(InstanceRecord(
            id=self.instance_id, model=self.opts.model.name, state=state, pid=os.getpid(),
            uid=os.getuid(), job_id=self.job_id, device="cuda", engine="vllm",
            reason=self.reason), self.log)  # fmt: skip

    def _write_endpoint(self) -> None:
        atomic_write_json(self.opts.state_dir / ENDPOINT_FILE, {
            "uds": str(self.server.uds), "http": self.http_url,
            "api_key_file": str(self.opts.state_dir / API_KEY_FILE) if self.http_url else None,
            "pid": os.getpid(),
            "server_pid": self.server.proc.pid if self.server.proc else None,
            "model": str(self.opts.model), "job_id": self.job_id,
        }, mode=0o600)  # fmt: skip
