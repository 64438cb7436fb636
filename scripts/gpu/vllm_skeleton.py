#!/usr/bin/env python3
"""The skeleton path with a real vLLM on one GPU, end to end, with the real CRIU and the
real driver API (root, from the project root, vLLM on PYTHONPATH, and
``kernel.io_uring_disabled=2`` set before the engines start: vLLM's process holds an
io_uring that CRIU cannot dump):

    SPSWAP_CRIU=.criu-build/bundle/criu PYTHONPATH=$PWD:/tmp/kit/site \\
        python3 scripts/gpu/vllm_skeleton.py --model-a A_DIR --model-b B_DIR --out out.json

Two instances play two Slurm jobs on one GPU; this parent plays spswapd:

1. each model's cold start, measured from a fresh process's spawn to its first token
   (disk read, engine build; page cache dropped first); its greedy answers are the
   reference, and its weights are exported to the pool;
2. B (the earlier-preempted job): up from the pool, preempted: ``sleep(level=2)``, trim,
   CUDA checkpoint, CRIU dump; its image waits on tmpfs;
3. A up from the pool and serving; then **preempt A for B**: A sleeps and parks; A's dump
   (CUDA checkpoint + CRIU dump) runs while B is restored (CRIU restore, CUDA restore,
   unlock), woken (weights from the pool) and asked for its first token. The figure:
   SIGUSR1 to A -> B's first token, against B's cold start;
4. A restored the same way and its answers checked too.

--keep: B's dump leaves it running (CRIU's ``--leave-running``), and it waits frozen (a
cgroup of this script's, or SIGSTOP where none can be made), as spswapd keeps a dumped
instance; B then comes back by thaw + CUDA restore, without CRIU's restore. A is dumped
and restored from its image as before. Also records what B's image is made of (anonymous
memory by mapping, read right before CRIU ran).

Every restored instance's greedy answers must equal its model's cold ones. Writes every
timing to --out and prints one line per step.
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
from typing import Any

MAX_NEW = 16


def _prompts(vocab: int) -> list[list[int]]:
    from spswap.bench.swap import default_prompts

    return default_prompts(vocab)


def _settings(compiled: bool) -> Any:
    from spswap.engines.vllm_engine import VllmSettings

    # In-process engine core: one CUDA process per instance, no ZMQ peers to cut.
    # compiled: vLLM's default (torch.compile + CUDA graphs) instead of eager.
    return VllmSettings(
        multiprocessing=False, gpu_memory_utilization=0.3, enforce_eager=not compiled
    )


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def child_cold(args: argparse.Namespace) -> None:
    """Cold start from disk to the first token, reference answers, export to the pool."""
    from spswap.engines.vllm_engine import VllmEngine
    from spswap.pool.store import Pool

    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    eng = VllmEngine(model, _settings(args.compiled))
    eng.load_from_checkpoint(model)
    prompts = _prompts(vocab)
    first = eng.generate(prompts[:1], 1)
    t_first = time.time()
    out = {
        "t_first_token": t_first,
        "first": first,
        "engine_build_s": eng.last_start_s,
        "answers": eng.generate(prompts, MAX_NEW),
    }
    out["repeat_equal"] = eng.generate(prompts, MAX_NEW) == out["answers"]
    manifest = eng.export_weights(Pool(Path(args.pool)), f"vllm-{model.name}")
    out["digest"] = manifest.digest
    eng.close()
    _write(Path(args.report), out)


def child_instance(args: argparse.Namespace) -> None:
    """Up from the pool; on SIGUSR1 sleep + trim and park; on SIGUSR2 (restored) wake,
    first token, answers."""
    from spswap.engines.vllm_engine import VllmEngine
    from spswap.pool.store import Pool

    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    preempted, resumed = threading.Event(), threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: preempted.set())
    signal.signal(signal.SIGUSR2, lambda *_: resumed.set())
    report: dict[str, Any] = {}
    eng = VllmEngine(model, _settings(args.compiled))
    eng.load_from_pool(Pool(Path(args.pool)), args.digest)
    report["start_from_pool_s"] = eng.last_start_s
    report["answers_up"] = eng.generate(prompts, MAX_NEW)
    _write(Path(args.report), report)
    Path(args.report + ".ready").write_text(str(os.getpid()))
    while not preempted.wait(0.002):
        pass
    report["t_preempt_seen"] = time.time()
    report["sleep_s"] = eng.sleep()
    t0 = time.perf_counter()
    report["trim"] = eng.trim()
    report["trim_s"] = time.perf_counter() - t0
    report["t_parked"] = time.time()
    _write(Path(args.report), report)
    Path(args.report + ".parked").write_text("1")
    while not resumed.wait(0.002):  # dumped in here; restored in here
        pass
    report["t_resumed"] = time.time()
    copy = eng.wake()
    report["wake_s"] = eng.instance.last_duration_s
    report["wake_gb_per_s"] = copy.gb_per_s
    report["first"] = eng.generate(prompts[:1], 1)
    report["t_first_token"] = time.time()
    report["answers_after"] = eng.generate(prompts, MAX_NEW)
    _write(Path(args.report), report)
    Path(args.report + ".done").write_text("1")
    # A restored engine's torch.distributed store connection was restored closed: skip
    # the teardown that would use it; the exit frees the GPU.
    os._exit(0)


class Parent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="spswap-vsk-", dir=args.work_dir))
        self.pool = self.work / "pool"
        self.images = self.work / "images"
        self.images.mkdir(parents=True)
        self.out: dict[str, Any] = {"steps": {}}

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def spawn(self, role: str, model: Path, report: Path, digest: str = "") -> subprocess.Popen:
        log = open(self.work / f"{report.stem}.log", "w")
        argv = [
            sys.executable,
            __file__,
            "--role",
            role,
            "--model",
            str(model),
            "--pool",
            str(self.pool),
            "--report",
            str(report),
            "--digest",
            digest,
            *(["--compiled"] if self.args.compiled else []),
        ]
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_file(self, path: Path, proc: subprocess.Popen | None, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-3000:] for p in self.work.glob("*.log"))
                raise SystemExit(f"waiting for {path.name} failed:\n{logs}")
            time.sleep(0.002)

    def cold(self, key: str, model: Path) -> dict[str, Any]:
        if self.args.compiled:
            # The first compiled start fills vLLM's compile cache; the measured one below
            # finds it warm, as a site's second job of a model would (the smaller figure).
            first = self.cold_once(f"{key}-first", model)
            self.out.setdefault("cold_first_compile_s", {})[key] = first["spawn_to_first_token_s"]
        return self.cold_once(key, model)

    def cold_once(self, key: str, model: Path) -> dict[str, Any]:
        from spswap.fsutil import evict_page_cache

        evict_page_cache(model)
        report = self.work / f"cold-{key}.json"
        t_spawn = time.time()
        proc = self.spawn("cold", model, report)
        rc = proc.wait(timeout=self.args.step_timeout_s)
        if rc != 0:
            log = (self.work / f"cold-{key}.log").read_text()[-3000:]
            raise SystemExit(f"cold start {key} failed (rc {rc}):\n{log}")
        r = json.loads(report.read_text())
        r["spawn_to_first_token_s"] = r["t_first_token"] - t_spawn
        self.log(
            f"{key}: cold start to first token {r['spawn_to_first_token_s']:.2f} s "
            f"(engine build {r['engine_build_s']:.2f} s), repeat equal {r['repeat_equal']}"
        )
        return r

    def up(self, key: str, model: Path, digest: str) -> tuple[subprocess.Popen, Path]:
        report = self.work / f"inst-{key}.json"
        proc = self.spawn("instance", model, report, digest)
        self.wait_file(Path(str(report) + ".ready"), proc, self.args.step_timeout_s)
        return proc, report

    def identity(self, digest: str) -> Any:
        from spswap.checkpoint.images import probe_identity

        return probe_identity(
            engine="vllm",
            engine_version="",
            model_digest=digest,
            engine_config={"skeleton": "gpu"},
            uid=os.getuid(),
        )

    def dump(self, key: str, pid: int, digest: str, keep: bool = False) -> dict[str, Any]:
        from spswap.checkpoint.service import dump_instance

        seen: dict[str, Any] = {}

        def before_criu(tree: list[int]) -> list[tuple[Path, str]] | None:
            seen["composition"] = image_composition(tree)
            return [] if keep else None  # kept: left running (frozen by self.freeze)

        t0 = time.perf_counter()
        rep = dump_instance(
            self.images,
            job_id=key,
            pid=pid,
            identity=self.identity(digest),
            before_criu=before_criu,
        )
        from spswap.checkpoint.image_layout import layout_summary_quietly

        return {"total_s": time.perf_counter() - t0, **rep.to_json(), **seen,
                "layout": layout_summary_quietly(rep.path)}  # fmt: skip

    def freeze(self, pid: int) -> Any:
        """Freeze a kept tree as spswapd does (a cgroup of our own), or SIGSTOP it."""
        from spswap.checkpoint import cgroups
        from spswap.checkpoint.proctree import process_tree_pids

        tree = process_tree_pids(pid)
        try:
            dirs = {}
            for controllers, base in cgroups.own_dirs(cgroups.mounts()).items():
                d = base / f"{cgroups.PREFIX}skeleton-{pid}"
                d.mkdir(exist_ok=True)
                dirs[controllers] = d
            parking = cgroups.Parking(f"skeleton-{pid}", dirs)
            parking.adopt(tree)
            if parking.freeze():
                return parking
            parking.return_home()
            parking.remove()
        except Exception as e:  # noqa: BLE001 - a container may not let us make cgroups
            self.log(f"no cgroup freezer here ({e}): SIGSTOP instead")
        for p in tree:
            os.kill(p, signal.SIGSTOP)
        return tree

    def wake_kept(self, key: str, pid: int, digest: str, frozen: Any) -> dict[str, Any]:
        """spswapd's way back for a kept instance: identity check, thaw, CUDA restore."""
        from spswap.checkpoint.service import kept_image, wake_kept

        t0 = time.perf_counter()
        image = kept_image(self.images, job_id=key, expected=self.identity(digest))
        timings = {"verify": time.perf_counter() - t0}
        t1 = time.perf_counter()
        if isinstance(frozen, list):
            for p in frozen:
                os.kill(p, signal.SIGCONT)
            timings["thaw_sigcont"] = time.perf_counter() - t1
        else:
            frozen.thaw()
            timings["thaw"] = time.perf_counter() - t1
        timings.update(wake_kept(image, pid))
        if not isinstance(frozen, list):  # back to our own cgroups
            frozen.return_home()
            frozen.remove()
        self.stale_image = image  # deleted after the wake (spswapd does it so too)
        return {"total_s": time.perf_counter() - t0, **timings}

    def restore(self, key: str, digest: str) -> tuple[int, dict[str, Any]]:
        from spswap.checkpoint.service import restore_instance

        t0 = time.perf_counter()
        pid, timings = restore_instance(self.images, job_id=key, expected=self.identity(digest))
        return pid, {"total_s": time.perf_counter() - t0, **timings}

    def run(self) -> dict[str, Any]:
        from spswap.checkpoint.images import node_identity

        a_dir, b_dir = Path(self.args.model_a), Path(self.args.model_b)
        out = self.out
        out["node"] = node_identity()
        out["compiled"] = self.args.compiled
        ref = {"a": self.cold("a", a_dir), "b": self.cold("b", b_dir)}
        out["cold"] = {
            k: {
                x: v[x]
                for x in ("spawn_to_first_token_s", "engine_build_s", "repeat_equal", "digest")
            }
            for k, v in ref.items()
        }
        digests = {k: v["digest"] for k, v in ref.items()}

        # B: up, preempted, dumped (the job that waits in the queue with its image)
        proc_b, rep_b = self.up("b", b_dir, digests["b"])
        os.kill(proc_b.pid, signal.SIGUSR1)
        self.wait_file(Path(str(rep_b) + ".parked"), proc_b, 60)
        keep = self.args.keep
        out["keep"] = keep
        out["dump_b"] = self.dump("b", proc_b.pid, digests["b"], keep=keep)
        frozen_b = None
        if keep:
            frozen_b = self.freeze(proc_b.pid)
            out["b_kept_freezer"] = "sigstop" if isinstance(frozen_b, list) else "cgroup"
        else:
            proc_b.wait()
        self.log(f"b dumped: {json.dumps(out['dump_b'])}")

        # A up and serving; then A is preempted for B
        proc_a, rep_a = self.up("a", a_dir, digests["a"])
        self.log("a up; preempting a for b")
        t0 = time.time()
        os.kill(proc_a.pid, signal.SIGUSR1)
        self.wait_file(Path(str(rep_a) + ".parked"), proc_a, 60)
        t_parked = time.time()
        dump_a: dict[str, Any] = {}

        def dump_a_bg() -> None:
            try:
                dump_a.update(self.dump("a", proc_a.pid, digests["a"]))
            except BaseException as e:  # recorded, reported below
                dump_a["error"] = repr(e)

        th = threading.Thread(target=dump_a_bg)
        t_dump_start = time.time()
        th.start()
        if keep:
            pid_b, restore_b = proc_b.pid, self.wake_kept("b", proc_b.pid, digests["b"], frozen_b)
        else:
            pid_b, restore_b = self.restore("b", digests["b"])
        t_restored = time.time()
        os.kill(pid_b, signal.SIGUSR2)
        if keep:
            from spswap.checkpoint.criu import remove_image

            t1 = time.perf_counter()
            remove_image(self.stale_image)
            restore_b["image_removed_after_wake_s"] = time.perf_counter() - t1
        self.wait_file(Path(str(rep_b) + ".done"), None, 120)
        rb = json.loads(rep_b.read_text())
        th.join()
        t_dump_end = time.time()
        proc_a.wait()
        swap = {
            "preempt_to_first_token_s": rb["t_first_token"] - t0,
            "a_sleep_and_park_s": t_parked - t0,
            "b_restore": restore_b,
            "b_restore_s": t_restored - t_parked,
            "b_wake_s": rb["wake_s"],
            "b_wake_gb_per_s": rb["wake_gb_per_s"],
            "b_resumed_to_first_token_s": rb["t_first_token"] - rb["t_resumed"],
            "a_dump": dump_a,
            "a_dump_wall_s": t_dump_end - t_dump_start,
            "b_trim_at_dump": rb.get("trim"),
        }
        swap["sequential_estimate_s"] = (
            swap["a_sleep_and_park_s"]
            + dump_a.get("total_s", 0)
            + swap["b_restore_s"]
            + swap["b_resumed_to_first_token_s"]
        )
        cold_b = ref["b"]["spawn_to_first_token_s"]
        swap["speedup_vs_cold"] = cold_b / swap["preempt_to_first_token_s"]
        out["swap_a_to_b"] = swap
        out["b_answers_equal_cold"] = rb["answers_after"] == ref["b"]["answers"]
        out["b_answers_up_equal_cold"] = rb["answers_up"] == ref["b"]["answers"]
        self.log(
            f"preempt a -> b first token {swap['preempt_to_first_token_s']:.2f} s "
            f"({swap['speedup_vs_cold']:.1f}x vs b's cold {cold_b:.1f} s); "
            f"b answers equal cold: {out['b_answers_equal_cold']}"
        )
        self.log(json.dumps(swap))
        self.wait_gone(pid_b)

        # A back from its image
        if "error" not in dump_a:
            t0 = time.time()
            pid_a, restore_a = self.restore("a", digests["a"])
            os.kill(pid_a, signal.SIGUSR2)
            self.wait_file(Path(str(rep_a) + ".done"), None, 120)
            ra = json.loads(rep_a.read_text())
            out["restore_a"] = {
                **restore_a,
                "restore_to_first_token_s": ra["t_first_token"] - t0,
                "wake_s": ra["wake_s"],
                "trim": ra.get("trim"),
            }
            out["a_answers_equal_cold"] = ra["answers_after"] == ref["a"]["answers"]
            self.log(
                f"a restored: {json.dumps(out['restore_a'])}; answers equal cold: "
                f"{out['a_answers_equal_cold']}"
            )
            self.wait_gone(pid_a)
        return out

    def wait_gone(self, pid: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def image_composition(tree: list[int], top: int = 12) -> dict[str, Any]:
    """Anonymous resident memory of ``tree`` by mapping (what CRIU will write), largest
    first, in MB: which part of the process makes the image big."""
    by_name: dict[str, int] = {}
    for pid in tree:
        name = "?"
        try:
            lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                name = f"{pid}:" + (head[5] if len(head) > 5 else "[anon]")
            elif line.startswith("Anonymous:"):
                by_name[name] = by_name.get(name, 0) + int(head[1]) * 1024
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    return {
        "total_mb": sum(by_name.values()) / 1e6,
        "top_mb": {k: round(v / 1e6, 1) for k, v in ranked[:top]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", choices=["parent", "cold", "instance"], default="parent")
    ap.add_argument("--model", help="(children) the model directory")
    ap.add_argument("--pool", help="(children) the pool directory")
    ap.add_argument("--report", help="(children) where to write the report")
    ap.add_argument("--digest", default="")
    ap.add_argument("--model-a", help="the running model that is preempted")
    ap.add_argument("--model-b", help="the next model (restored from its image)")
    ap.add_argument("--work-dir", default="/dev/shm", help="tmpfs for the pool and images")
    ap.add_argument("--step-timeout-s", type=float, default=180)
    ap.add_argument("--out", default="vllm_skeleton.json")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="vLLM's default torch.compile + CUDA graphs instead of eager, for "
        "every start; cold starts run twice (the second, with a warm "
        "compile cache, is the reference)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="B's dump leaves it running, frozen; it comes back without CRIU's "
        "restore, as spswapd brings back a kept instance",
    )
    args = ap.parse_args()
    if args.role == "cold":
        child_cold(args)
        return 0
    if args.role == "instance":
        child_instance(args)
        return 0
    parent = Parent(args)
    try:
        result = parent.run()
    except BaseException as e:
        parent.out["error"] = repr(e)[-4000:]
        Path(args.out).write_text(json.dumps(parent.out, indent=1))
        raise
    finally:
        logs = [*parent.work.glob("*.log"), *parent.images.glob(".logs/*.log")]
        for log in logs:
            shutil.copy(log, Path(args.out).with_suffix(f".{log.stem}.log"))
        parent.close()
    Path(args.out).write_text(json.dumps(result, indent=1))
    ok = result.get("b_answers_equal_cold") and result.get("a_answers_equal_cold")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
