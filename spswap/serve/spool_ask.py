"""Asking a serving job through its spool: from the login node or another job, wherever
its state directory is seen (the spool is plain files; a Unix socket works only on the
job's node). ``spswap ask --job N``."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spswap.errors import PermissionDenied, SpswapError
from spswap.fsutil import atomic_write_json
from spswap.serve.front import another_users, openai_hint
from spswap.serve.spool import Request, Spool, answered, fetch_id, not_answered
from spswap.slurm.backend import CliBackend
from spswap.slurm.parse import stopped_for_good

POLL_S = 0.05
# In a `spswap serve --models` job's state directory: where its OpenAI endpoint is (such
# a job has no spool, so `spswap ask --job/--state-dir` says so at once)
MULTI_ENDPOINT_FILE = "models_endpoint.json"
VLLM_ENDPOINT_FILE = "endpoint.json"  # a one-model vLLM job's (spswap.serve.vllm_run's)
VLLM_LOG_FILE = "vllm.log"  # its server's log: there from its first start, endpoint or not


def write_multi_endpoint(state_dir: Path, socket_path: Path, models: list[str]) -> None:
    """Record in a multi-model job's state directory where its endpoint is."""
    atomic_write_json(state_dir / MULTI_ENDPOINT_FILE, {"socket": str(socket_path),
                                                        "models": models})  # fmt: skip


def not_a_spool(state_dir: Path, ended: str | None = None,
                job_id: str | None = None) -> str | None:  # fmt: skip
    """Why ``state_dir`` cannot be asked through a spool because it is a multi-model
    job's or a one-model vLLM job's (what to do instead), or None. ``ended``: the job's
    state where it has ended for good (then its endpoint answers no more: no way in to
    show); ``job_id``: the job, where known (its words name it)."""
    if (state_dir / VLLM_ENDPOINT_FILE).exists() or (state_dir / VLLM_LOG_FILE).exists():
        return _vllm_text(state_dir, ended, f"job {job_id}" if job_id else "this job")
    try:
        found = json.loads((state_dir / MULTI_ENDPOINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if ended is not None:
        return (f"this job served several models (spswap serve --models) and has ended "
                f"({ended}): nothing answers for it any more; submit it again to ask its "
                "models (through its endpoint: docs/multi.md)")  # fmt: skip
    found = found if isinstance(found, dict) else {}
    socket_path = found.get("socket", "SOCKET")
    models = [str(m) for m in found.get("models") or [] if isinstance(m, str)]
    return (f"this job serves several models (spswap serve --models) and spswap ask asks "
            f"a single model's job (its state directory {state_dir} has no request queue "
            f"for it). Its endpoint is {socket_path}. "
            f"{openai_hint(socket_path, models)}")  # fmt: skip


def _vllm_text(state_dir: Path, ended: str | None, job: str) -> str:
    """A one-model vLLM job's state directory: its server has no spool (it answers
    vLLM's OpenAI API on a socket of its own, while ``endpoint.json`` names it)."""
    if ended is not None:
        return (f"{job} served vLLM's OpenAI API (spswap serve --engine vllm), which has no "
                f"spool, and has ended ({ended}): nothing answers for it any more")  # fmt: skip
    endpoint = state_dir / VLLM_ENDPOINT_FILE
    said = (f"{job} serves vLLM's OpenAI API (spswap serve --engine vllm), which has no "
            "spool: ask it on its socket, which")  # fmt: skip
    if endpoint.exists():
        return f"{said} {endpoint} names (docs/slurm.md)"
    # (removed while the server is parked or dumped, and until a run has it answering)
    return (f"{said} {endpoint} names once it answers: not now (it is starting, or was "
            "stopped and waits for its next run; its log: "
            f"{state_dir / VLLM_LOG_FILE}) (docs/slurm.md)")  # fmt: skip


def state_dir_of(work_dir: str, job_id: str) -> Path:
    """Where the templates keep a job's state: ``WORKDIR/.spswap/JOB``."""
    return Path(work_dir) / ".spswap" / job_id


def job_state_dir(job_id: str, spool_wait_s: float = 0.0) -> tuple[Path, str | None]:
    """The state directory of job ``job_id``, from Slurm's record of its working
    directory, and the job's state when it has ended for good (no run will answer a new
    request; None while it runs or will run again); SpswapError naming the fix when Slurm
    does not know it. A running job's server makes its spool a few seconds into the job:
    up to ``spool_wait_s`` is spent waiting for it."""
    info = CliBackend().job(job_id)
    if info is None or not info.work_dir:
        raise SpswapError(f"Slurm does not know job {job_id} (or its working directory): "
                          "check the id with squeue, or give --state-dir")  # fmt: skip
    path = state_dir_of(info.work_dir, info.job_id)
    ended = info.state if stopped_for_good(info.state) else None
    deadline = time.monotonic() + (spool_wait_s if info.running else 0.0)
    with owner_checked(path):
        # both boxes: an ask between the server's inbox/ and outbox/ was refused as "no
        # spool" (CI, the user guide's test, 2026-12-07)
        while not Spool(path).ready():
            if (why := not_a_spool(path, ended, info.job_id)) is not None:
                raise SpswapError(why)
            if ended is not None or time.monotonic() >= deadline:
                waited = spool_wait_s if info.running else None
                raise SpswapError(no_spool_text(info.job_id, path, ended=ended,
                                                made=path.exists(), waited_s=waited,
                                                log=info.std_out))  # fmt: skip
            time.sleep(POLL_S)
    return path, ended


def no_spool_text(job_id: str, path: Path, *, ended: str | None, made: bool,
                  waited_s: float | None, log: str | None) -> str:  # fmt: skip
    """Why job ``job_id``'s state directory ``path`` takes no request (no spool, and not
    another kind of job's: :func:`not_a_spool`), and what to do. ``ended``: Slurm's state
    where the job ended for good; ``made``: the directory exists; ``waited_s``: how long
    a running job was waited for; ``log``: the job's output file (Slurm's StdOut). Pure."""
    elsewhere = "or its state directory is elsewhere: give --state-dir"
    if ended is not None:
        why = f"the job's log says why: {log}" if log else "the job's log says why"
        if not made:
            return (f"job {job_id} has ended ({ended}) without serving: {path} was never made "
                    f"(it was not a serving job, or its server never started: {why}), "
                    f"{elsewhere}")  # fmt: skip
        return (f"job {job_id} has ended ({ended}) and {path} has no spool (inbox/, outbox/): "
                f"{why}, {elsewhere}")  # fmt: skip
    waited = f" ({waited_s:g} s after the job ran)" if waited_s is not None else ""
    return (f"{path} has no spool (inbox/, outbox/){waited}: the job's server has not "
            f"started yet (its log says 'requests on' once it has), {elsewhere}")  # fmt: skip


def no_state_dir_text(state_dir: Path) -> str:
    """Why ``spswap ask --state-dir`` cannot ask ``state_dir`` (not a serving job's state
    directory), and what to give instead: a path that is not there, or the folder of the
    jobs' state directories (the templates' ``WORKDIR/.spswap``: its jobs named)."""
    if not state_dir.exists():
        return (f"{state_dir} does not exist: give a serving job's state directory (the "
                "templates keep it in WORKDIR/.spswap/JOB_ID), or ask with "
                "--job JOB_ID")  # fmt: skip
    try:
        jobs = sorted(d.name for d in state_dir.iterdir() if Spool(d).ready())
    except OSError:
        jobs = []
    if jobs:
        more = ", ..." if len(jobs) > 3 else ""
        shown = ", ".join(str(state_dir / j) for j in jobs[:3])
        if len(jobs) == 1:
            return (f"{state_dir} holds the state directory of job {jobs[0]}: give it "
                    f"({shown}), or ask with --job {jobs[0]}")  # fmt: skip
        return (f"{state_dir} holds the state directories of jobs {', '.join(jobs[:3])}{more}: "
                f"give one of them ({shown}{more}), or ask with --job JOB_ID")  # fmt: skip
    return (
        f"{state_dir} has no spool (inbox/, outbox/): is it the state directory of a serving job?"
    )


@contextlib.contextmanager
def owner_checked(state_dir: Path) -> Iterator[None]:
    """A PermissionError inside, where ``state_dir`` is another user's, becomes a
    :class:`PermissionDenied` that says whose it is (the generic "run as root, or give a
    --root" did not apply: it is a job's folder, not spswap's root)."""
    try:
        yield
    except PermissionError:
        refusal = another_users(state_dir, "a serving job's state directory takes "
                                "requests from its own user only (and root); ask a job "
                                "of yours")  # fmt: skip
        if refusal is None:
            raise
        raise PermissionDenied(refusal) from None


def await_answer(spool: Spool, request_id: str, deadline_s: float,
                 check: Callable[[], None] | None = None,
                 poll_s: float = POLL_S) -> dict[str, Any] | None:  # fmt: skip
    """The answer to ``request_id`` once its outbox file is there, or None once
    ``time.monotonic()`` passes ``deadline_s``; ``check`` is called between looks and
    raises to give up early."""
    while True:
        answer = spool.answer(request_id)
        if answer is not None:
            return answer
        if time.monotonic() > deadline_s:
            return None
        if check is not None:
            check()
        time.sleep(poll_s)


def ask_spool(state_dir: Path, request: dict[str, Any], *, timeout_s: float,
              ended: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Put ``request`` in the job's inbox and wait for its answer in the outbox: the same
    answer dicts as the socket's (``ok``; ``saved`` with the id when it is still waiting
    at the timeout: the job answers it later, ask again with the same id). ``ended``: the
    job's state when it has ended for good: only an answer already given is returned."""
    spool = Spool(state_dir)
    req: Request | None = None
    rid = fetch_id(request)  # an id alone: the answer of a request asked before
    if rid is None:
        req = Request.from_json({"id": request.get("id") or uuid.uuid4().hex, **request})
        rid = req.id
    with owner_checked(state_dir):
        given = _put(spool, state_dir, req, rid, ended)
    if given is not None:
        return answered(given)
    answer = await_answer(spool, rid, time.monotonic() + timeout_s)
    if answer is not None:
        return answered(answer)
    return not_answered(rid, f"no answer within {timeout_s:g} s; the request waits in "
                        f"{spool.inbox}")  # fmt: skip


def _put(spool: Spool, state_dir: Path, req: Request | None, rid: str,
         ended: str | None) -> dict[str, Any] | None:  # fmt: skip
    """Check that ``state_dir`` holds a spool, then submit ``req`` (or check that request
    ``rid`` was asked before); for a job that ``ended``, its answer given before (the
    only one it will have)."""
    if not spool.ready():
        if (why := not_a_spool(state_dir)) is not None:
            raise SpswapError(why)
        raise SpswapError(no_state_dir_text(state_dir))
    if ended is not None:
        given = spool.answer(rid)
        if given is not None:
            return given
        raise SpswapError(f"the job has ended ({ended}) and will not run again: no run will "
                          "answer this request; submit the job again (its saved answers "
                          "are in " + str(spool.outbox) + ")")  # fmt: skip
    if req is None:
        spool.check_asked(rid)
    else:
        spool.submit(req)
    return None
