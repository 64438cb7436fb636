"""GPU index -> UUID and the restore's remap (pure; the driver's files are captured text)."""

from __future__ import annotations

import pytest

from spswap.checkpoint.gpu_map import job_gpu_uuids, parse_information, remap, uuids_by_minor
from spswap.errors import CheckpointFailed

# The shape of /proc/driver/nvidia/gpus/<bus>/information (driver 580).
INFO = """Model: \t\t NVIDIA H200
IRQ:   \t\t 142
GPU UUID: \t GPU-1d3c9e2a-5b6f-7a8b-9c0d-1e2f3a4b5c6d
Video BIOS: \t 96.00.a5.00.01
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:1b:00.0
Device Minor: \t 3
GPU Firmware: \t 580.159.04
GPU Excluded:\t No
"""


def test_parse_information():
    assert parse_information(INFO) == (3, "GPU-1d3c9e2a-5b6f-7a8b-9c0d-1e2f3a4b5c6d")
    assert parse_information("Model: x\n") == (None, None)


def test_uuids_by_minor_reads_every_gpu(tmp_path):
    for bus, minor, uuid in (("0000:1b:00.0", 3, "GPU-a"), ("0000:2c:00.0", 0, "GPU-b")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            INFO.replace("Device Minor: \t 3", f"Device Minor: \t {minor}").replace(
                "GPU-1d3c9e2a-5b6f-7a8b-9c0d-1e2f3a4b5c6d", uuid
            )
        )
    assert uuids_by_minor(tmp_path) == {0: "GPU-b", 3: "GPU-a"}
    assert uuids_by_minor(tmp_path / "absent") == {}
    assert job_gpu_uuids([3, 0], uuids_by_minor(tmp_path)) == ["GPU-a", "GPU-b"]
    with pytest.raises(CheckpointFailed, match=r"\[7\] of the job are not"):
        job_gpu_uuids([7], uuids_by_minor(tmp_path))


def test_remap():
    assert remap(["GPU-a"], ["GPU-a"]) is None
    assert remap(["GPU-a"], ["GPU-b"]) == {"GPU-a": "GPU-b"}
    assert remap(["GPU-a", "GPU-b"], ["GPU-b", "GPU-a"]) == {"GPU-a": "GPU-b", "GPU-b": "GPU-a"}
    with pytest.raises(CheckpointFailed, match="cannot remap"):
        remap(["GPU-a"], ["GPU-a", "GPU-b"])
