"""Where the GPU list comes from: config, NVML, CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from spswap.config import Config
from spswap.slots import gpus as gpus_mod
from spswap.slots.gpus import GpuInfo, discover_gpus, nvml_gpus, parse_cuda_visible_devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, []),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
        ("0", [0]),
        ("2,3", [2, 3]),
        (" 1, 0 ", [1, 0]),
        ("0,0,1", [0, 1]),
        ("1,-1,2", [1]),
        (
            "GPU-8a5b2c1e-aaaa-bbbb-cccc-000000000001,GPU-8a5b2c1e-aaaa-bbbb-cccc-000000000002",
            [0, 1],
        ),
        ("MIG-4f6e3c2a-1111-2222-3333-444444444444", [0]),
    ],
)
def test_parse_cuda_visible_devices(text: str | None, expected: list[int]) -> None:
    assert parse_cuda_visible_devices(text) == expected


def test_config_wins() -> None:
    cfg = Config.from_env({"SPSWAP_GPUS": "3,1"})
    got = discover_gpus(cfg, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert got == [GpuInfo(3, None, None, "config"), GpuInfo(1, None, None, "config")]


def test_cuda_visible_devices_when_nvml_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine has no NVIDIA driver: NVML must fail quietly, not raise.
    assert nvml_gpus() == []
    got = discover_gpus(Config.from_env({}), env={"CUDA_VISIBLE_DEVICES": "2,5"})
    assert [(g.index, g.source) for g in got] == [
        (2, "cuda_visible_devices"),
        (5, "cuda_visible_devices"),
    ]
    assert discover_gpus(Config.from_env({}), env={}) == []


def test_nvml_comes_before_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stands in for a GPU, which this machine lacks; the NVML path itself runs in
    # test_nvml_on_a_real_gpu where a driver is present.
    fake = [GpuInfo(0, "NVIDIA H200", 150_000_000_000, "nvml")]
    monkeypatch.setattr(gpus_mod, "nvml_gpus", lambda: fake)
    assert discover_gpus(Config.from_env({}), env={"CUDA_VISIBLE_DEVICES": "4"}) == fake


def _has_nvml_gpu() -> bool:
    return bool(nvml_gpus())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_nvml_gpu(), reason="no NVIDIA driver/GPU visible to NVML here")
def test_nvml_on_a_real_gpu() -> None:
    got = discover_gpus(Config.from_env({}), env={})
    assert got and all(g.source == "nvml" and g.name and g.memory_total_bytes for g in got)
    assert [g.index for g in got] == list(range(len(got)))
