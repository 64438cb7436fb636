"""``spswap serve``: the in-job model server."""

from __future__ import annotations

import functools
import os
import shlex
import time
from pathlib import Path
from typing import Any

import typer

from spswap.cli.common import (
    RootOpt,
    UsageProblem,
    checked_model_dir,
    emit_json,
    err_console,
    given_flags,
    load_config,
    nonempty_path,
)
from spswap.cli.serve_slurm import (
    controller_answers,
    default_device,
    job_device,
    job_kill_wait_s,
    warn_if_not_requeueable,
)
from spswap.cli.serve_slurm import requeue as _requeue
from spswap.cli.serve_vllm import serve_vllm
from spswap.cli.serve_words import (
    AFTER_DASHDASH,
    before_dashdash,
    unused_options,
    words_problem,
)
from spswap.config import Config
from spswap.engines.model_check import check_servable
from spswap.engines.protocol import Engine
from spswap.serve.checkpointer import DaemonCheckpointer
from spswap.serve.factory import make_engine
from spswap.serve.front import default_socket_path, private_socket_dir
from spswap.serve.run_end import run_end_text
from spswap.serve.run_watch import fork_instance
from spswap.serve.runtime import ServeOptions, reference_run
from spswap.serve.spool import Spool
from spswap.serve.stop_budget import fitted_drain_s
from spswap.serve.vllm_api import check_user_args
from spswap.serve.weights_pack import SERVE_PACK_MAX_BYTES
from spswap.slots.alloc import VALID_UNITS
from spswap.slurm.env import JobEnv
from spswap.slurm.requeue import requeued_note
from spswap.units import fmt_bytes


def serve(
    ctx: typer.Context,
    model: Path = typer.Argument(
        ...,
        help="The model's directory: for the reference engine one `spswap models make` "
        "wrote; for --engine vllm a Hugging Face-style one (config.json + *.safetensors).",
    ),
    state_dir: Path = typer.Option(
        None,
        "--state-dir",
        parser=nonempty_path,
        metavar="PATH",
        help="Where unanswered requests are kept across preemption and requeue "
        "(default: ./.spswap/$SLURM_JOB_ID in the job's working directory).",
    ),
    engine: str = typer.Option(
        "reference",
        help="Engine: reference (token-id requests from the spool and --socket) "
        "or vllm (vLLM's OpenAI server on a private Unix socket; vLLM's own options go after "
        "--).",
    ),
    gpu_memory_utilization: float = typer.Option(
        None,
        help="(vllm) Fraction of the GPU the server may use (weights + KV cache); "
        "default: 0.9 of the reserved units' share (--units 2: 0.45).",
    ),
    kv_cache_gib: float = typer.Option(
        None,
        min=0.01,
        metavar="GIB",
        help="(vllm) The KV cache's size in GiB, instead of what "
        "--gpu-memory-utilization leaves: a KV cache sized to the job's need makes every "
        "swap faster (the driver clears the freed KV cache at each sleep).",
    ),
    max_model_len: int = typer.Option(4096, help="(vllm) Longest prompt + answer, tokens."),
    eager: bool = typer.Option(
        True,
        help="(vllm) No CUDA graphs or compilation: the fastest start (--no-eager for "
        "peak throughput).",
    ),
    pack: bool = typer.Option(
        None,
        "--pack/--no-pack",
        help="(vllm) Once up, move an eager engine's weights into one allocation of vLLM's "
        "sleep pool, where the job's units hold room for a second copy for a moment: each "
        "sleep and wake then maps one allocation, not dozens (a few ms off each swap). "
        f"Default: on with --eager; weights of more than {fmt_bytes(SERVE_PACK_MAX_BYTES)} stay "
        "as loaded (a 7B swapped slower packed); --no-pack serves them as loaded; refused "
        "with --no-eager (CUDA graphs hold the weights' addresses).",
    ),
    vllm_args: str = typer.Option(
        None,
        help="(vllm) vLLM's own options as one string, e.g. '--max-num-seqs 8' (with "
        "--models: for every model; else the same as giving them after --).",
    ),
    port: int = typer.Option(
        None,
        help="(--engine vllm, or any engine with --models) Also serve the OpenAI API on this "
        "TCP port (0: any free one), "
        "every request authenticated with the key in STATE_DIR/api_key; off by default "
        "(the API is on the private Unix socket only).",
    ),
    host: str = typer.Option(
        "127.0.0.1", help="(--engine vllm, or any engine with --models) Address for --port."
    ),
    drain_s: float = typer.Option(
        5.0,
        help="At a stop: seconds the requests already running get to finish (no new "
        "ones are taken) before the rest are stopped and saved for the next run. In a job "
        "it is cut to fit slurm.conf's KillWait (the SIGTERM -> SIGKILL time) less 2 s for "
        "putting the model away, and the job log says so.",
    ),
    launcher: str = typer.Option(
        None,
        help="(vllm, one model) The command that runs vLLM's OpenAI server module, e.g. a "
        "container: 'apptainer exec --nv vllm.sif python3 -m "
        "vllm.entrypoints.openai.api_server' (default: this Python, -m that module).",
    ),
    device: str = typer.Option(
        None, help="(reference, or --models) cpu, cuda or cuda:N (default: cuda when present)."
    ),
    units: int = typer.Option(
        None,
        help="Quarter-GPU units to reserve on the job's GPU: 1, 2 or 4 (default 4); "
        "with --models: units per awake model (default 2: two awake at half a GPU each).",
    ),
    models: bool = typer.Option(
        False,
        "--models",
        help="Serve several models in one job: MODEL and every directory "
        "after it (`spswap serve --models A B C`), one OpenAI endpoint on --socket (default "
        "auto) routing by the request's \"model\" (the directory's name), as many awake as "
        "--units allows, the rest asleep and woken on demand.",
    ),
    awake: int = typer.Option(
        None, min=1, metavar="N", help="(--models) At most this many models awake."
    ),
    idle_timeout_s: float = typer.Option(
        None,
        min=0.0,
        metavar="S",
        help="(--models) Put a model to sleep after this many seconds "
        "without a request (default: never).",
    ),
    latency_target_s: float = typer.Option(
        None,
        min=0.0,
        metavar="S",
        help="(--models) Refuse at start a set of models that cannot meet "
        "this latency (models <= awake + target / swap seconds).",
    ),
    swap_s: float = typer.Option(
        None,
        min=0.0,
        metavar="S",
        help="(--models) The swap time the budget assumes (default: one "
        "sleep + wake measured at start).",
    ),
    slot_timeout_s: float = typer.Option(600.0, help="How long to wait for the GPU slot."),
    requests: Path = typer.Option(
        None,
        exists=True,
        dir_okay=False,
        help='(reference, one model) JSON-lines requests to enqueue once ({"id", '
        '"prompt_ids", "max_new_tokens"}).',
    ),
    exit_when_idle: bool = typer.Option(
        False, help="(reference, one model) Exit once every request is answered (batch jobs)."
    ),
    requeue: bool = typer.Option(
        True, help="On USR1, ask Slurm to requeue this job after saving its state."
    ),
    checkpoint: bool = typer.Option(
        True,
        help="On a stop, have the node daemon checkpoint this process (CUDA checkpoint "
        "+ CRIU) so the requeued run restores it instead of starting again; needs a Slurm "
        "job and a running spswapd; off otherwise (with a warning when spswapd is not "
        "running).",
    ),
    socket: Path = typer.Option(
        None,
        "--socket",
        help="(reference, or --models) Also answer requests on this Unix socket (mode 0600, "
        "in a directory only you "
        "may open; `spswap ask`, or with --models the OpenAI API); default: none (with "
        "--models: auto). `auto`: $XDG_RUNTIME_DIR/serve-$SLURM_JOB_ID.sock when that is a "
        "directory of yours on the node, else STATE_DIR/sock/serve.sock (or "
        "/tmp/spswap-$UID/ when that path is too long for a socket).",
    ),
    root: Path = RootOpt,
    json: bool = typer.Option(
        False,
        "--json",
        help="Print a JSON summary when the run ends (a refusal: "
        '{"error": {"kind", "message", "exit_code"}}; a usage error: an unknown option, a '
        "missing or invalid argument, prints its usage text only, exit 2).",
    ),
) -> None:
    """Serve MODEL (or several: --models) inside a Slurm job, surviving preemption and requeue.

    Reference engine: reserves a slot on the job's GPU, loads the model from the node's
    pool (importing it from MODEL the first time), and answers the requests in the state
    directory's inbox (answers go to its outbox). On USR1 (sbatch --signal=B:USR1@N) or
    SIGTERM it stops admitting, keeps the unanswered requests, puts the model away,
    releases the slot and exits; the requeued run (SLURM_RESTART_COUNT > 0) answers the
    saved requests first.

    vLLM (--engine vllm -- VLLM_OPTIONS): runs vLLM's OpenAI-compatible server on
    a Unix socket in the state directory (mode 0700: only you and root reach it; its path
    is in STATE_DIR/endpoint.json), its weights filled from the node's pool (the first
    run reads MODEL and exports them), then (by default with --eager; --no-pack: not)
    moved into one allocation of vLLM's sleep pool where the slot holds room for a second
    copy beside what the server holds (a smaller --kv-cache-gib or --gpu-memory-utilization
    makes room): each sleep and wake then maps one allocation, not dozens; the log (and
    --json's pack) says whether it did, and why not. On USR1 or SIGTERM
    the server sleeps and spswapd checkpoints it with this process (CUDA checkpoint +
    CRIU); the requeued run restores it and it serves on. Without spswapd it stops the
    server, releases the slot and asks for a requeue; the next run starts from the pool,
    without disk.

    Several models (--models MODEL MODEL2 ...): one engine process per model, each
    started once from the pool, behind one OpenAI endpoint on --socket (GET /v1/models
    with each model's state, POST /v1/completions routed by "model", GET /metrics in
    Prometheus text; --port adds TCP with the key). As many models stay awake as --units
    allows, the rest asleep; a request for an asleep model puts the least recently used
    idle one to sleep and wakes it. At a stop every model sleeps and spswapd checkpoints
    the whole job; its requeued run restores them and answers the queued requests (a
    request with an X-Request-Id header is kept across the stop: ask again with the id).
    """
    cli_s = time.time()  # Python's start and the imports lie before: runs.jsonl's marks
    # first, before any other check: a mistyped option is told as one (click, told to let
    # vLLM's options through, passes it on as a word)
    after = ctx.meta.get(AFTER_DASHDASH, [])
    before = before_dashdash(ctx.args, after)
    options = [o for p in ctx.command.params for o in p.opts if o.startswith("--")]
    if (problem := words_problem(str(model), before, after, many=models, engine=engine,
                                 options=options)) is not None:  # fmt: skip
        raise UsageProblem(problem)
    # the first of --models too: one message for a wrong path wherever it stands
    model = checked_model_dir(model, many=models)
    if pack and not eager and engine == "vllm":
        raise typer.BadParameter("--pack needs --eager: with --no-eager vLLM's CUDA graphs "
                                 "hold the weights' addresses")  # fmt: skip
    if units is not None and units not in VALID_UNITS:
        raise typer.BadParameter(f"--units {units}: give 1, 2 or 4 quarter-GPU units (a "
                                 "quarter, half or whole GPU)")  # fmt: skip
    if (requests is not None or exit_when_idle) and models:
        raise typer.BadParameter("--requests and --exit-when-idle are a single model's "
                                 "batch job's; a job of --models is asked through its "
                                 "endpoint (docs/multi.md)")  # fmt: skip
    if (requests is not None or exit_when_idle) and engine == "vllm":
        raise typer.BadParameter("--requests and --exit-when-idle are the reference "
                                 "engine's batch job's; a vLLM server is asked through its "
                                 "OpenAI API, on the socket STATE_DIR/endpoint.json names "
                                 "(docs/slurm.md)")  # fmt: skip
    for line in unused_options(given_flags(ctx), engine=engine, many=models):
        err_console.print(f"spswap serve: {line}", markup=False, soft_wrap=True)
    cfg = load_config(root)
    job = JobEnv.from_env()
    slurm_answers = functools.cache(controller_answers)  # one `scontrol ping` per start
    if state_dir is None:
        if job is None:
            raise typer.BadParameter("outside a Slurm job, give --state-dir")
        state_dir = Path(os.getcwd()) / ".spswap" / job.job_id
    if job is not None and not job.restart_count:  # a run that came back was requeued
        warn_if_not_requeueable(job.job_id, state_dir, slurm_answers)
    if job is not None:
        if (note := requeued_note(job.job_id, job.restart_count)) is not None:
            err_console.print(note, markup=False, soft_wrap=True)
        drain_s, cut = fitted_drain_s(drain_s, job_kill_wait_s(state_dir, slurm_answers))
        if cut:
            err_console.print(cut, markup=False, soft_wrap=True)
    if models:
        from spswap.cli.serve_multi import serve_multi

        vllm = {"gpu_memory_utilization": gpu_memory_utilization, "eager": eager,
                "kv_cache_gib": kv_cache_gib, "max_model_len": max_model_len}  # fmt: skip
        serve_multi(cfg, job, [model, *map(Path, before)], state_dir, engine=engine,
                    device=device or ("cuda" if engine == "vllm" else default_device()),
                    vllm=vllm, vllm_args=vllm_args or "", pack=pack is not False,
                    units=units or 2, awake=awake,
                    idle_timeout_s=idle_timeout_s,
                    latency_target_s=latency_target_s, swap_s=swap_s, port=port, host=host,
                    socket=_socket_path(socket or Path("auto"), job.job_id if job else None,
                                        state_dir), slot_timeout_s=slot_timeout_s,
                    json_out=json, drain_s=drain_s, requeue=_requeue if requeue else None,
                    checkpointer=lambda: _checkpointer(cfg, job.job_id)
                    if checkpoint and job is not None else None)  # fmt: skip
        return
    units = units or 4

    if engine == "vllm":
        vllm_words = [*after, *shlex.split(vllm_args or "")]
        check_user_args(vllm_words)  # the command line first, then the model's files
        check_servable(engine, model)  # before the model goes into the pool
        serve_vllm(cfg, job, model, state_dir, vllm_words, units=units,
                   slot_timeout_s=slot_timeout_s, requeue=_requeue if requeue else None,
                   json_out=json, gpu_memory_utilization=gpu_memory_utilization,
                   kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, eager=eager,
                   pack=pack is not False, port=port, host=host, launcher=launcher,
                   drain_s=drain_s,
                   checkpointer_marked=lambda: _checkpointer_marked(cfg, job, checkpoint,
                                                                    cli_s))  # fmt: skip
        return
    # A requeued run that may restore its instance checks the model only if it starts an
    # engine: the check imports torch (seconds), which a restore does not need; the first
    # run checked the model before it went into the pool.
    may_restore = bool(checkpoint and job is not None and job.restart_count)
    if not may_restore:
        check_servable(engine, model)  # before the model goes into the pool
    if device is None:
        device = job_device(state_dir)
    opts = ServeOptions(
        model=model, state_dir=state_dir, engine=engine, device=device, units=units,
        slot_timeout_s=slot_timeout_s, requests_file=requests,
        exit_when_idle=exit_when_idle,
        slot_gpus=tuple(job.gpus) if job else (),
        socket_path=_socket_path(socket, job.job_id if job else None, state_dir),
        drain_s=drain_s,
    )  # fmt: skip

    checkpointer, marks_s = _checkpointer_marked(cfg, job, checkpoint, cli_s)

    def factory(o: ServeOptions) -> Engine:
        if may_restore:  # no restore after all: check the model, then start the engine
            check_servable(engine, model)
        return make_engine(o)

    server = reference_run(
        cfg, opts, engine_factory=factory,
        job_id=job.job_id if job else None,
        restart_count=job.restart_count if job else 0,
        requeue=_requeue if requeue else None,
        checkpointer=checkpointer,
        log=lambda msg: err_console.print(msg, markup=False, highlight=False, soft_wrap=True),
    )  # fmt: skip
    server.marks_s.update(marks_s)
    server.install_signal_handlers()
    result = server.run()
    if json:
        emit_json({**result.to_json(), "state_dir": str(state_dir)})
    else:
        job_answered = Spool(state_dir).answered_count()
        line = run_end_text(result, state_dir, spool=True, job_answered=job_answered)
        err_console.print(f"spswap serve: {line}", markup=False, soft_wrap=True)


def _checkpointer_marked(cfg: Config, job: Any, checkpoint: bool,
                         cli_s: float) -> tuple[Any, dict[str, float]]:  # fmt: skip
    """The run's checkpointer (:func:`_checkpointer`, or None), and runs.jsonl's marks of
    the run's first half second ("run" is ServeRun.run's start): the command's start
    (``cli_s``), its checks done, the fork into the instance (with spswapd's answer)."""
    marks_s = {"cli": cli_s, "checked": time.time()}
    ckpt = _checkpointer(cfg, job.job_id) if checkpoint and job is not None else None
    if ckpt is not None:
        marks_s["forked"] = time.time()
    return ckpt, marks_s


def _checkpointer(cfg: Config, job_id: str) -> Any:
    """A daemon-backed checkpointer when spswapd answers; None (sleep only) otherwise.
    Inside the job's cgroup this process forks here: the child serves on as the instance,
    this one only watches it (spswap.serve.run_watch: a parked instance kept alive must
    not hold the job's end until KillWait)."""
    ckpt = DaemonCheckpointer(cfg)
    if not ckpt.available():
        err_console.print("spswap serve: spswapd is not running: stops will not checkpoint",
                          markup=False)  # fmt: skip
        return None
    ckpt.run_started_s = fork_instance(job_id, ckpt.status)
    ckpt.install()
    # CRIU restores a session leader on its own; a job's background process is not one.
    if os.getsid(0) != os.getpid():
        os.setsid()
    return ckpt


def _socket_path(given: Path | None, job_id: str | None, state_dir: Path) -> Path | None:
    if given is None:
        return None
    path = default_socket_path(job_id, state_dir) if str(given) == "auto" else given
    private_socket_dir(path)  # refused now, not after every model's cold start
    return path
