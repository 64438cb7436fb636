"""The multi-model job's OpenAI-compatible endpoint on its private Unix socket.

``POST /v1/completions`` ({"model", "prompt": token ids, "max_tokens"}) is routed by its
``model`` field; ``GET /v1/models`` lists the models with their state; ``GET /metrics``
is Prometheus text. TCP with the job's key is :class:`spswap.serve.http_front.HttpFront`
in front of this socket. A bad request gets a 4xx answer naming the fix; nothing a
request does ends the server.

A request with an ``X-Request-Id`` header is kept by that id: asked again with the same
id it gets the same answer, also after the job was preempted while it waited (the stop
answers 503 and keeps it queued; the restored job answers it). One without an id that
is still queued at a stop is dropped with a 503 that says to ask again.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from spswap.errors import RequestRejected, SpswapError
from spswap.multi.procs import no_model_text
from spswap.multi.router import Router
from spswap.serve.front import listen_private_socket

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 600.0
WAIT_STEP_S = 0.1  # how often a waiting request looks whether the job is stopping
CLOSE_WAIT_S = 2.0  # at a stop: how long the answers being written may take
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def parse_completion(body: bytes, models: Iterable[str] = ()) -> tuple[str, list[int], int]:
    """(model, prompt ids, max tokens) of a completions request; RequestRejected names
    what is wrong (a missing "model": the job's ``models``)."""
    try:
        req = json.loads(body)
    except ValueError as e:
        raise RequestRejected(f"the body is not JSON ({e})") from None
    if not isinstance(req, dict) or not isinstance(req.get("model"), str):
        raise RequestRejected(f'give "model": one of {", ".join(models)} (GET /v1/models)')
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


def completion_body(model: str, prompt: list[int], answer: dict[str, Any],
                    request_id: str | None = None) -> dict[str, Any]:  # fmt: skip
    """An OpenAI text_completion object for ``answer`` (the ids, as text and as ids); a
    request asked again by its id gets the same object (its id and time too)."""
    ids = answer["token_ids"]
    return {"id": f"cmpl-{request_id}" if request_id else f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(answer.get("answered_s") or time.time()), "model": model,
            "choices": [{"index": 0, "text": " ".join(map(str, ids)), "token_ids": ids,
                         "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)}}  # fmt: skip


def stopping_message(request_id: str | None) -> str:
    """The 503 of a request that was still queued when the job began to stop."""
    if request_id is None:
        return ("the job is stopping (preempted, requeued or cancelled) before your request "
                "was answered; ask again once it runs again (with an X-Request-Id header "
                "the request is kept across the stop)")  # fmt: skip
    return (f"the job is stopping (preempted, requeued or cancelled); request {request_id} "
            "is kept and answered when the job runs again: ask again then with the same "
            "X-Request-Id")  # fmt: skip


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    router: Router

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections: set[socket.socket] = set()
        self.answering: set[socket.socket] = set()  # those inside a request now
        self.connections_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self, wait_s: float) -> int:
        """Give the answers being written ``wait_s``, then cut every connection left (a
        checkpoint cannot keep them; an idle keep-alive one is cut at once). Returns how
        many were cut."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self.connections_lock:
                if not self.answering:
                    break
            time.sleep(0.02)
        with self.connections_lock:
            left = list(self.connections)
        for conn in left:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(left)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # no access log on the job's stderr

    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.send_response(status)
        self.send_header("content-type", ctype)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str, allow: str | None = None) -> None:
        """An OpenAI-style error body; ``allow``: the method a 405 names (its Allow header)."""
        body = json.dumps({"error": {"message": message, "code": status}}).encode()
        self._send(status, body, headers={"allow": allow} if allow else None)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        path = self.path.split("?", 1)[0]
        router = self.server.router
        if path == "/v1/models":
            self._json(200, {"object": "list", "data": router.models()})
        elif path == "/metrics":
            self._send(200, router.metrics_text().encode(), "text/plain; version=0.0.4")
        elif path in ("/health", "/ping"):
            self._json(200, {"ok": True})
        elif path == "/v1/completions":
            self._error(405, "/v1/completions takes POST (a JSON body with model, prompt, "
                             "max_tokens)", allow="POST")  # fmt: skip
        else:
            self._error(404, f"{path}: not here (GET /v1/models, /metrics; "
                             "POST /v1/completions)")  # fmt: skip

    def do_POST(self) -> None:  # noqa: N802
        with self.server.connections_lock:
            self.server.answering.add(self.connection)
        try:
            self._post()
        finally:
            with self.server.connections_lock:
                self.server.answering.discard(self.connection)

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        length = self.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self._error(
                413 if length.isdigit() else 400,
                f"give a Content-Length of at most {MAX_BODY_BYTES} bytes",
            )
            return
        body = self.rfile.read(int(length))
        if path in ("/v1/models", "/metrics"):
            self._error(405, f"{path} takes GET", allow="GET")
            return
        if path != "/v1/completions":
            self._error(404, f"{path}: not here (POST /v1/completions)")
            return
        router = self.server.router
        try:
            model, prompt, max_tokens = parse_completion(body, router.specs)
            if model not in router.specs:
                self._error(404, no_model_text(model, router.specs))
                return
            request_id = self.headers.get(REQUEST_ID_HEADER)
            if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
                raise RequestRejected(f"{REQUEST_ID_HEADER} {request_id!r}: use letters, "
                                      "digits, '.', '_', ':' and '-' (at most 128)")  # fmt: skip
            fut = router.submit(model, prompt, max_tokens, request_id)
            answer = self._wait(fut, request_id)
            if answer is None:
                return
        except RequestRejected as e:
            self._error(400, str(e))
            return
        except SpswapError as e:
            self._error(503, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a request never ends the server
            self._error(500, f"{type(e).__name__}: {e}")
            return
        self._json(200, completion_body(model, prompt, answer, request_id))

    def _wait(self, fut: Future[dict[str, Any]], request_id: str | None) -> dict[str, Any] | None:
        """The answer; None when the job began to stop before it was started (answered
        here with a 503: kept by its id, or dropped) or it took too long (504)."""
        router = self.server.router
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            try:
                return fut.result(WAIT_STEP_S)
            except FutureTimeout:
                pass
            if router.paused and not fut.running() and (request_id is not None or fut.cancel()):
                self.close_connection = True  # the job is stopping: no keep-alive
                self._error(503, stopping_message(request_id))
                return None
            if time.monotonic() > deadline:
                self._error(
                    504,
                    f"no answer within {REQUEST_TIMEOUT_S:g} s; ask again"
                    + (" with the same X-Request-Id" if request_id else ""),
                )
                return None


class ApiServer:
    """Serves ``router`` on the Unix socket ``path`` in a thread of its own."""

    def __init__(self, router: Router, path: Path) -> None:
        self.router, self.path = router, path
        self._server: _Server | None = None

    def start(self) -> None:
        sock = listen_private_socket(self.path)
        server = _Server(str(self.path), _Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.router = self.router
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True,
                         name="spswap-multi-api").start()  # fmt: skip

    def stop(self) -> None:
        """No new connection; the answers being written get a moment, then every
        connection left is cut (a checkpoint of the job cannot keep them)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self.path.unlink(missing_ok=True)
            server.close_connections(CLOSE_WAIT_S)


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
            *, timeout_s: float = REQUEST_TIMEOUT_S,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:  # fmt: skip
    """One HTTP request to the job's socket: (status, body)."""
    conn = _UnixConnection(path, timeout_s)
    try:
        data = json.dumps(body).encode() if body is not None else None
        sent = {**({"content-type": "application/json"} if data else {}), **(headers or {})}
        conn.request(method, target, body=data, headers=sent)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def complete(path: Path, model: str, prompt: list[int], max_tokens: int,
             *, timeout_s: float = REQUEST_TIMEOUT_S,
             request_id: str | None = None) -> dict[str, Any]:  # fmt: skip
    """POST /v1/completions; the answer's JSON (``error`` on a refusal)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    status, raw = request(path, "POST", "/v1/completions",
                          {"model": model, "prompt": prompt, "max_tokens": max_tokens},
                          timeout_s=timeout_s, headers=headers)  # fmt: skip
    answer: dict[str, Any] = json.loads(raw)
    answer["status"] = status
    return answer
