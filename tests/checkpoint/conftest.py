"""Fixtures for the CRIU tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from tests.uids import node_root

from .criu_helpers import Server, criu_skip_reason


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    srv.kill()


@pytest.fixture
def node() -> Iterator[Config]:
    """A real spswapd on a short 0755 state root, for the serve-level CRIU tests (skipped
    with the reason where CRIU cannot run)."""
    reason = criu_skip_reason()
    if reason:
        pytest.skip(reason)
    with node_root("spsc-") as cfg:
        lifecycle.start(cfg, wait_s=15.0)
        yield cfg
