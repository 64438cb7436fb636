"""Which physical GPU a job's GPU index is, and the remap a restore needs when a requeued
job lands on other GPUs than the ones its image was dumped on.

Slurm's gpu GRES names devices by ``/dev/nvidiaN``; N is the driver's *device minor*, which
``/proc/driver/nvidia/gpus/<bus>/information`` pairs with the GPU's UUID. Reading that file
asks the driver nothing (no NVML, no GPU wake-up), so it can sit on the restore path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from spswap.errors import CheckpointFailed

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def parse_information(text: str) -> tuple[int | None, str | None]:
    """``(device minor, GPU UUID)`` from one GPU's ``information`` file."""
    minor: int | None = None
    uuid: str | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "Device Minor" and value.isdigit():
            minor = int(value)
        elif key == "GPU UUID" and value:
            uuid = value
    return minor, uuid


def uuids_by_minor(root: Path = NVIDIA_GPUS) -> dict[int, str]:
    """Device minor -> GPU UUID for every GPU the driver has (empty without a driver)."""
    out: dict[int, str] = {}
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        minor, uuid = parse_information(info.read_text(errors="replace"))
        if minor is not None and uuid:
            out[minor] = uuid
    return out


def job_gpu_uuids(gpus: Sequence[int], by_minor: Mapping[int, str]) -> list[str]:
    """The UUIDs of a job's GPU indexes (SLURM_JOB_GPUS: device minors)."""
    missing = [g for g in gpus if g not in by_minor]
    if missing:
        raise CheckpointFailed(
            f"GPU index(es) {missing} of the job are not among the driver's GPUs "
            f"({sorted(by_minor)}); is gres.conf's File= naming /dev/nvidiaN of this node?"
        )
    return [by_minor[g] for g in gpus]


def remap(dumped_on: Sequence[str], restore_on: Sequence[str]) -> dict[str, str] | None:
    """Old UUID -> new UUID, position by position; None when nothing moves.

    A job asks for the same number of GPUs on every run; a different count cannot be
    remapped (the process would address a GPU that is not its own any more).
    """
    if len(dumped_on) != len(restore_on):
        raise CheckpointFailed(
            f"the image was dumped on {len(dumped_on)} GPU(s), this run has "
            f"{len(restore_on)}: cannot remap; cold start"
        )
    pairs = dict(zip(dumped_on, restore_on, strict=True))
    return None if all(a == b for a, b in pairs.items()) else pairs
