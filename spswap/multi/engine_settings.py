"""The engine side of a multi-model job, as data (no torch, no vLLM, no processes): which
engines it runs, each vLLM model's settings from the slot table's units, and the order
its engine processes start in.

vLLM 0.26 checks at each engine's start that the device's free memory is at least
``gpu_memory_utilization`` x its total, and profiles the memory it uses while it starts:
two engines starting at once see each other's allocations. So the vLLM models start one
at a time, those placed asleep first (each put to sleep, level 2, right after its start:
only its CUDA context stays), then those placed awake, each start finding at most the
awake models before it on the device (:func:`start_order`). Each model's share is its
units' (``units / 4`` of the device, of which :data:`DEVICE_SHARE`: two awake at 0.45
each by default); ``--kv-cache-gib`` sets its KV cache instead of what the share leaves
(vLLM then skips its own KV sizing), which makes every swap faster.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spswap.engines.model_check import check_engine_name
from spswap.engines.vllm_engine import VllmSettings, kv_cache_bytes
from spswap.errors import ConfigError
from spswap.multi.placement import UNITS_PER_DEVICE, ModelState

DEVICE_SHARE = 0.9  # of the device's memory, for the awake models together (as serve's)


def check_engine(engine: str, device: str) -> None:
    """ConfigError unless ``engine`` can serve a multi-model job on ``device``; said
    before any model is read into the pool."""
    check_engine_name(engine)
    if engine == "vllm" and not device.startswith("cuda"):
        raise ConfigError(f"--engine vllm runs on a GPU, not on {device!r}: run it in a "
                          "job with a GPU (--device cuda), or use --engine reference on "
                          "CPU")  # fmt: skip


def model_settings(units_per_model: int, *, kv_cache_gib: float | None = None,
                   eager: bool = True, max_model_len: int = 4096,
                   gpu_memory_utilization: float | None = None,
                   llm_overrides: dict[str, Any] | None = None) -> VllmSettings:  # fmt: skip
    """One vLLM model's settings when it is awake on ``units_per_model`` quarter units of
    the device: its memory share (``gpu_memory_utilization``, default
    :data:`DEVICE_SHARE` x units / 4: as many models as the awake slots fit awake at
    once) and its KV cache (``kv_cache_gib``; None: vLLM fills the share)."""
    if not 1 <= units_per_model <= UNITS_PER_DEVICE:
        raise ConfigError(f"--units {units_per_model}: give 1 to {UNITS_PER_DEVICE} quarter "
                          "units of a device per awake model")  # fmt: skip
    share = round(DEVICE_SHARE * units_per_model / UNITS_PER_DEVICE, 3)
    if gpu_memory_utilization is None:
        gpu_memory_utilization = share
    elif not 0 < gpu_memory_utilization <= share:
        raise ConfigError(
            f"--gpu-memory-utilization {gpu_memory_utilization:g} is more than a model's "
            f"share of the device with --units {units_per_model} ({share:g}): the awake "
            "models would not fit together; give at most that, or more --units per model"
        )
    if kv_cache_gib is not None and kv_cache_gib <= 0:
        raise ConfigError(f"--kv-cache-gib {kv_cache_gib:g}: give a positive size in GiB")
    settings = VllmSettings(gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_cache_bytes(kv_cache_gib),
                            max_model_len=max_model_len, enforce_eager=eager)  # fmt: skip
    if llm_overrides:
        settings = replace(settings, llm_overrides=tuple(sorted(llm_overrides.items())))
    return settings


def settings_from_json(data: dict[str, Any]) -> VllmSettings:
    """:meth:`VllmSettings.to_json`'s dict back (the engine process's argument)."""
    known = set(VllmSettings.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown vLLM settings {unknown}; known: {sorted(known)}")
    fields = dict(data)
    fields["llm_overrides"] = tuple((str(k), v) for k, v in fields.get("llm_overrides", ()))
    return VllmSettings(**fields)


def start_order(states: dict[str, ModelState]) -> list[tuple[str, bool]]:
    """The models in the order their engines start one at a time, each with whether it
    is put to sleep right after its start: the asleep ones first, then the awake ones
    (in the job's order within each), so no start finds more than the awake models
    before it on the device."""
    asleep = [(n, True) for n, s in states.items() if s is ModelState.ASLEEP]
    return asleep + [(n, False) for n, s in states.items() if s is ModelState.AWAKE]


def one_at_a_time(engine: str) -> bool:
    """Whether the engines of ``engine`` must start one after another (vLLM: see the
    module doc); the reference engine's start all at once."""
    return engine == "vllm"
