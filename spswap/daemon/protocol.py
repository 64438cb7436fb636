"""The daemon's wire format: versioned JSON, one object per line.

A request is ``{"v": 1, "op": "<name>", "args": {...}}``; the answer is
``{"v": 1, "ok": true, "result": ...}`` or
``{"v": 1, "ok": false, "error": {"type": "<SpswapError subclass>", "message": "..."}}``.
Everything here is pure (bytes in, data out) so the exact bytes are pinned by tests.
Never pickle: the daemon runs as root and its clients are users.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spswap.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
"""Longest accepted request line, newline included; a longer one is answered with an error."""
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Longest accepted answer line. Answers come from the root daemon (checked before a byte is
sent) and carry whole pool manifests: one line per tensor's name, offset and shape, 80 KB
for a 3B model and megabytes for a many-expert one, so the bound only stops a runaway."""
MAX_FDS = 256
"""Most file descriptors one request may carry (SCM_RIGHTS); a checkpoint's shards."""

Answer = dict[str, Any] | list[dict[str, Any]]
"""An op's result: one JSON object, or a list of them (``slots.list``, ``jobs.list``)."""

FD_OPS = frozenset({"pool.import"})
"""Ops whose request carries open file descriptors; any other op's are closed unread."""

# op -> {arg name: (accepted JSON kind, required)}. Kinds: "str", "name" (text of at most
# MAX_NAME_CHARS: it goes into the event log and other users' tables), "int", "bool",
# "number" (int or float), "int_list", "str_list", "flat_dict" (an object of scalars).
# Keeping the table here (not in the server) lets the client reject a bad call before it
# reaches the socket, and keeps the server's dispatch and the protocol in one place.
ArgSpec = dict[str, tuple[str, bool]]
_IDENTITY: ArgSpec = {
    k: ("str", True)
    for k in ("engine", "engine_version", "torch", "python", "model_digest", "config_hash")
}
OPS: dict[str, ArgSpec] = {
    "ping": {},
    "status": {},
    "slots.list": {},
    "slots.release": {"reservation_id": ("str", True)},
    # The holder of a reservation or a pool use is always the caller (SO_PEERCRED); a
    # job id is accepted only when the prolog registered that job for the caller's uid.
    "slots.reserve": {
        "model": ("name", True),
        "units": ("int", False),
        "whole_gpus": ("int", False),
        "allowed_gpus": ("int_list", False),
        "job_id": ("str", False),
        "timeout_s": ("number", True),
    },
    "pool.use": {"ref": ("str", True), "job_id": ("str", False)},
    "pool.unuse": {"ref": ("str", True)},
    "pool.check": {"ref": ("str", True), "job_id": ("str", False)},
    # "files": the checkpoint-relative name of each attached file descriptor, in order.
    # "identity": an engine's weight layout (e.g. vLLM's); the daemon adds owner_uid.
    "pool.import": {
        "files": ("str_list", True),
        "name": ("name", False),
        "identity": ("flat_dict", False),
        "job_id": ("str", False),
    },
    "job.register": {
        "job_id": ("str", True),
        "uid": ("int", True),
        "user": ("name", False),
        "gpus": ("int_list", False),
        "restart_count": ("int", False),
        "node": ("name", False),
    },
    "job.end": {"job_id": ("str", True), "requeued": ("bool", False)},
    # a run of the job starts (sent by `spswap serve` before its imports): the caller's own
    # job only, running on this node
    "job.starting": {"job_id": ("str", True)},
    "jobs.list": {},
    # root: delete a job's checkpoint images here (spswap images rm)
    "images.remove": {"job_id": ("str", True)},
    "events.tail": {"n": ("int", False)},
    # The instance names its engine, versions, model and config; the daemon adds the uid,
    # driver, GPU model and CRIU version itself.
    "checkpoint": {
        "job_id": ("str", True),
        "pid": ("int", False),
        "requeue": ("bool", False),
        **_IDENTITY,
    },
    "restore": {"job_id": ("str", True), "restart_count": ("int", False), **_IDENTITY},
    "checkpoint.status": {"job_id": ("str", True)},
    # a serving process's own record for `spswap status`; the daemon sets its uid and pid
    "instance.put": {"record": ("flat_dict", True)},
    "instance.remove": {"id": ("str", True)},
}


@dataclass(frozen=True)
class Request:
    """One validated request."""

    op: str
    args: dict[str, Any] = field(default_factory=dict)


def encode(msg: dict[str, Any]) -> bytes:
    """One compact JSON object with sorted keys, newline-terminated."""
    return json.dumps(msg, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def request(op: str, **args: Any) -> dict[str, Any]:
    """The request message for ``op`` (validated like the daemon would)."""
    msg = {"v": PROTOCOL_VERSION, "op": op, "args": args}
    validate_request(msg)
    return msg


def ok(result: Any) -> dict[str, Any]:
    """A successful response."""
    return {"v": PROTOCOL_VERSION, "ok": True, "result": result}


def error(type_name: str, message: str) -> dict[str, Any]:
    """A failed response; ``type_name`` names a class in :mod:`spswap.errors` when it can."""
    return {"v": PROTOCOL_VERSION, "ok": False, "error": {"type": type_name, "message": message}}


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a number the daemon accepts; send finite numbers")


def _parse_line(line: bytes, limit_bytes: int, what_to_do: str) -> dict[str, Any]:
    if len(line) > limit_bytes:
        raise ProtocolError(
            f"message of {len(line)} bytes is larger than the limit of {limit_bytes} bytes; "
            + what_to_do
        )
    try:
        obj = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(
            f"message is not UTF-8 JSON ({e}); send one JSON object per line"
        ) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this daemon speaks "
            f"{PROTOCOL_VERSION}); use the spswap of the same release as the daemon"
        )
    return obj


MAX_FLAT_DICT_KEYS = 32
MAX_NAME_CHARS = 256


def _kind_ok(kind: str, value: Any) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "name":
        return isinstance(value, str) and len(value) <= MAX_NAME_CHARS
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str_list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "int_list":
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    if kind == "flat_dict":  # a few plain key -> scalar pairs, no nesting
        return (
            isinstance(value, dict)
            and len(value) <= MAX_FLAT_DICT_KEYS
            and all(
                isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))
                for k, v in value.items()
            )
        )
    raise AssertionError(f"unknown arg kind {kind}")


def validate_request(obj: dict[str, Any]) -> Request:
    """Check op and args of a parsed request against :data:`OPS`."""
    op = obj.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; valid ops: {', '.join(sorted(OPS))}")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(f"args of {op} must be a JSON object, got {type(args).__name__}")
    spec = OPS[op]
    unknown = sorted(set(args) - set(spec))
    if unknown:
        valid = ", ".join(sorted(spec)) or "none"
        raise ProtocolError(f"unknown argument(s) {unknown} for {op}; valid: {valid}")
    for name, (kind, required) in spec.items():
        if name not in args:
            if required:
                raise ProtocolError(f"{op} needs the argument {name!r} ({kind})")
            continue
        if args[name] is None and not required:
            continue
        if not _kind_ok(kind, args[name]):
            want = f"text of at most {MAX_NAME_CHARS} characters" if kind == "name" else kind
            got = repr(args[name])
            got = got[:80] + f"... ({len(got)} characters)" if len(got) > 100 else got
            raise ProtocolError(f"argument {name!r} of {op} must be {want}, got {got}")
    return Request(op=op, args={k: v for k, v in args.items() if v is not None})


def decode_request(line: bytes) -> Request:
    """Parse and validate one request line; raises :class:`ProtocolError`."""
    return validate_request(_parse_line(line, MAX_MESSAGE_BYTES, "send smaller requests"))


def decode_response(line: bytes) -> dict[str, Any]:
    """Parse one response line; checks its shape, not its result."""
    obj = _parse_line(
        line,
        MAX_RESPONSE_BYTES,
        "this is not an answer spswapd sends; check that SPSWAP_ROOT's socket belongs to spswapd",
    )
    if obj.get("ok") is True and "result" in obj:
        return obj
    err = obj.get("error")
    if obj.get("ok") is False and isinstance(err, dict) and isinstance(err.get("message"), str):
        return obj
    raise ProtocolError(f"response has neither a result nor an error: {line[:200]!r}")
