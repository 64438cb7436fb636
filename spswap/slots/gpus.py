"""Which GPUs this node has, for the slot table.

Order of sources: ``SPSWAP_GPUS`` (config), then NVML, then the node's device files
(``/dev/nvidia0``, ``/dev/nvidia1``...: the driver makes one per GPU, named by its minor
number, which Slurm's ``gres.conf`` names too). Never ``CUDA_VISIBLE_DEVICES``: that is
one job's view (spswapd, started from the first job's prolog, saw only that job's GPU
0 and refused a later job GPU 1). NVML is the only one that names each GPU, but
initialising it can take seconds on a GPU without persistence mode, so callers ask
once (at start-up) and hand the list to the slot table; the table never asks NVML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from spswap.config import Config


@dataclass
class GpuInfo:
    """One GPU as the slot table sees it: its index on the node and where that came from."""

    index: int
    name: str | None
    memory_total_bytes: int | None
    source: str
    """``"config"``, ``"nvml"`` or ``"devices"`` (``/dev/nvidiaN``)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


DEV_DIR = "/dev"
_DEVICE = re.compile(r"nvidia(\d+)")


def discover_gpus(cfg: Config, *, dev_dir: str = DEV_DIR) -> list[GpuInfo]:
    """The node's GPUs: ``cfg.gpus`` if set, else NVML, else ``dev_dir/nvidiaN``, else none.

    Never raises because NVML or a driver is missing; an empty list means "no GPU found"
    and the caller says how to set ``SPSWAP_GPUS``.
    """
    if cfg.gpus:
        return [GpuInfo(i, None, None, "config") for i in cfg.gpus]
    nvml = nvml_gpus()
    if nvml:
        return nvml
    try:
        names = os.listdir(dev_dir)
    except OSError:
        names = []
    return [GpuInfo(i, None, None, "devices") for i in gpu_indexes_from_device_names(names)]


def gpu_indexes_from_device_names(names: Iterable[str]) -> list[int]:
    """GPU indexes from the names in ``/dev``: ``nvidia<N>`` only (not ``nvidiactl``,
    ``nvidia-uvm``, ``nvidia-caps``), sorted."""
    return sorted({int(m[1]) for n in names if (m := _DEVICE.fullmatch(n))})


def nvml_gpus() -> list[GpuInfo]:
    """Every GPU NVML reports, or [] when pynvml or the driver is absent or fails."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except Exception:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            out.append(GpuInfo(i, str(name), memory, "nvml"))
        return out
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
