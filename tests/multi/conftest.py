"""The multi-model tests' node: a Config on a fresh root of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from spswap.config import Config


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return Config.from_env({}, root=tmp_path / "root")
