"""NVML's figure for what one process holds on the GPUs (the packing's room check)."""

from __future__ import annotations

import os

import pytest

from spswap.engines.gpu_held import process_gpu_bytes
from spswap.slots.gpus import nvml_gpus


def test_no_figure_without_nvml_or_for_a_process_it_does_not_list() -> None:
    # pid 1 holds no GPU memory on any machine this runs on; without a driver: no figure
    assert process_gpu_bytes(1) is None
    if not nvml_gpus():
        assert process_gpu_bytes(os.getpid()) is None


def test_a_process_holding_gpu_memory_is_listed_with_at_least_that() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not nvml_gpus():
        pytest.skip("needs a CUDA GPU and NVML (none visible)")
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    held = process_gpu_bytes(os.getpid())
    assert held is not None, "NVML does not list this process (another pid namespace?)"
    assert held >= block.numel()  # (its CUDA context too)
