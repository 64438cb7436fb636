"""The sbatch scripts users start from: rendered by pure functions, pinned by goldens.

``sbatch_templates/serve.sbatch`` and ``batch.sbatch`` are exactly what these functions
return with their defaults; ``python -m spswap.serve.sbatch --write`` regenerates them.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "sbatch_templates"


@dataclass(frozen=True)
class SbatchOptions:
    """What a user changes in a template."""

    model: str = "/path/to/model"  # checkpoint directory: config.json + *.safetensors
    job_name: str = "spswap-serve"
    partition: str = "low"
    gpus: int = 1
    units: int = 4  # quarter-GPU units of the slot (1, 2 or 4)
    signal_lead_s: int = 120  # USR1 this long before the time limit
    time_limit: str = "04:00:00"
    requests: str | None = None  # batch jobs: a JSON-lines file of requests
    engine: str = "reference"  # "vllm": vLLM's OpenAI server (serve_vllm.sbatch)
    vllm_args: str = "--max-num-seqs 64"  # vLLM's own options (after --)
    serve_args: str = ""  # more `spswap serve` options (vLLM: SERVE_ARGS), e.g. --no-eager


_STATE_COMMENT = """\
# The unanswered requests are saved here; it must outlive the job (the job's working
# directory, sbatch --chdir or the submit directory, does); the job id stays the same
# across requeues. Ask it from the login node or another job of yours:
#   spswap ask 1,2,3 --job <job id>
"""

SAVES_AND_REQUEUES = """\
# spswap then stops admitting, saves the unanswered requests, puts the model away,
# releases its GPU slot and exits; Slurm requeues the job (on USR1 spswap asks for it).
"""


def handler_block(after_stop: str = SAVES_AND_REQUEUES) -> str:
    """The traps and the wait loop every template ends with; ``after_stop``: the comment
    lines that say what spswap does at a stop."""
    return _FORWARD + after_stop + _TRAPS


_FORWARD = """\
# The handlers only forward the signal to spswap (kill is a shell builtin: no fork in a
# handler; a forking handler can lose a SIGTERM that follows SIGCONT within a millisecond).
"""

_TRAPS = """\
trap 'kill -USR1 "$PID" 2>/dev/null' USR1
trap 'kill -TERM "$PID" 2>/dev/null' TERM
# wait returns when a trapped signal arrives: keep waiting until spswap has exited, then
# take its exit status (bash keeps it for the last wait).
while kill -0 "$PID" 2>/dev/null; do
    wait "$PID"
done
wait "$PID"
exit $?
"""


_VLLM_COMMENT = """\
# vLLM's OpenAI server listens on a Unix socket only you (and root) can reach; once up,
# its path is in $STATE/endpoint.json ("uds"). From the job or another job of yours:
#   curl --unix-socket "$STATE/sock/vllm.sock" http://localhost/v1/completions \\
#        -H 'Content-Type: application/json' -d '{"model": "'$MODEL'", "prompt": "Hi"}'
# Add --port 0 to SERVE_ARGS for TCP on 127.0.0.1 (a free port: endpoint.json's "http"),
# each request with the key: -H "Authorization: Bearer $(cat $STATE/api_key)".
# The state directory keeps the server's log (vllm.log) and must outlive the job; no
# directory above it may be writable by others (a group project directory is refused:
# use STATE="$HOME/.spswap/${SLURM_JOB_ID}" there).
"""


_MODEL_COMMENT = {
    False: "a model from `spswap models make DIR` (Hugging Face models: serve_vllm.sbatch)",
    True: "a Hugging Face-style model directory (config.json + *.safetensors)",
}


def render_serve(opts: SbatchOptions = SbatchOptions()) -> str:
    """A requeueable model server (or, with ``opts.requests``, a resumable batch job;
    with ``opts.engine == "vllm"``, vLLM's OpenAI server)."""
    batch = opts.requests is not None
    vllm = opts.engine == "vllm"
    what = "a preemptible batch generation job that resumes where it stopped" if batch \
        else "vLLM's OpenAI server, checkpointed and restored across preemption" if vllm \
        else "a requeueable model server"  # fmt: skip
    extra = requests_line = ""
    if batch:
        requests_line = (f"REQUESTS={shlex.quote(opts.requests or '')}   "
                         "# CHANGE: one JSON request per line\n")  # fmt: skip
        extra = ' \\\n    --requests "$REQUESTS" --exit-when-idle'
    more = [shlex.quote(a) for a in shlex.split(opts.serve_args)]
    # spswap serve's own options beside vLLM's: --no-eager is how a user gets vLLM's CUDA
    # graphs (spswap passes --enforce-eager otherwise); shown, unless chosen
    shown_eager = vllm and not {"--eager", "--no-eager"} & set(more)
    own = " ".join([f"--units {opts.units}", *(["--eager"] if shown_eager else []), *more])
    serve_opts = f" {own}"  # the serve line's; vLLM's template holds them in SERVE_ARGS
    if vllm:
        args = " ".join(shlex.quote(a) for a in shlex.split(opts.vllm_args))
        requests_line = (f"SERVE_ARGS=({own})   # CHANGE: spswap "
                         "serve's options (spswap serve --help): --eager -> --no-eager for "
                         "vLLM's CUDA graphs and compilation (faster answers, a cold start "
                         "about a minute longer)\n"
                         f"VLLM_ARGS=({args})   # CHANGE: vLLM's own options, e.g. "
                         "--max-num-seqs (spswap serve refuses those it sets itself, naming "
                         "what to give instead)\n")  # fmt: skip
        serve_opts = ' "${SERVE_ARGS[@]}"'
        extra = ' --engine vllm -- "${VLLM_ARGS[@]}"'
    state_comment = _VLLM_COMMENT if vllm else _STATE_COMMENT
    if not vllm:  # the front door on the node; `spswap ask --job N` works from anywhere
        extra = " --socket auto" + extra
    name = "batch" if batch else "serve_vllm" if vllm else "serve"
    return f"""#!/bin/bash
# spswap: {what}.
# Submit with: sbatch {name}.sbatch
# Change the lines marked CHANGE.
#SBATCH --job-name={opts.job_name}
# CHANGE the next line: your site's partition whose jobs others may preempt
#SBATCH --partition={opts.partition}
#SBATCH --gres=gpu:{opts.gpus}
#SBATCH --time={opts.time_limit}
#SBATCH --requeue
#SBATCH --signal=B:USR1@{opts.signal_lead_s}
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.log

MODEL={shlex.quote(opts.model)}   # CHANGE: {_MODEL_COMMENT[vllm]}
{requests_line}{state_comment}
STATE="$PWD/.spswap/${{SLURM_JOB_ID}}"

echo "spswap: job ${{SLURM_JOB_ID}} run ${{SLURM_RESTART_COUNT:-0}} on $(hostname)"
spswap serve "$MODEL" --state-dir "$STATE"{serve_opts}{extra} &
PID=$!
{handler_block()}"""


def render_batch(opts: SbatchOptions | None = None) -> str:
    """The batch-generation variant of :func:`render_serve`."""
    opts = opts or SbatchOptions(job_name="spswap-batch", requests="/path/to/requests.jsonl")
    return render_serve(opts)


def render_serve_vllm(opts: SbatchOptions | None = None) -> str:
    """The vLLM variant of :func:`render_serve`."""
    return render_serve(opts or SbatchOptions(job_name="spswap-vllm", engine="vllm"))


def templates() -> dict[str, str]:
    """File name -> content of every template in sbatch_templates/."""
    return {
        "serve.sbatch": render_serve(),
        "batch.sbatch": render_batch(),
        "serve_vllm.sbatch": render_serve_vllm(),
    }


def main(argv: list[str]) -> int:
    if argv[1:] != ["--write"]:
        print("usage: python -m spswap.serve.sbatch --write", file=sys.stderr)
        return 2
    TEMPLATES_DIR.mkdir(exist_ok=True)
    for name, text in templates().items():
        (TEMPLATES_DIR / name).write_text(text)
        print(f"wrote {TEMPLATES_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
