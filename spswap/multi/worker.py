"""One model's engine process of a multi-model job: ``python -m spswap.multi.worker``.

It loads its model once (from the pool; a vLLM model with no pool entry of its identity
yet from its files, then exported: :mod:`spswap.multi.vllm_start`; with ``--wait-go``
only once the router says so, after importing its engine), then obeys one JSON request
per line on stdin (``sleep``, ``wake``, ``generate``, ``health``, ``trim``, ``close``)
with one JSON answer per line
on the stdout it started with (anything else the engine prints goes to stderr). An
error in a request is an answer (``{"ok": false, "error": ...}``), never an exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from spswap.access import PoolAccess
from spswap.config import Config
from spswap.engines.host_heap import release_free_heap
from spswap.engines.protocol import Engine
from spswap.engines.vllm_engine import VllmEngine, VllmSettings
from spswap.errors import RequestRejected, SpswapError
from spswap.multi.engine_settings import check_engine, settings_from_json
from spswap.multi.vllm_start import llm_overrides, start_engine
from spswap.serve.weights_pack import pack_logged


def make_engine(kind: str, model: Path, device: str, name: str,
                settings: VllmSettings | None = None) -> Engine:  # fmt: skip
    """A fresh engine of ``kind`` for ``model``; torch (and vLLM) are imported here."""
    check_engine(kind, device)
    if kind == "reference":
        from spswap.engines.reference import ReferenceEngine, load_config

        return ReferenceEngine(load_config(model), device, name=name)
    import vllm  # noqa: F401 - before the router's go: engines import at once, start in turn

    return VllmEngine(model, settings or VllmSettings(), name=name)


def start(engine: Any, kind: str, model: Path, pool: PoolAccess, digest: str, *,
          cold: bool, uses: contextlib.ExitStack,
          pack_slot_share: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Load the engine: ``cold`` from its model's files (a cold answer, nothing into the
    pool); else the reference engine from pool entry ``digest``, vLLM from the entry of
    its identity (exported first when there is none), its weights then packed where
    ``pack_slot_share`` is given (:mod:`spswap.serve.weights_pack`; the reason in the
    hello's ``pack`` where not). Returns the hello's fields."""
    t0 = time.perf_counter()
    if cold:
        engine.load_from_checkpoint(model)
        out: dict[str, Any] = {"from": "checkpoint", "digest": ""}
    elif kind == "vllm":
        out = start_engine(engine, pool, uses)
        if pack_slot_share is not None:
            out["pack"] = pack_logged(engine.pack, model.name, pack_slot_share, print)
    else:
        engine.load_from_pool(pool, digest)
        out = {"from": "pool", "digest": digest}
    return {"ok": True, "load_s": time.perf_counter() - t0, **out}


def _generate(engine: Any, req: dict[str, Any]) -> dict[str, Any]:
    """Answer one generate request, timing its first token: ``abort`` is asked before
    each token, so its second call comes right after the first token."""
    asked: list[float] = []

    def note() -> bool:
        asked.append(time.perf_counter())
        return False

    t0 = time.perf_counter()
    out = engine.generate([list(req["prompt_ids"])], int(req["max_new_tokens"]), abort=note)[0]
    end = time.perf_counter()
    first = asked[1] if len(asked) > 1 else end
    return {"token_ids": out, "first_token_s": first - t0, "generate_s": end - t0}


def handle(engine: Any, req: dict[str, Any]) -> dict[str, Any]:
    """One request's answer (the ``ok`` flag and the op's result)."""
    op = req.get("op")
    try:
        if op == "sleep":
            return {"ok": True, "seconds": engine.sleep()}
        if op == "wake":
            t0 = time.perf_counter()
            engine.wake()
            return {"ok": True, "seconds": time.perf_counter() - t0}
        if op == "generate":
            return {"ok": True, **_generate(engine, req)}
        if op == "health":  # the metrics' memory gauge: never a reason to fail a swap
            try:
                return {"ok": True, **engine.health().to_json()}
            except Exception as e:  # noqa: BLE001 - e.g. vLLM asked about weights asleep
                return {"ok": True, "resident_bytes": 0, "health_error": str(e)}
        if op == "trim":  # asleep, before a checkpoint: cached device blocks given back,
            # and this process's freed heap (CRIU dumps every resident page)
            trimmed = engine.trim() if hasattr(engine, "trim") else {}
            return {"ok": True, **trimmed, "worker": release_free_heap().to_json()}
        return {"ok": False, "error": f"unknown op {op!r}"}
    except RequestRejected as e:  # the request's own fault: the client fixes it
        return {"ok": False, "error": str(e), "rejected": True}
    except SpswapError as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a request never ends the model's process
        return {"ok": False, "error": f"the engine failed ({type(e).__name__}: {e})"}


def _closed_before_go(line: str) -> bool:
    """Whether the router's first line to a ``--wait-go`` worker ends it rather than lets
    it load: its stdin closed, or a close (a failed or stopped start closes every engine
    process; one that loaded first would take the GPU memory the stop gives back)."""
    if not line:
        return True
    try:
        return bool(json.loads(line).get("op") == "close")
    except (ValueError, AttributeError):
        return False


def _write(proto: Any, answer: dict[str, Any]) -> None:
    proto.write(json.dumps(answer, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    # The router stops the job on a SIGINT and closes its engines: an engine process that
    # died of one on its own (a traceback through torch's import, or in its loop) would
    # read as a failure. The router starts each in a session of its own (procs.py), out
    # of a terminal's Ctrl-C; this covers a SIGINT sent to the process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="spswap.multi.worker")
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--digest", default="", help="the model's pool entry (reference engine)")
    ap.add_argument("--engine", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--root", required=True, type=Path, help="the node's SPSWAP_ROOT")
    ap.add_argument("--settings", default=None, help="(vllm) VllmSettings as JSON")
    ap.add_argument("--vllm-args", default="", help="(vllm) vLLM's own options, one string")
    ap.add_argument("--pack-slot-share", type=float, default=None,
                    help="(vllm) pack the weights, inside this share of the GPU")  # fmt: skip
    ap.add_argument(
        "--wait-go",
        action="store_true",
        help="import the engine, then wait for a line on stdin before loading",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="load from the model's files, not the pool (a cold answer)",
    )
    args = ap.parse_args(argv)  # fmt: skip
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the engine's own prints must not corrupt the protocol
    sys.stdout = sys.stderr
    uses = contextlib.ExitStack()  # the pool entry the engine maps, held while it runs
    try:
        settings = None
        if args.engine == "vllm":
            settings = settings_from_json(json.loads(args.settings or "{}"))
            extra = llm_overrides(args.model, shlex.split(args.vllm_args))
            if extra:
                both = [*settings.llm_overrides, *extra.items()]
                settings = settings_from_json({**settings.to_json(), "llm_overrides": both})
        engine = make_engine(args.engine, args.model, args.device, args.name, settings)
        if args.wait_go and _closed_before_go(sys.stdin.readline()):
            return 0  # the router ended before this model's turn to start
        # the router's pool, not a fresh reading of SPSWAP_* (which holds the engine's too)
        cfg = Config.from_env({}, root=args.root)
        hello = start(engine, args.engine, args.model, PoolAccess(cfg, job_id=args.job_id),
                      args.digest, cold=args.cold, uses=uses,
                      pack_slot_share=args.pack_slot_share)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - reported to the router, which names the model
        _write(proto, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        uses.close()
        return 1
    _write(proto, hello)
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError as e:
            _write(proto, {"ok": False, "error": f"bad request: {e}"})
            continue
        if req.get("op") == "close":
            break
        _write(proto, handle(engine, req))
    engine.close()
    uses.close()
    _write(proto, {"ok": True, "closed": True})
    if args.engine != "vllm" and args.device == "cpu":
        # Nothing of this engine outlives its close, and the interpreter's teardown of
        # torch costs about a second of CPU per model at every job stop, inside the few
        # seconds Slurm leaves a job between SIGTERM and SIGKILL (KillWait). (An engine
        # on a GPU, vLLM's above all, exits as before: skipping its exit hooks is not
        # done untested on a GPU.)
        proto.close()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
