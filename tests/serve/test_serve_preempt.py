"""`spswap serve` as a real process: stopped by USR1 mid-queue, resumed by the next run.

The Slurm-driven version of this (real preemption, requeue) lives in tests/slurm; this one
checks the server's own part without a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402
from tests.helpers.serve import cpu_serve_argv  # noqa: E402

N_REQUESTS = 12
MAX_NEW = 12


def _serve(tmp: Path, model: Path, env_extra: dict[str, str], *extra: str) -> subprocess.Popen:
    env = {**os.environ, "SPSWAP_ROOT": str(tmp / "root"), **env_extra}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.Popen(
        cpu_serve_argv(model, tmp / "state", "--json", *extra),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_usr1_saves_unanswered_requests_and_the_next_run_answers_them(tmp_path):
    model = tmp_path / "model"
    save_checkpoint(preset("small"), model)
    prompts = [[1 + i, 7, 3 + 2 * i, 11] for i in range(N_REQUESTS)]
    reqs = tmp_path / "requests.jsonl"
    reqs.write_text(
        "".join(
            json.dumps({"id": f"r{i:02d}", "prompt_ids": p, "max_new_tokens": MAX_NEW}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    outbox = tmp_path / "state" / "outbox"

    first = _serve(tmp_path, model, {}, "--requests", str(reqs))
    deadline = time.monotonic() + 120
    while not (outbox.is_dir() and any(outbox.iterdir())):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "no answer within 120 s"
        time.sleep(0.02)
    first.send_signal(signal.SIGUSR1)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGUSR1"
    assert summary["answered"] >= 1
    assert summary["pending_left"] > 0, "every request was answered before the signal"
    assert summary["answered"] + summary["pending_left"] == N_REQUESTS

    # The requeued run: same state dir, restart count 1, the same requests file (enqueueing
    # it again must not duplicate anything).
    second = _serve(
        tmp_path, model, {"SLURM_RESTART_COUNT": "1"}, "--requests", str(reqs), "--exit-when-idle"
    )
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    summary2 = json.loads(out)
    assert summary2["pending_left"] == 0
    assert summary2["answered"] == summary["pending_left"]

    answers = {p.stem: json.loads(p.read_text())["output_ids"] for p in outbox.iterdir()}
    assert sorted(answers) == [f"r{i:02d}" for i in range(N_REQUESTS)]
    cold = cold_answers(model, prompts, MAX_NEW)
    assert [answers[f"r{i:02d}"] for i in range(N_REQUESTS)] == cold
