"""How ``spswap bench turns`` asks a serving job and learns when it answered.

The reference engine's server reads requests from its job's spool: the question is put
in the job's inbox before the turn's Slurm action, and the server's own answer file says
when it answered (so no polling delay is counted). vLLM's OpenAI server is asked over
the job's private Unix socket, again and again until it answers (the socket file is
there but refuses connections while the job is away).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from spswap.errors import SpswapError
from spswap.serve.spool import Request, Spool
from spswap.serve.spool_ask import await_answer
from spswap.serve.vllm_api import uds_request

POLL_S = 0.005
CHECK_EVERY_S = 1.0  # how often a wait asks whether the job still lives


def _no_check() -> None:
    return None


class _Ticker:
    """Calls ``check`` at most every CHECK_EVERY_S (it asks Slurm: not in every poll)."""

    def __init__(self, check: Callable[[], None]) -> None:
        self.check = check
        self.last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= CHECK_EVERY_S:
            self.last = time.monotonic()
            self.check()


@dataclass(frozen=True)
class Answer:
    output_ids: list[int]
    answered_s: float  # epoch seconds


class Asker(Protocol):
    """One way to put a question to a job and wait for its answer."""

    def prepare(self, state_dir: Path, request_id: str) -> None:
        """Before the turn's action (a request that waits in the job's spool)."""
        ...

    def wait(self, state_dir: Path, request_id: str, deadline_s: float,
             check: Callable[[], None] = _no_check) -> Answer:  # fmt: skip
        """The answer, or :class:`SpswapError` once ``time.monotonic()`` passes the deadline;
        ``check`` (called about every second) raises to give up early (the job ended)."""
        ...


class SpoolAsker:
    """The reference engine's spool: inbox file before the action, outbox file after."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens

    def prepare(self, state_dir: Path, request_id: str) -> None:
        spool = Spool(state_dir)
        spool.create()  # private (0700), as the job's server makes it
        spool.submit(Request(id=request_id, prompt_ids=self.prompt_ids,
                             max_new_tokens=self.max_new_tokens))  # fmt: skip

    def wait(self, state_dir: Path, request_id: str, deadline_s: float,
             check: Callable[[], None] = _no_check) -> Answer:  # fmt: skip
        answer = await_answer(Spool(state_dir), request_id, deadline_s, _Ticker(check),
                              poll_s=POLL_S)  # fmt: skip
        if answer is None:
            raise SpswapError(
                f"no answer to {request_id} in {state_dir / 'outbox'}; see "
                "the job's log (%x-%j.log in the bench's work directory)"
            )
        if answer.get("error"):
            raise SpswapError(f"the server refused {request_id}: {answer['error']}")
        return Answer([int(x) for x in answer["output_ids"]], float(answer["answered"]))


def completion_body(model: str, prompt_ids: list[int], max_new_tokens: int) -> dict[str, object]:
    """A greedy completion of token ids, exactly ``max_new_tokens`` long."""
    return {"model": model, "prompt": list(prompt_ids), "max_tokens": max_new_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def socket_of(state_dir: Path) -> Path:
    """The job's vLLM socket: from its endpoint.json, else where spswap puts it."""
    try:
        return Path(json.loads((state_dir / "endpoint.json").read_text())["uds"])
    except (OSError, ValueError, KeyError):
        return state_dir / "sock" / "vllm.sock"


class OpenAiAsker:
    """vLLM's OpenAI server on the job's Unix socket, asked until it answers."""

    def __init__(self, model: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.body = completion_body(model, prompt_ids, max_new_tokens)

    def prepare(self, state_dir: Path, request_id: str) -> None:
        return None  # nothing waits in a spool: the question goes to the socket

    def wait(self, state_dir: Path, request_id: str, deadline_s: float,
             check: Callable[[], None] = _no_check) -> Answer:  # fmt: skip

        last = "no socket yet"
        tick = _Ticker(check)
        while time.monotonic() < deadline_s:
            tick()
            try:
                status, body = uds_request(socket_of(state_dir), "POST", "/v1/completions",
                                           self.body, timeout_s=max(1.0, deadline_s -
                                                                    time.monotonic()))  # fmt: skip
            except OSError as e:  # not listening yet (away, restoring, starting)
                last = str(e)
                time.sleep(POLL_S)
                continue
            if status == 200 and isinstance(body, dict):
                return Answer([int(x) for x in body["choices"][0]["token_ids"]], time.time())
            last = f"HTTP {status}: {str(body)[:300]}"
            time.sleep(POLL_S)
        raise SpswapError(f"vLLM's server in {state_dir} gave no answer ({last}); see its "
                          f"log {state_dir / 'vllm.log'} and the job's log")  # fmt: skip
