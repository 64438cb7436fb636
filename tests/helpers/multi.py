"""What the multi-model tests share: small reference models and the router's options."""

from __future__ import annotations

from pathlib import Path

from spswap.engines.reference import save_checkpoint
from spswap.engines.reference_model import preset
from spswap.multi.serve import MultiOptions

MAX_NEW = 6
PROMPT = [3, 1, 4, 1, 5]


def make_models(tmp: Path, n: int) -> list[Path]:
    """``n`` tiny reference models m0, m1, ... with different weights."""
    return [save_checkpoint(preset("tiny", seed=100 + i), tmp / f"m{i}") for i in range(n)]


def options(tmp: Path, models: list[Path], **kw: object) -> MultiOptions:
    """The router's options for ``models``, with the socket and state under ``tmp``."""
    return MultiOptions(
        models=tuple(models), socket_path=tmp / "sock" / "api.sock", state_dir=tmp / "state",
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip
