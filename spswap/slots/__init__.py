"""GPU slot reservations of one node (no torch, CUDA or Slurm imports)."""

from spswap.slots.alloc import UNITS_PER_GPU, allocate
from spswap.slots.gpus import GpuInfo, discover_gpus
from spswap.slots.state import Reservation, Waiter, build_snapshot
from spswap.slots.table import SlotTable

__all__ = [
    "UNITS_PER_GPU", "GpuInfo", "Reservation", "SlotTable", "Waiter", "allocate",
    "build_snapshot", "discover_gpus",
]  # fmt: skip
