#!/usr/bin/env python3
"""Why does vLLM's OpenAI server process (the API server, beside the engine core) hold
CUDA state? GPU machine, root, vLLM kit on PYTHONPATH:

    python3 scripts/gpu/api_cuda_probe.py MODEL_DIR [--env NAME=VALUE ...]

In every serve test the server's image holds two CUDA processes: the engine core and the
API server (``cuda_restore`` of the API server ~15 ms, its image ~0.66 GB). This starts
the server as ``spswap serve --engine vllm`` does (``spswap.serve.vllm_api``), with a
``sitecustomize`` on PYTHONPATH that records, in every process of the tree, the first
calls that start CUDA or NVML (torch's lazy CUDA init, its device count through the CUDA
runtime, NVML's init) with the Python stack that made them. Once the server answers
``/health`` it prints, per process: its command, the /dev/nvidia* files it holds,
whether libcuda is mapped, its resident and anonymous bytes and its largest mappings,
its GPU memory (nvidia-smi) and its CUDA checkpoint state; for the API server, the CUDA
checkpoint and restore timed. ``--env``: extra environment for the server (e.g.
``PYTORCH_NVML_BASED_CUDA_CHECK=1``), to try what keeps the API server off CUDA.
Prints ``TRACE``, ``PROC`` and ``CKPT`` JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The sitecustomize written for the server's processes: hooks installed once torch.cuda
# (or an NVML binding) is imported, each logging its first call with its stack.
SITECUSTOMIZE = r"""
import importlib.abc, importlib.machinery, json, os, sys, traceback

_DIR = os.environ.get("APICUDA_TRACE_DIR")
_seen = set()

def _log(event):
    if event in _seen or not _DIR:
        return
    _seen.add(event)
    stack = [f"{f.filename.split('site-packages/')[-1].split('/site/')[-1]}:{f.lineno} {f.name}"
             for f in traceback.extract_stack()[:-2]]
    rec = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[:3], "event": event,
           "stack": stack[-14:]}
    with open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")

def _wrap(obj, name, event):
    orig = getattr(obj, name, None)
    if orig is None or getattr(orig, "_spswap_traced", False):
        return
    def traced(*a, **k):
        _log(event)
        return orig(*a, **k)
    traced._spswap_traced = True
    setattr(obj, name, traced)

def _patch(modname, module):
    if modname == "torch.cuda":
        import torch
        _wrap(module, "_lazy_init", "torch.cuda._lazy_init")
        _wrap(torch._C, "_cuda_getDeviceCount", "torch._C._cuda_getDeviceCount")
        _wrap(torch._C, "_cuda_init", "torch._C._cuda_init")
    elif modname in ("pynvml", "vllm.third_party.pynvml"):
        _wrap(module, "nvmlInit", f"{modname}.nvmlInit")

class _Finder(importlib.abc.MetaPathFinder):
    WATCH = {"torch.cuda", "pynvml", "vllm.third_party.pynvml"}
    def find_spec(self, fullname, path, target=None):
        if fullname not in self.WATCH:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        def exec_and_patch(module):
            exec_module(module)
            _patch(fullname, module)
        loader.exec_module = exec_and_patch
        return spec

sys.meta_path.insert(0, _Finder())
"""


def write_sitecustomize(directory: Path) -> None:
    """The tracing ``sitecustomize.py`` in ``directory`` (prepend it to PYTHONPATH)."""
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)


def read_traces(trace_dir: Path) -> list[dict[str, Any]]:
    """Every record the server's processes wrote, in file order."""
    out = []
    for f in sorted(trace_dir.glob("trace-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_memory_by_pid() -> dict[int, int]:
    """nvidia-smi's compute processes: pid -> used GPU memory (MiB)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = int(parts[1])
    return out


def largest_mappings(pid: int, count: int = 8) -> list[dict[str, Any]]:
    """The ``count`` mappings of ``pid`` with the most resident bytes (/proc/PID/smaps):
    where a process's image goes (heap, anonymous regions, the driver's)."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            current = {"name": head[5] if len(head) > 5 else "[anon]", "perms": head[1],
                       "size_bytes": hi - lo, "rss_bytes": 0}  # fmt: skip
            out.append(current)
        elif current is not None and line.startswith("Rss:"):
            current["rss_bytes"] = int(head[1]) * 1024
    return sorted(out, key=lambda m: -m["rss_bytes"])[:count]


def describe(pid: int, gpu_mib: dict[int, int]) -> dict[str, Any]:
    """What one process of the tree holds of the GPU and of memory."""
    from spswap.checkpoint import cuda_ckpt, proctree

    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:4]
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return {"pid": pid, "gone": True}
    try:
        state = cuda_ckpt.get_state(pid)
    except Exception as e:  # noqa: BLE001 - a probe: any answer is a finding
        state = f"error: {e}"
    nvidia = sorted({v for v in proctree.fd_links(pid).values() if v.startswith("/dev/nvidia")})
    return {"pid": pid, "cmd": [c.decode(errors="replace")[-60:] for c in cmd],
            "nvidia_fds": nvidia, "libcuda_mapped": "libcuda.so" in maps,
            "rss_bytes": _kib(pid, "Rss"), "anon_bytes": _kib(pid, "Anonymous"),
            "gpu_mib": gpu_mib.get(pid), "cuda_state": state,
            "largest": largest_mappings(pid)}  # fmt: skip


def time_api_checkpoint(pid: int) -> dict[str, Any]:
    """The API server's own CUDA checkpoint and restore, timed (as spswapd does them)."""
    from spswap.checkpoint import cuda_ckpt

    out: dict[str, Any] = {"pid": pid}
    try:
        s = time.perf_counter()
        cuda_ckpt.lock(pid)
        cuda_ckpt.checkpoint(pid)
        out["checkpoint_s"] = time.perf_counter() - s
        s = time.perf_counter()
        cuda_ckpt.restore(pid)
        cuda_ckpt.unlock(pid)
        out["restore_s"] = time.perf_counter() - s
    except Exception as e:  # noqa: BLE001 - a probe: any answer is a finding
        out["error"] = str(e)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--timeout-s", type=float, default=240.0)
    args = ap.parse_args()

    from spswap.checkpoint import proctree
    from spswap.engines.vllm_engine import VllmSettings
    from spswap.serve.vllm_api import VllmApiServer

    work = Path(tempfile.mkdtemp(prefix="spswap-apicuda-"))
    trace_dir, site_dir = work / "trace", work / "site"
    trace_dir.mkdir()
    site_dir.mkdir()
    write_sitecustomize(site_dir)
    os.environ["PYTHONPATH"] = f"{site_dir}:{os.environ.get('PYTHONPATH', '')}"
    os.environ["APICUDA_TRACE_DIR"] = str(trace_dir)
    for pair in args.env:
        name, _, value = pair.partition("=")
        os.environ[name] = value
    settings = VllmSettings(kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)))
    server = VllmApiServer(args.model_dir, work / "sock", settings, log_path=work / "server.log")
    print("START", json.dumps({"env": args.env, "model": str(args.model_dir)}), flush=True)
    try:
        start_s = server.start(dummy=False, timeout_s=args.timeout_s)
        assert server.proc is not None
        api_pid = server.proc.pid
        gpu_mib = gpu_memory_by_pid()
        print("START", json.dumps({"ready_s": round(start_s, 2), "api_pid": api_pid}))
        for rec in read_traces(trace_dir):
            print("TRACE", json.dumps(rec))
        for pid in proctree.process_tree_pids(api_pid):
            print("PROC", json.dumps(describe(pid, gpu_mib)))
        print("CKPT", json.dumps(time_api_checkpoint(api_pid)))
    except Exception as e:  # noqa: BLE001 - say what failed, with the server's log
        print("ERROR", e, file=sys.stderr)
        log = work / "server.log"
        if log.exists():
            print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
        return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
