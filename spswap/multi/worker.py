"""One model's engine process of a multi-model job: ``python -m spswap.multi.worker``.

It loads its model from the pool once, then obeys one JSON request per line on stdin
(``sleep``, ``wake``, ``generate``, ``health``, ``close``) with one JSON answer per line
on the stdout it started with (anything else the engine prints goes to stderr). An
error in a request is an answer (``{"ok": false, "error": ...}``), never an exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from spswap.access import PoolAccess
from spswap.config import Config
from spswap.engines.protocol import Engine
from spswap.errors import ConfigError, RequestRejected, SpswapError

ENGINES = ("reference", "vllm")


def make_engine(kind: str, model: Path, device: str, name: str) -> Engine:
    """A fresh engine of ``kind`` for ``model``; torch (and vLLM) are imported here."""
    if kind == "reference":
        from spswap.engines.reference import ReferenceEngine, load_config

        return ReferenceEngine(load_config(model), device, name=name)
    if kind == "vllm":
        # VllmEngine has the same load_from_pool/sleep/wake/generate; what it still needs
        # here is the serve lifecycle's settings (memory share, KV cache) per model.
        raise ConfigError("--engine vllm with --models is not wired yet: the vLLM engine "
                          "plugs in here once the serve lifecycle gives per-model settings; "
                          "use --engine reference")  # fmt: skip
    raise ConfigError(f"unknown engine {kind!r}; valid engines: {', '.join(ENGINES)}")


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
        if op == "health":
            return {"ok": True, **engine.health().to_json()}
        return {"ok": False, "error": f"unknown op {op!r}"}
    except RequestRejected as e:  # the request's own fault: the client fixes it
        return {"ok": False, "error": str(e), "rejected": True}
    except SpswapError as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a request never ends the model's process
        return {"ok": False, "error": f"the engine failed ({type(e).__name__}: {e})"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="spswap.multi.worker")
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--digest", required=True, help="the model's pool entry")
    ap.add_argument("--engine", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--root", required=True, type=Path, help="the node's SPSWAP_ROOT")
    args = ap.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the engine's own prints must not corrupt the protocol
    sys.stdout = sys.stderr

    try:
        engine = make_engine(args.engine, args.model, args.device, args.name)
        t0 = time.perf_counter()
        # the router's pool, not a fresh reading of SPSWAP_* (which holds the engine's too)
        cfg = Config.from_env({}, root=args.root)
        engine.load_from_pool(PoolAccess(cfg, job_id=args.job_id), args.digest)
        hello: dict[str, Any] = {"ok": True, "load_s": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the router, which names the model
        proto.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    proto.write(json.dumps(hello) + "\n")
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError as e:
            proto.write(json.dumps({"ok": False, "error": f"bad request: {e}"}) + "\n")
            continue
        if req.get("op") == "close":
            break
        proto.write(json.dumps(handle(engine, req)) + "\n")
    engine.close()
    proto.write(json.dumps({"ok": True, "closed": True}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
