"""A stop signal while a run is queued for its GPU slot ends the run at once (nothing was
started), for both engines: not when the slot wait times out (600 s by default)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from spswap.config import Config  # noqa: E402
from spswap.liveness import Holder  # noqa: E402
from spswap.slots.table import SlotTable  # noqa: E402
from tests.serve.vllm_standin import fake_vllm_metadata, save_model  # noqa: E402

STANDIN = (sys.executable, str(Path(__file__).with_name("vllm_standin.py")))


def _args(engine: str, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    if engine == "vllm":
        model = tmp_path / "m"
        save_model(model)
        site = fake_vllm_metadata(tmp_path / "site")
        return ([str(model), "--engine", "vllm", "--launcher", " ".join(STANDIN)],
                {"PYTHONPATH": str(site)})  # fmt: skip
    from spswap.engines.reference import save_checkpoint
    from spswap.engines.reference_model import preset

    model = save_checkpoint(preset("tiny"), tmp_path / "ref")
    (tmp_path / "req.jsonl").write_text(json.dumps({"id": "q", "prompt_ids": [1, 2],
                                                    "max_new_tokens": 2}) + "\n")  # fmt: skip
    return [str(model), "--device", "cpu", "--requests", str(tmp_path / "req.jsonl")], {}


@pytest.mark.parametrize("engine", ["vllm", "reference"])
@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="writes the slot table directly (root); the "
    "daemon path is the same reserve call, through spswapd",
)
def test_a_stop_while_waiting_for_the_slot_ends_the_run_at_once(
    engine: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    cfg = Config.from_env({}, root=root)
    table = SlotTable.from_config(cfg, gpus=[0])
    held = table.reserve(model="other", units=4, holder=Holder.current(), timeout_s=5)
    args, extra_env = _args(engine, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SPSWAP_ROOT=str(root), SLURM_JOB_ID="88", SLURM_JOB_GPUS="0", SPSWAP_GPUS="0",
               **extra_env)  # fmt: skip
    # no scontrol (Debian's Slurm is in /usr/bin): on a host where Slurm is installed but
    # its controller is down, asking for the requeue alone takes 10-18 s
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/sbin"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spswap.cli", "serve", *args, "--state-dir",
         str(tmp_path / "state"), "--no-checkpoint", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(w.waiter and w.waiter.pid == proc.pid for w in table.waiters()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never queued for the slot"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        table.release(held.id)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 10  # not the slot timeout
    assert json.loads(out)["stopped_by"] == "SIGUSR1"
    assert "SIGUSR1 while waiting for the GPU slot" in err
    # it asked for the requeue (refused or impossible here: no such job, or no Slurm)
    assert "not requeueing" in err or "requeue request refused" in err
