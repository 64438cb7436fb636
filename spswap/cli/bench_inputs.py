"""The input checks of ``spswap bench``'s options (pure, but for the reference models
written for ``bench turns``): each refusal names the flag and an example that works."""

from __future__ import annotations

import re
from pathlib import Path

from spswap.config import parse_size
from spswap.errors import ConfigError
from spswap.install_hint import needs_torch

DEFAULT_TURN_PRESETS = "tiny@1,small@2,small@3"


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated sizes with K/M/G suffixes, each above zero."""
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ConfigError("--sizes needs at least one size, e.g. 64M,1G")
    if min(sizes) <= 0:
        raise ConfigError("--sizes: every size must be above zero (nothing to copy in 0 "
                          "bytes), e.g. 64M,1G")  # fmt: skip
    return sizes


def device_problem(device: str) -> str | None:
    """Why ``--device`` names no device a copy can target (None: it does). Pure."""
    if re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        return None
    return (f"--device {device}: not a device; give cpu, cuda or cuda:N (a GPU's index, "
            "e.g. cuda:0)")  # fmt: skip


def make_reference_models(presets: str, directory: Path) -> list[Path]:
    """Reference checkpoints for ``PRESET@SEED,...`` (one directory each, named after
    both), written once: an existing one is reused."""
    try:
        from spswap.engines.reference import save_checkpoint
        from spswap.engines.reference_model import preset
    except ImportError as e:
        raise ConfigError(needs_torch("reference models", e)) from e
    out: list[Path] = []
    for item in (p.strip() for p in presets.split(",") if p.strip()):
        name, _, seed = item.partition("@")
        if seed and not seed.isdigit():
            raise ConfigError(f"--presets {item!r}: the seed after @ must be a number")
        config = preset(name, seed=int(seed or 0))
        path = directory / f"{name}-s{config.seed}"
        if not (path / "config.json").exists():
            save_checkpoint(config, path)
        out.append(path)
    if len(out) < 2:
        raise ConfigError(f"--presets {presets!r}: give at least two, e.g. {DEFAULT_TURN_PRESETS}")
    return out


def parse_floats(text: str, flag: str, example: str) -> tuple[float, ...]:
    """``flag``'s comma-separated positive numbers (``example``: one that works)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated numbers, e.g. "
                          f"{flag} {example}") from None  # fmt: skip
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag} {text!r}: give positive numbers, e.g. {flag} {example}")
    return values
