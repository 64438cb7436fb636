"""A stand-in for vLLM's OpenAI server, for CPU tests of ``spswap serve --engine vllm``
(vLLM itself needs a GPU; the real server is tested on the GPU machine:
tests/engines/test_vllm_serve_gpu.py).

It takes the options spswap passes (``--model``, ``--uds``, ``--load-format``; the rest are
ignored), listens on the Unix socket, and runs spswap's REAL worker extension on a small
torch model: weights from ``MODEL/model.safetensors`` with ``--load-format auto``, random
ones with ``dummy``. Endpoints: ``/health``, ``/sleep`` (the weights are discarded: zeroed),
``/wake_up``, ``/is_sleeping``, ``/collective_rpc``, and ``/v1/completions`` (greedy token
ids from a token-id prompt, their ``logprobs`` and with ``echo`` the prompt's; 503 while
asleep).
"""

from __future__ import annotations

import argparse
import http.server
import json
import multiprocessing
import os
import socketserver
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spswap.engines.vllm_worker import SpswapWorkerExtension  # noqa: E402

VOCAB, DIM = 32, 8


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, DIM)

    @torch.inference_mode()
    def logits(self, token: int) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed.weight[token]))
        return self.embed.weight @ h

    def next_token(self, token: int) -> int:
        return int(torch.argmax(self.logits(token)))

    def logprob(self, token: int, following: int) -> float:
        """log P(following | token), as vLLM's ``logprobs`` give it."""
        return float(torch.log_softmax(self.logits(token).float(), dim=0)[following])


def save_model(model_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A model directory the stand-in loads (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in Tiny().state_dict().items()}
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "standin", "dim": DIM}))
    save_file(state, str(model_dir / "model.safetensors"))
    return state


def fake_vllm_metadata(directory: Path) -> Path:
    """A site directory whose package metadata names a vLLM version (the stand-in plays
    its server); put it on PYTHONPATH of a ``spswap serve --engine vllm`` under test."""
    info = directory / "vllm-0.26.0+standin.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+standin\n")
    return directory


class Worker(SpswapWorkerExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.rank = 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--uds", required=True)
    ap.add_argument("--load-format", default="auto")
    args, _rest = ap.parse_known_args()
    print("standin argv:", " ".join(sys.argv[1:]), file=sys.stderr, flush=True)  # to vllm.log
    model = Tiny()
    if args.load_format == "auto":
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(Path(args.model) / "model.safetensors")))
    else:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # garbage, as dummy is
        model = Tiny()
    worker = Worker(model)
    # as vLLM's server holds: a named POSIX semaphore (a spawn-context lock), which a
    # dump needs --link-remap for; the lock lives as long as the server
    sem = (  # noqa: F841
        multiprocessing.get_context("spawn").Lock()
        if os.environ.get("STANDIN_SEMAPHORE") == "1"
        else None
    )
    state = {"asleep": False, "running": 0}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _send(self, status: int, body: Any = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n)) if n else None

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200)
            elif self.path == "/metrics":  # vLLM's Prometheus text, the gauges spswap reads
                text = (f'vllm:num_requests_running{{engine="0"}} {state["running"]}.0\n'
                        'vllm:num_requests_waiting{engine="0"} 0.0\n').encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            elif self.path == "/is_sleeping":
                self._send(200, {"is_sleeping": state["asleep"]})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            path, _, query = self.path.partition("?")
            body = self._body()
            if path == "/sleep":
                assert "level=2" in query, query
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()  # level 2: the weights are gone
                state["asleep"] = True
                self._send(200)
            elif path == "/wake_up":
                if "kv_cache" in query:
                    state["asleep"] = False
                self._send(200)
            elif path == "/collective_rpc":
                try:
                    result = getattr(worker, body["method"])(*body.get("args", []))
                except Exception:
                    self._send(500, {"error": traceback.format_exc()})
                    return
                self._send(200, {"results": [result]})
            elif path == "/v1/completions":
                if state["asleep"]:
                    self._send(503, {"error": "asleep"})
                    return
                # as vLLM without a tokenizer (spswap starts it so): tokens named by id
                if (body.get("logprobs") is not None
                        and not body.get("return_tokens_as_token_ids")) or (
                        body.get("echo") and not body.get("return_token_ids")):  # fmt: skip
                    self._send(400, {"error": "Unable to get tokenizer because "
                                              "`skip_tokenizer_init=True`"})  # fmt: skip
                    return
                with lock:
                    state["running"] += 1
                try:
                    # a long generation, for the drain tests (not a vLLM option)
                    time.sleep(float(body.get("standin_delay_s", 0)))
                    with lock:
                        n = len(body["prompt"])
                        tokens = list(body["prompt"])
                        for _ in range(int(body.get("max_tokens", 8))):
                            tokens.append(model.next_token(tokens[-1]))
                        # as vLLM's: with echo the prompt's too, its first token's null
                        shown = tokens if body.get("echo") else tokens[n - 1 :]
                        lps = [None] if body.get("echo") else []
                        lps += [model.logprob(a, b) for a, b in zip(shown, shown[1:], strict=False)]
                finally:
                    with lock:
                        state["running"] -= 1
                choice: dict[str, Any] = {"token_ids": tokens[n:]}
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"token_logprobs": lps}
                self._send(200, {"choices": [choice]})
            else:
                self._send(404, {"error": path})

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

        def get_request(self) -> Any:
            conn, _ = super().get_request()
            return conn, ("standin", 0)

    with Server(args.uds, Handler) as srv:
        srv.serve_forever()


if __name__ == "__main__":
    main()
