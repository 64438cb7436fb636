"""``spswap ask``: one generation request to a serving job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from spswap.cli.common import emit_json, nonempty_path
from spswap.errors import SpswapError
from spswap.serve.front import ask as send
from spswap.serve.spool_ask import ask_spool, job_state_dir

SPOOL_WAIT_S = 60.0  # a running job's server makes its spool within seconds of its start


def ask(
    prompt_ids: str | None = typer.Argument(
        None,
        help="Token ids of the prompt, e.g. 1,2,3; leave it out with --id to fetch "
        "the answer of a request asked before.",
    ),
    socket: Path = typer.Option(
        None,
        "--socket",
        help="The socket `spswap serve` listens on (on the job's node; from elsewhere use --job).",
    ),
    job_id: str = typer.Option(
        None,
        "--job",
        help="The serving job's id: the request goes "
        "to its state directory's spool (WORKDIR/.spswap/JOB, as the "
        "templates set it), from the login node or another job.",
    ),
    state_dir: Path = typer.Option(
        None,
        "--state-dir",
        parser=nonempty_path,
        metavar="PATH",
        help="The serving job's state directory, when it is not WORKDIR/.spswap/JOB.",
    ),
    max_new_tokens: int = typer.Option(16, help="Tokens to generate (greedy)."),
    request_id: str = typer.Option(
        None,
        "--id",
        help="Request id (default: a new one); "
        "asking again with the same id (and prompt, or no prompt) returns the saved answer.",
    ),
    timeout_s: float = typer.Option(600.0, help="How long to wait for the answer."),
    json: bool = typer.Option(
        False,
        "--json",
        help="Print the whole answer as JSON (a refusal: "
        '{"error": {"kind", "message", "exit_code"}}).',
    ),
) -> None:
    """Send one generation request to a serving job and print the answer's token ids.

    With --socket, on the job's node; with --job (or --state-dir), anywhere the job's
    state directory is seen (a shared file system): the request is written to the job's
    spool and its answer read from there. If the server is stopped meanwhile
    (preemption), the request is kept and answered by the job's next run: ask again with
    the same --id to get it (with the same prompt, or with --id alone).

    A job of several models (spswap serve --models) is asked through its OpenAI
    endpoint instead (POST /v1/completions on its socket: docs/multi.md); ask refuses it
    and prints the curl line to use. A vLLM job (spswap serve --engine vllm) has no spool
    either: ask it through its OpenAI API, on the socket its state directory's
    endpoint.json names (docs/slurm.md).
    """
    req: dict[str, Any] = {}
    if prompt_ids is None and not request_id:
        raise typer.BadParameter("give the prompt's token ids (e.g. 1,2,3), or --id ID alone "
                                 "to fetch the answer of a request asked before")  # fmt: skip
    if prompt_ids is not None:
        try:
            ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter("prompt ids must be integers, e.g. 1,2,3") from None
        req = {"prompt_ids": ids, "max_new_tokens": max_new_tokens}
    if request_id:
        req["id"] = request_id
    given = [name for name, x in (("--socket", socket), ("--job", job_id),
                                  ("--state-dir", state_dir)) if x is not None]  # fmt: skip
    if not given:
        raise typer.BadParameter("give one of --socket, --job or --state-dir")
    if len(given) > 1:
        raise typer.BadParameter(f"give only one of {', '.join(given)}: --job N alone finds "
                                 "the job's server wherever its directory is seen")  # fmt: skip
    if socket is not None:
        answer = send(socket, req, timeout_s=timeout_s)
    else:
        # a job that runs makes its spool at its server's start: wait for that too
        where, ended = (state_dir, None) if state_dir is not None else \
            job_state_dir(job_id, spool_wait_s=min(timeout_s, SPOOL_WAIT_S))  # fmt: skip
        answer = ask_spool(where, req, timeout_s=timeout_s, ended=ended)
    if json:
        emit_json(answer)
    elif answer.get("ok"):
        print(",".join(map(str, answer["output_ids"])))
    elif answer.get("saved"):
        raise SpswapError(f"{answer.get('error')}: ask again later with --id {answer.get('id')}")
    else:
        raise SpswapError(str(answer.get("error")))
