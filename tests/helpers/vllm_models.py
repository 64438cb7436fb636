"""The Qwen2-shaped test models the vLLM GPU tests run on: given (environment), else made
by scripts/gpu/make_models.py (peaked weights: greedy answers repeat)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 7, 9)  # other weights for each model of a multi-model test


def _make_models() -> Any:
    spec = importlib.util.spec_from_file_location("make_models",
                                                  ROOT / "scripts/gpu/make_models.py")  # fmt: skip
    assert spec and spec.loader
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    return mm


def vllm_test_model(tmp: Path) -> Path:
    """SPSWAP_TEST_VLLM_MODEL, else a 0.5B one made under ``tmp``."""
    given = os.environ.get("SPSWAP_TEST_VLLM_MODEL")
    if given:
        return Path(given)
    return Path(_make_models().write_model(tmp / "models", "0.5b", seed=0,
                                           shard_bytes=4 << 30)["dir"])  # fmt: skip


def vllm_test_models(tmp: Path, n: int = 2) -> list[Path]:
    """The first ``n`` of SPSWAP_TEST_VLLM_MODELS (directories, space-separated), else
    ``n`` 0.5B ones with other weights each, made under ``tmp``."""
    given = os.environ.get("SPSWAP_TEST_VLLM_MODELS", "").split()
    if given:
        assert len(given) >= n, f"SPSWAP_TEST_VLLM_MODELS: give {n} model directories"
        return [Path(p) for p in given[:n]]
    mm = _make_models()
    return [Path(mm.write_model(tmp / "models", "0.5b", seed=seed, shard_bytes=4 << 30)["dir"])
            for seed in SEEDS[:n]]  # fmt: skip
