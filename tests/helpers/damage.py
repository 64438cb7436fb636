"""Damage done on purpose to a pool entry: what a restore's check must catch."""

from __future__ import annotations

from typing import Any

import numpy as np


def reverse_largest_tensor(pool: Any, manifest: Any) -> Any:
    """A whole tensor (the entry's largest, F32) overwritten in place with its own values
    in reverse order: the same bytes, in the wrong places; returns that tensor's entry."""
    tensor = max(manifest.tensors, key=lambda t: t.size_bytes)
    assert tensor.dtype == "F32"
    with open(pool.data_path(manifest), "r+b") as f:
        f.seek(tensor.offset)
        values = np.frombuffer(f.read(tensor.size_bytes), dtype=np.float32)
        f.seek(tensor.offset)
        f.write(values[::-1].tobytes())
    return tensor
