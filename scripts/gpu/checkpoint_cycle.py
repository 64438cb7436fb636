#!/usr/bin/env python3
"""A CUDA reference-engine process through Up -> Sleep -> Checkpoint -> Saved -> Up, on a GPU
machine, with the real CRIU and the real driver API (run as root, from the project root):

    SPSWAP_CRIU=.criu-build/bundle/criu PYTHONPATH=$PWD python3 scripts/gpu/checkpoint_cycle.py \
        --preset 1g --out result.json

The parent plays the daemon (spswap.checkpoint.service: CUDA checkpoint + CRIU dump, then
CRIU restore + CUDA restore + unlock); the child is the instance (loads from the pool,
answers, sleeps, parks; after the restore wakes from the pool and answers again). Prints one
line per step and writes every timing and the answers' identity to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18]]
MAX_NEW = 16


def child(args: argparse.Namespace) -> None:
    """The instance: Up, answer, Sleep, park; after the restore: wake, answer."""
    import torch

    from spswap.engines.reference import ReferenceEngine, load_config
    from spswap.pool.store import Pool

    work = Path(args.work)
    resumed = threading.Event()
    signal.signal(signal.SIGUSR2, lambda *_: resumed.set())
    report: dict = {}
    pool = Pool(work / "pool")
    cuda = args.device.startswith("cuda")
    eng = ReferenceEngine(load_config(work / "model"), args.device, name="ref")
    t0 = time.perf_counter()
    eng.load_from_pool(pool, args.digest)
    report["load_from_pool_s"] = time.perf_counter() - t0
    report["answers_before"] = [eng.generate([p], MAX_NEW)[0] for p in PROMPTS]
    if cuda:
        torch.cuda.synchronize()
        report["gpu_bytes_up"] = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    eng.sleep()
    report["sleep_s"] = time.perf_counter() - t0
    if cuda:
        report["gpu_bytes_asleep"] = torch.cuda.memory_allocated()
    (work / "child-report.json").write_text(json.dumps(report))
    (work / "ready").write_text(str(os.getpid()))
    while not resumed.wait(0.05):  # dumped in here; restored in here
        pass
    t0 = time.perf_counter()
    wake = eng.wake()
    report["wake_s"] = time.perf_counter() - t0
    report["wake_gb_per_s"] = wake.gb_per_s
    t0 = time.perf_counter()
    report["answers_after"] = [eng.generate([p], MAX_NEW)[0] for p in PROMPTS]
    report["first_answers_s"] = time.perf_counter() - t0
    (work / "child-report.json").write_text(json.dumps(report))
    (work / "done").write_text("1")


def parent(args: argparse.Namespace) -> dict:
    from spswap.checkpoint import cuda_ckpt
    from spswap.checkpoint.image_layout import layout_summary_quietly
    from spswap.checkpoint.images import node_identity, probe_identity
    from spswap.checkpoint.service import dump_instance, restore_instance
    from spswap.engines.reference import ReferenceEngine, save_checkpoint
    from spswap.engines.reference_model import preset
    from spswap.pool.store import Pool

    work = Path(tempfile.mkdtemp(prefix="spswap-ckpt-", dir="/dev/shm"))
    cfg = preset(args.preset)
    save_checkpoint(cfg, work / "model")
    manifest = Pool(work / "pool").import_checkpoint(work / "model")
    cold = ReferenceEngine(cfg, args.device)
    cold.load_from_checkpoint(work / "model")
    cold_answers = [cold.generate([p], MAX_NEW)[0] for p in PROMPTS]
    cold.close()
    out: dict = {
        "preset": args.preset,
        "weight_bytes": cfg.weight_bytes,
        "node": node_identity(),
        "cuda_checkpoint_available": cuda_ckpt.available(),
    }
    log = open(work / "child.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            "--work",
            str(work),
            "--digest",
            manifest.digest,
            "--device",
            args.device,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (work / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"child failed:\n{(work / 'child.log').read_text()}")
        time.sleep(0.05)
    ident = probe_identity(
        engine="reference",
        engine_version="",
        model_digest=manifest.digest,
        engine_config={"cycle": "gpu"},
        uid=0,
    )
    t0 = time.perf_counter()
    rep = dump_instance(work / "images", job_id="gpu", pid=proc.pid, identity=ident)
    out["dump_total_s"] = time.perf_counter() - t0
    out["dump"] = {**rep.to_json(), "layout": layout_summary_quietly(rep.path)}
    proc.wait()  # reap: the pid must be free for the restore
    print("dumped:", json.dumps(out["dump"]), flush=True)
    t0 = time.perf_counter()
    pid, timings = restore_instance(work / "images", job_id="gpu", expected=ident)
    out["restore_s"] = time.perf_counter() - t0
    out["restore"] = timings
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 120
    while not (work / "done").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"restored child did not finish:\n{(work / 'child.log').read_text()}")
        time.sleep(0.01)
    out["resume_to_answers_s"] = time.perf_counter() - t0
    child_report = json.loads((work / "child-report.json").read_text())
    out["child"] = {k: v for k, v in child_report.items() if not k.startswith("answers")}
    out["answers_equal_before_after"] = (
        child_report["answers_before"] == child_report["answers_after"]
    )
    out["answers_equal_cold"] = child_report["answers_after"] == cold_answers
    out["same_pid"] = pid == proc.pid
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--work")
    ap.add_argument("--digest")
    ap.add_argument("--preset", default="1g")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the flow without a GPU")
    ap.add_argument("--out", default="checkpoint_cycle.json")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    result = parent(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    ok = result["answers_equal_before_after"] and result["answers_equal_cold"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
