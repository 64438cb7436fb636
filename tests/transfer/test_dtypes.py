from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spswap.errors import TransferError  # noqa: E402
from spswap.pool.manifest import DTYPE_SIZES  # noqa: E402
from spswap.transfer.dtypes import to_safetensors, to_torch  # noqa: E402

NAMES = ["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "I64", "F64"]


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_and_sizes_agree_with_manifest(name: str) -> None:
    dt = to_torch(name)
    assert to_safetensors(dt) == name
    assert torch.empty(0, dtype=dt).element_size() == DTYPE_SIZES[name]


def test_unknown_names_say_what_is_known() -> None:
    with pytest.raises(TransferError, match="known: .*BF16"):
        to_torch("F4")
    with pytest.raises(TransferError, match="cannot be stored"):
        to_safetensors(torch.complex64)
