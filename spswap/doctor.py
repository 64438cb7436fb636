"""``spswap doctor``: what a node has, and what it lacks, for model swapping.

:func:`collect` runs every check and returns plain data (the CLI prints it as a table or as
JSON); the parsers of system text are pure functions with tests. Each check is
``{name, ok, required, value, detail}``: ``ok`` is True (good), False (broken) or None (a
warning, or not applicable on this node, e.g. no GPU); ``required``: swapping cannot work
without it (a failed test dump that is not is a warning); ``detail`` says what to do.
"""

from __future__ import annotations

import gzip
import os
import platform
import re
import socket
from pathlib import Path
from typing import Any

from spswap import doctor_criu, doctor_node
from spswap.checkpoint import criu, cuda_ckpt
from spswap.checkpoint.cgroups import park_probe
from spswap.checkpoint.freeze_hold import probe
from spswap.checkpoint.images import parse_nvidia_version
from spswap.config import Config
from spswap.doctor_bytecode import bytecode_check
from spswap.doctor_check import check
from spswap.errors import CheckpointFailed
from spswap.install_hint import TORCH_PARTS, pip_install_hint, torch_install_hint
from spswap.settings_check import node_sizes, unfit_settings

KERNEL_NEEDS_CRIU_41 = (6, 13)
KERNEL_TCP_SOCKOPTS = (6, 16)  # SO_PASSCRED on TCP answers EOPNOTSUPP: CRIU 4.1 fails
DRIVER_CHECKPOINT = 570
DRIVER_REMAP = 580
SCHEMA_VERSION = 1


# ---- pure parsers -------------------------------------------------------------------------


def kernel_version(release: str) -> tuple[int, int]:
    """``(6, 18)`` from ``"6.18.44-fc-v669"``; ``(0, 0)`` when unreadable."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def kernel_config_value(config_text: str, key: str) -> str | None:
    """``"y"``/``"m"``/a value for ``key`` in a kernel .config, ``"n"`` when "is not set"."""
    for line in config_text.splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1].strip().strip('"')
        if line.strip() == f"# {key} is not set":
            return "n"
    return None


def driver_major(version: str) -> int:
    return int(version.split(".")[0])


def cgroup_mode(sys_fs_cgroup: Path) -> str:
    """``v2``, ``hybrid`` or ``v1``, from what is mounted at /sys/fs/cgroup."""
    if (sys_fs_cgroup / "cgroup.controllers").exists():
        return "v2"
    if (sys_fs_cgroup / "unified" / "cgroup.controllers").exists():
        return "hybrid"
    return "v1"


# ---- the checks -----------------------------------------------------------------------------


def _criu_checks(release: str, path: Path | None, setting: str) -> list[dict[str, Any]]:
    """The CRIU rows: ``path`` the criu found (None: none), ``setting`` SPSWAP_CRIU."""
    needs_41 = kernel_version(release) >= KERNEL_NEEDS_CRIU_41
    why = "kernels >= 6.13 need CRIU >= 4.1" if needs_41 else "spswap needs CRIU >= 4.1"
    if path is None and setting:
        return [check("criu", False, f"SPSWAP_CRIU={setting}: not found",
                      f"not an executable file: {criu.SETTING_FIX}", required=True)]  # fmt: skip
    if path is None:
        return [
            check("criu", False, "not found", f"run scripts/build_criu.sh ({why})", required=True)
        ]
    try:
        version = criu.criu_version(path)
    except CheckpointFailed as e:
        return [check("criu", False, str(path), str(e), required=True)]
    text = f"{'.'.join(map(str, version))} ({path}{', SPSWAP_CRIU' if setting else ''})"
    if version < criu.MIN_VERSION:
        out = [
            check("criu", False, text, f"too old: {why}; run scripts/build_criu.sh", required=True)
        ]
    else:
        out = [check("criu", True, text, required=True)]
        out.append(criu_tcp_check(release, version, patched_criu(path)))
    if os.geteuid() != 0:
        out.append(check("criu check", None, "not run", "needs root: run `sudo spswap doctor`"))
        return out
    ok, output = criu.criu_check(path)
    last = output.strip().splitlines()[-1] if output.strip() else ""
    out.append(check("criu check", ok, last, "" if ok else output[-500:], required=True))
    return out


def criu_patches(path: Path) -> frozenset[str] | None:
    """The patches scripts/build_criu.sh built ``path`` with (its stamp beside an install,
    ``<prefix>/share/spswap/criu-patches``, or in a bundle); None where there is no stamp."""
    real = Path(os.path.realpath(path))
    for d in (real.parent.parent, real.parent):
        try:
            stamp = (d / "share" / "spswap" / "criu-patches").read_text()
        except OSError:
            continue
        # each word: a patch's name, then (since 2026-12-05) ':' and its sha256's start
        return frozenset(word.split(":")[0] for word in stamp.split())
    return None


def patched_criu(path: Path) -> bool:
    """Whether ``path`` is a CRIU that scripts/build_criu.sh built with its TCP patch."""
    return "sockopts-linux-6.16.patch" in (criu_patches(path) or ())


def _hugepages(cfg: Config, path: Path | None) -> dict[str, Any]:
    try:
        thp = doctor_node.THP_ENABLED.read_text()
    except OSError:
        thp = None
    return doctor_node.hugepages_check(cfg.restore_hugepages, str(path) if path else None,
                                       criu_patches(path) if path else None,
                                       doctor_node.thp_mode(thp))  # fmt: skip


def criu_tcp_check(release: str, version: tuple[int, int, int], patched: bool) -> dict[str, Any]:
    """CRIU 4.1 fails every dump of a TCP socket on Linux >= 6.16 (vLLM holds one) unless
    built with spswap's patch. Pure: the kernel release, CRIU version and stamp decide."""
    name = "criu on TCP sockets"
    if kernel_version(release) < KERNEL_TCP_SOCKOPTS or version[:2] != (4, 1):
        return check(name, True, "ok")
    if patched:
        return check(name, True, "ok (patched by scripts/build_criu.sh)")
    return check(name, False, "CRIU 4.1 on Linux >= 6.16",
                 "cannot dump a process with a TCP socket (vLLM's engine has one): rebuild "
                 "with scripts/build_criu.sh --force, which applies its patch")  # fmt: skip


def _torch() -> dict[str, Any]:
    """Whether the reference engine can run here (information: an admin host needs none)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for part in TORCH_PARTS:
        try:
            versions[part] = metadata.version(part)
        except metadata.PackageNotFoundError:
            versions[part] = None
    return torch_check(versions, f"`{torch_install_hint()}`")


def torch_check(versions: dict[str, str | None], install: str) -> dict[str, Any]:
    """Pure: the torch row from the versions of spswap's ``torch`` extra (None: missing)
    and the command that installs it."""
    missing = [part for part, version in versions.items() if version is None]
    if not missing:
        return check("torch", True, str(versions["torch"]))
    return check("torch", None, f"{', '.join(missing)} not installed",
                 "spswap serve's default engine (reference), spswap demo, models make and "
                 f"check, bench transfer and traffic need them: {install} (an admin host that "
                 "serves no model can do without)")  # fmt: skip


def _vllm() -> dict[str, Any]:
    """Whether ``spswap serve --engine vllm`` can run here (information, not required)."""
    import importlib.util
    from importlib import metadata

    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return check("vllm", None, "not installed",
                     f"--engine vllm needs vLLM: `{pip_install_hint('vllm')}` on the GPU "
                     "nodes (docs/slurm.md, install)")  # fmt: skip
    missing = [m for m in ("uvicorn", "fastapi") if importlib.util.find_spec(m) is None]
    return vllm_check(version, missing)


def vllm_check(version: str, missing: list[str]) -> dict[str, Any]:
    """Pure: the vLLM row from its version and the server modules that are missing."""
    if missing:
        return check("vllm", False, version,
                     f"its OpenAI server cannot start: {', '.join(missing)} missing "
                     "(install vLLM with its dependencies)")  # fmt: skip
    return check("vllm", True, version)


def _kernel_config(release: str) -> dict[str, Any]:
    key = "CONFIG_CHECKPOINT_RESTORE"
    text = None
    try:
        text = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode(errors="replace")
    except OSError:
        try:
            text = Path(f"/boot/config-{release}").read_text(errors="replace")
        except OSError:
            pass
    if text is None:
        return check(
            key, None, "unknown", "no /proc/config.gz or /boot/config-*; `criu check` tells"
        )
    value = kernel_config_value(text, key)
    return check(key, value == "y", value or "absent", "" if value == "y" else "CRIU needs it")


def _io_uring() -> dict[str, Any]:
    name = "kernel.io_uring_disabled"
    try:
        value = Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
    except OSError:
        return check(
            name, None, "absent", "kernel < 6.6: engines that open an io_uring cannot be dumped"
        )
    if value == "2":
        return check(name, True, value)
    return check(
        name, None, value,
        "vLLM holds an io_uring that CRIU cannot dump: `sysctl -w kernel.io_uring_disabled=2` "
        "before engines start",
    )  # fmt: skip


def _nvml_checks(configured: tuple[int, ...] | None) -> list[dict[str, Any]]:
    # without NVML spswapd uses SPSWAP_GPUS: say so rather than "none" (as status does)
    told = f"{','.join(map(str, configured))} (SPSWAP_GPUS)" if configured else None
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        if told:
            return [check("GPUs", True, told)]  # as configured, as spswapd uses them
        return [check("GPUs", None, "NVML not installed",
                      f"on a GPU node: `{pip_install_hint('gpu')}` (nvidia-ml-py), or name the "
                      "GPUs with SPSWAP_GPUS (e.g. 0,1); a login node needs neither")]  # fmt: skip
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - any NVML failure means "no GPU view here"
        if told:
            return [check("GPUs", True, told)]
        fix = (f"NVML: {e}: no NVIDIA driver seen here (a login node needs none); on a GPU "
               "node install the driver, or name the GPUs with SPSWAP_GPUS (e.g. 0,1) in "
               "the settings file (the settings row)")  # fmt: skip
        return [check("GPUs", None, "none", fix)]
    try:
        n = pynvml.nvmlDeviceGetCount()
        names, off = [], []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
            if pynvml.nvmlDeviceGetPersistenceMode(h) != pynvml.NVML_FEATURE_ENABLED:
                off.append(i)
    finally:
        pynvml.nvmlShutdown()
    gpus = check("GPUs", n > 0, f"{n}: {', '.join(sorted(set(names)))}" if n else "0")
    if off:
        persistence = check(
            "persistence mode", None, f"off on GPU {','.join(map(str, off))}",
            "each restore re-initialises an idle GPU (~2 s): `nvidia-smi -pm 1`",
        )  # fmt: skip
    else:
        persistence = check("persistence mode", True if n else None, "on" if n else "no GPU")
    return [gpus, persistence]


def _driver() -> dict[str, Any]:
    try:
        version = parse_nvidia_version(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        version = None
    if version is None:
        return check(
            "NVIDIA driver",
            None,
            "none",
            "nothing on a CPU-only node; on a GPU node, install the NVIDIA driver (no "
            "/proc/driver/nvidia/version here)",
        )
    major = driver_major(version)
    if major >= DRIVER_REMAP:
        return check("NVIDIA driver", True, version)
    if major >= DRIVER_CHECKPOINT:
        return check(
            "NVIDIA driver", None, version, f"restore onto another GPU needs >= {DRIVER_REMAP}"
        )
    return check("NVIDIA driver", False, version, f"CUDA checkpoint needs >= {DRIVER_CHECKPOINT}")


def _cuda_checkpoint(driver_row: dict[str, Any]) -> dict[str, Any]:
    # (a driver is loaded where its row found a version: "none" is a CPU-only node's)
    return cuda_checkpoint_row(cuda_ckpt.unavailable_reason(), driver_row["value"] != "none")


def cuda_checkpoint_row(reason: str | None, driver: bool) -> dict[str, Any]:
    """The cuCheckpoint API's row: ``reason`` it is unavailable (None: it is there);
    ``driver``: an NVIDIA driver is loaded (without one, a CPU-only node, the row says, as
    the driver's row does, that nothing is needed there). Pure."""
    if reason is None:
        return check("cuCheckpoint API", True, "cuda.bindings.driver")
    if not driver:
        reason = f"nothing on a CPU-only node; on a GPU node: {reason}"
    return check("cuCheckpoint API", None, "unavailable", reason)


def _parking() -> dict[str, Any]:
    """Whether spswapd can move a tree out of its job's cgroup while dumping it."""
    if os.geteuid() != 0:  # spswapd (root) does it: a user's probe would say no
        return _needs_root("dump outside the job")
    ok, found = park_probe()
    if ok:
        return check("dump outside the job", True, f"parked cgroups can be made ({found})")
    return check("dump outside the job", None, found,
                 "dumps then run inside the job (requeue after the dump; GraceTime must "
                 "cover it): run spswapd as root with the cgroup file system writable, and "
                 "Slurm with ProctrackType=proctrack/cgroup")  # fmt: skip


def _freeze_hold() -> dict[str, Any]:
    """Whether spswapd can freeze a tree from its credential check to CRIU's seize."""
    if os.geteuid() != 0:
        return _needs_root("freeze for the credential check")
    ok, found = probe()
    if ok:
        return check("freeze for the credential check", True, found)
    return check("freeze for the credential check", None, found,
                 "a tree is then dumped running, and only the image's own credentials keep "
                 "a setuid program's rights out: mount cgroup v2 (or the unified hierarchy) "
                 "writable for root")  # fmt: skip


def _needs_root(name: str) -> dict[str, Any]:
    return check(name, None, f"not checked as uid {os.geteuid()}: spswapd does it as root",
                 "run `sudo spswap doctor` for the node's answer")  # fmt: skip


def collect(cfg: Config) -> dict[str, Any]:
    """Every check for this node: ``{"version", "node", "checks": [...]}``."""
    release = platform.release()
    checks: list[dict[str, Any]] = []
    setting = criu.criu_setting()  # the settings file read once for every CRIU row
    criu_path = criu.find_criu(setting=setting)
    criu_rows = _criu_checks(release, criu_path, setting)
    checks += criu_rows
    usable = all(c["ok"] for c in criu_rows if c["name"] in ("criu", "criu check"))
    checks += doctor_criu.checks(cfg, usable)
    checks.append(_hugepages(cfg, criu_path))
    # an ok row carries no detail: what a kernel >= 6.13 needs of CRIU is the criu row's
    checks.append(check("kernel", True, release))
    checks.append(_kernel_config(release))
    checks.append(_io_uring())
    driver = _driver()
    checks.append(driver)
    checks += _nvml_checks(cfg.gpus)
    checks.append(_cuda_checkpoint(driver))
    checks += doctor_node.storage(cfg)
    sizes = node_sizes(cfg)
    problems = unfit_settings(cfg, sizes)  # the settings row's, and the budgets row's
    checks.append(doctor_node.budgets(cfg, problems, sizes))
    checks.append(check("cgroup mode", True, cgroup_mode(Path("/sys/fs/cgroup"))))
    parking = _parking()
    checks.append(parking)
    checks.append(_freeze_hold())
    can_park = None if os.geteuid() != 0 else parking["ok"] is True
    checks.append(doctor_node.keep_check(cfg.keep_budget_bytes(), can_park, sizes.mem_total_bytes,
                                         on_gpu=cfg.keep_on_gpu))  # fmt: skip
    checks.append(doctor_node.root_ownership(cfg))
    checks.append(doctor_node.settings(problems))
    checks.append(doctor_node.daemon(cfg))
    checks.append(_torch())
    checks.append(_vllm())
    checks.append(bytecode_check())
    return {"version": SCHEMA_VERSION, "node": socket.gethostname(), "checks": checks}


def failed_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The checks that failed (FAIL; what ``--strict`` exits non-zero on). Every FAIL
    counts, not only the ``required`` ones (what swapping cannot work without): the walk's
    settings FAIL (a pool larger than its file system) passed ``--strict``. Warnings do
    not count."""
    return [c for c in report["checks"] if c["ok"] is False]
