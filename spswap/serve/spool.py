"""Durable request spool of one serving job: the saved request state IS the spool.

A request is accepted by writing ``inbox/<id>.json`` (atomically); it is answered by
writing ``outbox/<id>.json`` and then removing the inbox file. Whatever is still in the
inbox when a job is preempted, killed or crashes is exactly the work that its next run
(restart count > 0) resumes: nothing a user submitted is lost, nothing is answered twice.
Plain files, no torch; the spool lives in the job's state directory (by default under
the submit directory, so it survives the node and the requeue).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spswap.errors import RequestIdTaken, SpswapError
from spswap.fsutil import atomic_write_json, make_private_dirs, read_json
from spswap.liveness import pid_alive, pid_start_time

RUNNING_FILE = "running.json"  # the request the server answers right now
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def answered(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer to an asker (socket or spool): the outbox record, with ``ok`` true when
    it holds tokens, false when it holds an error."""
    return {"ok": answer.get("error") is None, **answer}


def not_answered(request_id: str, why: str) -> dict[str, Any]:
    """The answer to an asker whose request was not answered (yet): it is saved in the
    spool (``saved``), answered by this run or the job's next; ask again with its id."""
    return {"ok": False, "saved": True, "id": request_id, "error": why}


def refused(why: str) -> dict[str, Any]:
    """The answer to a request that was never taken (bad input): nothing is saved."""
    return {"ok": False, "error": why}


def fetch_id(d: Any) -> str | None:
    """The id of a fetch: a request of an id alone (no prompt), which asks for the answer
    of the request asked before under that id; None for an ordinary request."""
    if not isinstance(d, dict) or "prompt_ids" in d or not d.get("id"):
        return None
    rid = str(d["id"])
    if not _ID_RE.match(rid):
        raise SpswapError(f"request id {rid!r} must be 1-128 characters of [A-Za-z0-9._-]")
    return rid


def _check_same(request: Request, earlier: dict[str, Any]) -> None:
    """Refuse ``request`` when the one asked before under its id (an answer, or a request
    still waiting) had another prompt or, where recorded, another length."""
    prompt, length = earlier.get("prompt_ids"), earlier.get("max_new_tokens")
    if prompt == request.prompt_ids and length in (None, request.max_new_tokens):
        return
    shown = ",".join(map(str, prompt)) if isinstance(prompt, list) else prompt
    raise RequestIdTaken(
        f"request {request.id} was asked before with the prompt {shown}"
        + (f" and {length} new tokens" if length is not None else "")
        + ": ask with that prompt (and --max-new-tokens) to get its answer, or use a new --id"
    )


@dataclass(frozen=True)
class Request:
    """One generation request: token ids in, greedy token ids out."""

    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    submitted: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "prompt_ids": self.prompt_ids,
            "max_new_tokens": self.max_new_tokens, "submitted": self.submitted,
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Request:
        """Validate a request from a user: clear errors, never a traceback."""
        if not isinstance(d, dict):
            raise SpswapError('a request is a JSON object, e.g. {"prompt_ids": [1, 2, 3], '
                              '"max_new_tokens": 16}')  # fmt: skip
        rid = str(d.get("id") or uuid.uuid4().hex)
        if not _ID_RE.match(rid):
            raise SpswapError(f"request id {rid!r} must be 1-128 characters of [A-Za-z0-9._-]")
        ids = d.get("prompt_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(x, int) for x in ids):
            raise SpswapError(f"request {rid}: prompt_ids must be a non-empty list of ints")
        n = d.get("max_new_tokens", 16)
        if not isinstance(n, int) or not 1 <= n <= 4096:
            raise SpswapError(f"request {rid}: max_new_tokens must be an int in 1..4096")
        return cls(id=rid, prompt_ids=list(ids), max_new_tokens=n,
                   submitted=float(d.get("submitted", time.time())))  # fmt: skip


class Spool:
    """``inbox/`` (accepted, unanswered) and ``outbox/`` (answered) of one job."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.inbox = state_dir / "inbox"
        self.outbox = state_dir / "outbox"

    def create(self) -> None:
        """The state directory and its boxes, private to the caller (0700, every file in
        them 0600): requests and answers are the user's data, and no other user (a group
        member either) may be able to swap the directory for their own; PermissionDenied
        naming the fix otherwise."""
        make_private_dirs(self.state_dir, os.getuid())
        for box in (self.inbox, self.outbox):
            box.mkdir(mode=0o700, exist_ok=True)
            box.chmod(0o700)  # whatever the umask, and boxes an older run made 0755

    def ready(self) -> bool:
        """Whether both boxes are there (:meth:`create` makes inbox/ first: a spool being
        made is not ready between the two)."""
        return self.inbox.is_dir() and self.outbox.is_dir()

    def submit(self, request: Request) -> bool:
        """Accept ``request``; False when it was accepted or answered before (idempotent).
        RequestIdTaken when its id was asked before with another prompt or length."""
        asked, earlier = self._asked_before(request.id)
        if asked:
            if earlier is not None:  # (a waiting request's file that cannot be read: no check)
                _check_same(request, earlier)
            return False
        atomic_write_json(self.inbox / f"{request.id}.json", request.to_json(), mode=0o600)
        return True

    def pending(self) -> Iterator[Request]:
        """Unanswered requests, oldest first (the order they were accepted in)."""
        items: list[Request] = []
        for path in self.inbox.glob("*.json"):
            data = read_json(path)
            if isinstance(data, dict):
                items.append(Request.from_json(data))
        yield from sorted(items, key=lambda r: (r.submitted, r.id))

    def complete(self, request: Request, output_ids: list[int], **extra: Any) -> None:
        """Record the answer, then drop the request from the inbox (in that order)."""
        self._answer(request, {"output_ids": output_ids, **extra})

    def fail(self, request: Request, error: str, **extra: Any) -> None:
        """Answer ``request`` with an error instead of tokens (a request the engine
        refused): the server goes on, and the request is not asked again."""
        self._answer(request, {"output_ids": None, "error": error, **extra})

    def _answer(self, request: Request, fields: dict[str, Any]) -> None:
        answer = {"id": request.id, "prompt_ids": request.prompt_ids,
                  "answered": time.time(), **fields}  # fmt: skip
        atomic_write_json(self.outbox / f"{request.id}.json", answer, mode=0o600)
        try:
            os.unlink(self.inbox / f"{request.id}.json")
        except FileNotFoundError:
            pass

    # -- the request being answered: a run that dies in it must not die in it again --
    @property
    def _running_path(self) -> Path:
        return self.state_dir / RUNNING_FILE

    def running(self, request: Request, restart_count: int) -> None:
        """Note that this process answers ``request`` now."""
        atomic_write_json(self._running_path, {
            "id": request.id, "pid": os.getpid(), "pid_start": pid_start_time(os.getpid()),
            "restart_count": restart_count}, mode=0o600)  # fmt: skip

    def not_running(self) -> None:
        self._running_path.unlink(missing_ok=True)

    def quarantine_crashed(self) -> str | None:
        """At a run's start: a request an earlier run was answering when it ended (a crash
        or a kill: its process is gone) is answered with that error instead of being
        asked again, so one request cannot end every run of the job. Returns its id."""
        note = read_json(self._running_path)
        self.not_running()
        if not isinstance(note, dict) or pid_alive(int(note.get("pid", 0)), note.get("pid_start")):
            return None
        rid = str(note.get("id"))
        pending = {r.id: r for r in self.pending()}
        if rid not in pending:
            return None
        self.fail(pending[rid], f"quarantined: run {note.get('restart_count')} of this job "
                  "ended while answering this request (a crash or a kill); it is not asked "
                  "again: check the request, or the job's log", quarantined=True)  # fmt: skip
        return rid

    def _asked_before(self, request_id: str) -> tuple[bool, dict[str, Any] | None]:
        """Whether a request of this id was asked here, and what it was: its answer, else
        the request still waiting (None where that file cannot be read)."""
        answer = self.answer(request_id)
        if answer is not None:
            return True, answer
        waiting = self.inbox / f"{request_id}.json"
        if not waiting.exists():
            return False, None
        data = read_json(waiting)
        return True, (data if isinstance(data, dict) else None)

    def check_asked(self, request_id: str) -> None:
        """For a fetch: SpswapError unless a request of this id was asked here (answered,
        or waiting for its answer)."""
        if not self._asked_before(request_id)[0]:
            raise SpswapError(f"no request {request_id} was asked of this job (none waits in "
                              f"{self.inbox}, none is answered in {self.outbox}): give its "
                              "prompt to ask it")  # fmt: skip

    def answer(self, request_id: str) -> dict[str, Any] | None:
        data = read_json(self.outbox / f"{request_id}.json")
        return data if isinstance(data, dict) else None

    def answered_count(self) -> int:
        """How many requests the job has answered, in all its runs (its outbox's files)."""
        return sum(1 for _ in self.outbox.glob("*.json"))

    def answers(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for path in sorted(self.outbox.glob("*.json")):
            data = read_json(path)
            if isinstance(data, dict):
                out[str(data["id"])] = data
        return out
