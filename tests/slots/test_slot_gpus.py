"""Where the GPU list comes from: config, NVML, the node's /dev/nvidiaN; never a job's
CUDA_VISIBLE_DEVICES (issue 15 item 9)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from spswap.config import Config
from spswap.slots import gpus as gpus_mod
from spswap.slots.gpus import GpuInfo, discover_gpus, gpu_indexes_from_device_names, nvml_gpus


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ([], []),
        (["nvidia0"], [0]),
        (
            [
                "nvidia1",
                "nvidia0",
                "nvidiactl",
                "nvidia-uvm",
                "nvidia-uvm-tools",
                "nvidia-caps",
                "nvidia-modeset",
                "nvidia10",
                "nvidiaX",
                "null",
            ],
            [0, 1, 10],
        ),
    ],
)
def test_gpu_indexes_from_device_names(names: list[str], expected: list[int]) -> None:
    assert gpu_indexes_from_device_names(names) == expected


def test_config_wins(tmp_path) -> None:
    (tmp_path / "nvidia0").touch()
    cfg = Config.from_env({"SPSWAP_GPUS": "3,1"})
    got = discover_gpus(cfg, dev_dir=str(tmp_path))
    assert got == [GpuInfo(3, None, None, "config"), GpuInfo(1, None, None, "config")]


def test_nvml_fails_quietly_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without nvidia-ml-py, or with it but no driver (its init fails): "no GPUs", no raise.
    # Both stand in on any machine, a GPU machine included, where NVML would find GPUs.
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert nvml_gpus() == []

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    assert nvml_gpus() == []


def test_node_devices_when_nvml_finds_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML finds nothing here on any machine (on a GPU machine it would find the GPU)
    monkeypatch.setattr(gpus_mod, "nvml_gpus", lambda: [])
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (tmp_path / name).touch()
    # a job's view of its GPUs is not the node's: the daemon started from job 1's
    # prolog saw only GPU 0 and refused a later job GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    got = discover_gpus(Config.from_env({}), dev_dir=str(tmp_path))
    assert [(g.index, g.source) for g in got] == [(0, "devices"), (1, "devices")]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert discover_gpus(Config.from_env({}), dev_dir=str(empty)) == []
    assert discover_gpus(Config.from_env({}), dev_dir=str(tmp_path / "absent")) == []
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_nvml_comes_before_devices(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stands in for a GPU, which this machine lacks; the NVML path itself runs in
    # test_nvml_on_a_real_gpu where a driver is present.
    (tmp_path / "nvidia4").touch()
    fake = [GpuInfo(0, "NVIDIA H200", 150_000_000_000, "nvml")]
    monkeypatch.setattr(gpus_mod, "nvml_gpus", lambda: fake)
    assert discover_gpus(Config.from_env({}), dev_dir=str(tmp_path)) == fake


def _has_nvml_gpu() -> bool:
    return bool(nvml_gpus())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_nvml_gpu(), reason="no NVIDIA driver/GPU visible to NVML here")
def test_nvml_on_a_real_gpu() -> None:
    got = discover_gpus(Config.from_env({}))
    assert got and all(g.source == "nvml" and g.name and g.memory_total_bytes for g in got)
    assert [g.index for g in got] == list(range(len(got)))
