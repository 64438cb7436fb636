"""Fixtures for the CRIU tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .criu_helpers import Server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    srv.kill()
