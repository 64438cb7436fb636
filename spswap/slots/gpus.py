"""Which GPUs this node has, for the slot table.

Order of sources: ``SPSWAP_GPUS`` (config), then NVML, then ``CUDA_VISIBLE_DEVICES``.
NVML is the only one that sees every GPU of the node with its physical index, but
initialising it can take seconds on a GPU without persistence mode, so callers ask
once (at start-up) and hand the list to the slot table; the table never asks NVML.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
    """``"config"``, ``"nvml"`` or ``"cuda_visible_devices"``."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def discover_gpus(cfg: Config, env: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """The node's GPUs: ``cfg.gpus`` if set, else NVML, else ``CUDA_VISIBLE_DEVICES``, else none.

    Never raises because NVML or a driver is missing; an empty list means "no GPU found"
    and the caller says how to set ``SPSWAP_GPUS``.
    """
    if cfg.gpus:
        return [GpuInfo(i, None, None, "config") for i in cfg.gpus]
    nvml = nvml_gpus()
    if nvml:
        return nvml
    env = os.environ if env is None else env
    return [
        GpuInfo(i, None, None, "cuda_visible_devices")
        for i in parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    ]


def parse_cuda_visible_devices(text: str | None) -> list[int]:
    """GPU indexes from a ``CUDA_VISIBLE_DEVICES`` value.

    Integers are taken as they are; UUIDs (``GPU-...``, ``MIG-...``) have no index, so
    each stands for its position in the list. ``""``, ``"-1"`` and ``NoDevFiles`` mean none.
    """
    if text is None:
        return []
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or items[0] in ("-1", "NoDevFiles"):
        return []
    try:
        indexes = [int(x) for x in items]
    except ValueError:
        return list(range(len(items)))
    # CUDA stops at the first negative entry; so do we.
    out: list[int] = []
    for i in indexes:
        if i < 0:
            break
        if i not in out:
            out.append(i)
    return out


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
