"""``sbatch_templates/serve_multi.sbatch``: several models in one job, rendered by a pure
function and pinned by its golden file (``python -m spswap.multi.sbatch --write``)."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from spswap.serve.sbatch import TEMPLATES_DIR, handler_block

# what --models does at a stop (docs/multi.md "Preemption")
_CHECKPOINTS_ALL = """\
# spswap then takes no new request (a waiting client gets a 503 that says to ask again;
# one asked with an X-Request-Id header stays queued), puts every model to sleep and hands
# the job to spswapd, which checkpoints all of them at once; Slurm requeues the job and
# its next run restores them and answers the queued requests.
"""

FILE_NAME = "serve_multi.sbatch"


@dataclass(frozen=True)
class MultiSbatchOptions:
    """What a user changes in the template."""

    models: tuple[str, ...] = ("/path/to/model-a", "/path/to/model-b", "/path/to/model-c")
    job_name: str = "spswap-multi"
    partition: str = "low"
    time_limit: str = "1-00:00:00"
    engine: str = "vllm"  # or "reference" (spswap's CPU test models)
    engine_args: tuple[str, ...] = ("--kv-cache-gib", "4")  # every model's engine settings
    units: int = 2  # quarter units per awake model: 2 = two awake at half the GPU each
    idle_timeout_s: int = 600
    latency_target_s: float | None = None
    signal_lead_s: int = 120  # USR1 this long before the time limit


def render_serve_multi(opts: MultiSbatchOptions = MultiSbatchOptions()) -> str:
    """One job serving every model of ``opts.models`` behind one endpoint."""
    models = " ".join(shlex.quote(m) for m in opts.models)
    engine_args = " ".join(shlex.quote(a) for a in opts.engine_args)
    target = f" --latency-target-s {opts.latency_target_s:g}" \
        if opts.latency_target_s is not None else ""  # fmt: skip
    return f"""#!/bin/bash
# spswap: many models in one job, one OpenAI endpoint that swaps them on demand.
# Submit with: sbatch {FILE_NAME}
# Change the lines marked CHANGE.
#SBATCH --job-name={opts.job_name}
# CHANGE the next line: your site's partition whose jobs others may preempt
#SBATCH --partition={opts.partition}
#SBATCH --gres=gpu:1
#SBATCH --time={opts.time_limit}
#SBATCH --requeue
#SBATCH --signal=B:USR1@{opts.signal_lead_s}
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.log

MODELS=({models})   # CHANGE: the models; a request's "model" is its directory's name
ENGINE={opts.engine}   # CHANGE: vllm (Hugging Face-style models on the GPU) or reference
ENGINE_ARGS=({engine_args})   # CHANGE: each model's settings (docs/multi.md); () for reference
STATE="$PWD/.spswap/${{SLURM_JOB_ID}}"
# The endpoint is a Unix socket only you (and root) can reach; its path is printed at the
# start of the log. From the job or another job of yours on the node:
#   curl --unix-socket SOCKET http://localhost/v1/models
#   curl --unix-socket SOCKET http://localhost/v1/completions \\
#        -H 'Content-Type: application/json' -d '{{"model": "model-a", "prompt": [1, 2, 3]}}'
#   curl --unix-socket SOCKET http://localhost/metrics
# Add --port 8000 for TCP on 127.0.0.1, every request with the key in $STATE/api_key.

echo "spswap: job ${{SLURM_JOB_ID}} run ${{SLURM_RESTART_COUNT:-0}} on $(hostname)"
spswap serve --models "${{MODELS[@]}}" --state-dir "$STATE" --socket auto \\
    --engine "$ENGINE" "${{ENGINE_ARGS[@]}}" --units {opts.units} \\
    --idle-timeout-s {opts.idle_timeout_s}{target} &
PID=$!
{handler_block(_CHECKPOINTS_ALL)}"""


def main(argv: list[str]) -> int:
    if argv[1:] != ["--write"]:
        print("usage: python -m spswap.multi.sbatch --write", file=sys.stderr)
        return 2
    (TEMPLATES_DIR / FILE_NAME).write_text(render_serve_multi())
    print(f"wrote {TEMPLATES_DIR / FILE_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
