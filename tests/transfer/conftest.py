from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spswap.pool.store import Pool  # noqa: E402


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    return Pool(tmp_path / "pool", capacity_bytes=1 << 30)


def write_entry(pool: Pool, name: str, tensors: dict[str, torch.Tensor]):
    """A real pool entry holding ``tensors`` (written through pool.writer)."""
    from spswap.transfer.dtypes import to_safetensors

    with pool.writer(name) as w:
        for tname, t in tensors.items():
            raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
            w.add(tname, to_safetensors(t.dtype), tuple(t.shape), raw)
    return w.manifest
