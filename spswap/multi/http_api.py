"""The multi-model job's OpenAI-compatible endpoint on its private Unix socket.

``POST /v1/completions`` ({"model", "prompt": token ids, "max_tokens"}) is routed by its
``model`` field; ``GET /v1/models`` lists the models with their state; ``GET /metrics``
is Prometheus text. TCP with the job's key is :class:`spswap.serve.http_front.HttpFront`
in front of this socket. A bad request gets a 4xx answer naming the fix; nothing a
request does ends the server.
"""

from __future__ import annotations

import http.client
import json
import socket
import socketserver
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from spswap.errors import RequestRejected, SpswapError
from spswap.multi.router import Router
from spswap.serve.front import bind_private_socket

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 600.0


def parse_completion(body: bytes) -> tuple[str, list[int], int]:
    """(model, prompt ids, max tokens) of a completions request; RequestRejected names
    what is wrong."""
    try:
        req = json.loads(body)
    except ValueError as e:
        raise RequestRejected(f"the body is not JSON ({e})") from None
    if not isinstance(req, dict) or not isinstance(req.get("model"), str):
        raise RequestRejected('give "model": one of GET /v1/models')
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        raise RequestRejected('"prompt" must be a non-empty list of token ids (the reference '
                              'engine has no tokenizer), e.g. "prompt": [1, 2, 3]')  # fmt: skip
    max_tokens = req.get("max_tokens", 16)
    if type(max_tokens) is not int or max_tokens < 1:
        raise RequestRejected(f'"max_tokens" must be a positive integer, not {max_tokens!r}')
    return req["model"], prompt, max_tokens


def completion_body(model: str, prompt: list[int], answer: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI text_completion object for ``answer`` (the ids, as text and as ids)."""
    ids = answer["token_ids"]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": " ".join(map(str, ids)), "token_ids": ids,
                         "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)}}  # fmt: skip


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    router: Router


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # no access log on the job's stderr

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "code": status}})

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        path = self.path.split("?", 1)[0]
        router = self.server.router
        if path == "/v1/models":
            self._json(200, {"object": "list", "data": router.models()})
        elif path == "/metrics":
            self._send(200, router.metrics_text().encode(), "text/plain; version=0.0.4")
        elif path in ("/health", "/ping"):
            self._json(200, {"ok": True})
        else:
            self._error(404, f"{path}: not here (GET /v1/models, /metrics; "
                             "POST /v1/completions)")  # fmt: skip

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        length = self.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self._error(
                413 if length.isdigit() else 400,
                f"give a Content-Length of at most {MAX_BODY_BYTES} bytes",
            )
            return
        body = self.rfile.read(int(length))
        if path != "/v1/completions":
            self._error(404, f"{path}: not here (POST /v1/completions)")
            return
        router = self.server.router
        try:
            model, prompt, max_tokens = parse_completion(body)
            if model not in router.specs:
                self._error(404, f"no model {model!r} in this job; it serves: "
                                 f"{', '.join(router.specs)} (GET /v1/models)")  # fmt: skip
                return
            answer = router.submit(model, prompt, max_tokens).result(REQUEST_TIMEOUT_S)
        except RequestRejected as e:
            self._error(400, str(e))
            return
        except SpswapError as e:
            self._error(503, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a request never ends the server
            self._error(500, f"{type(e).__name__}: {e}")
            return
        self._json(200, completion_body(model, prompt, answer))


class ApiServer:
    """Serves ``router`` on the Unix socket ``path`` in a thread of its own."""

    def __init__(self, router: Router, path: Path) -> None:
        self.router, self.path = router, path
        self._server: _Server | None = None

    def start(self) -> None:
        sock = bind_private_socket(self.path)
        server = _Server(str(self.path), _Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        sock.listen(64)
        server.router = self.router
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True,
                         name="spswap-multi-api").start()  # fmt: skip

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self.path.unlink(missing_ok=True)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self._path))
        self.sock = sock


def request(path: Path, method: str, target: str, body: dict[str, Any] | None = None,
            *, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:  # fmt: skip
    """One HTTP request to the job's socket: (status, body)."""
    conn = _UnixConnection(path, timeout_s)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(
            method, target, body=data, headers={"content-type": "application/json"} if data else {}
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def complete(path: Path, model: str, prompt: list[int], max_tokens: int,
             *, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
    """POST /v1/completions; the answer's JSON (``error`` on a refusal)."""
    status, raw = request(path, "POST", "/v1/completions",
                          {"model": model, "prompt": prompt, "max_tokens": max_tokens},
                          timeout_s=timeout_s)  # fmt: skip
    answer: dict[str, Any] = json.loads(raw)
    answer["status"] = status
    return answer
