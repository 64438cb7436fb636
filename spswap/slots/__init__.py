"""GPU slot reservations of one node (no torch, CUDA or Slurm imports)."""

from spswap.slots.alloc import UNITS_PER_GPU, allocate
from spswap.slots.gpus import GpuInfo, discover_gpus
from spswap.slots.table import Reservation, SlotTable, build_snapshot

__all__ = [
    "UNITS_PER_GPU", "GpuInfo", "Reservation", "SlotTable", "allocate", "build_snapshot",
    "discover_gpus",
]  # fmt: skip
