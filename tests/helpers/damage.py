"""Damage done on purpose to a pool entry: what a restore's check must catch."""

from __future__ import annotations

from typing import Any

import numpy as np

# element types of the pool's tensors, as numpy types of the same size (a reversal moves
# whole elements; bfloat16's bits reorder as uint16)
_ELEMENT = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def reverse_largest_tensor(pool: Any, manifest: Any) -> Any:
    """A whole tensor (the entry's largest: F32, F16 or BF16) overwritten in place with its
    own elements in reverse order: the same bytes, in the wrong places; returns that
    tensor's entry."""
    tensor = max(manifest.tensors, key=lambda t: t.size_bytes)
    assert tensor.dtype in _ELEMENT, tensor.dtype
    with open(pool.data_path(manifest), "r+b") as f:
        f.seek(tensor.offset)
        values = np.frombuffer(f.read(tensor.size_bytes), dtype=_ELEMENT[tensor.dtype])
        f.seek(tensor.offset)
        f.write(values[::-1].tobytes())
    return tensor
