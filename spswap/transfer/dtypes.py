"""safetensors dtype names ("BF16", "F32", ...) <-> torch dtypes."""

from __future__ import annotations

import torch

from spswap.errors import TransferError

_BY_NAME: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "F32": torch.float32,
    "I64": torch.int64, "F64": torch.float64,
}  # fmt: skip
# Newer dtypes exist only in newer torch builds; add them where they are.
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
):  # fmt: skip
    if hasattr(torch, _attr):
        _BY_NAME[_name] = getattr(torch, _attr)

_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}


def to_torch(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name; :class:`TransferError` if unknown."""
    try:
        return _BY_NAME[name]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise TransferError(
            f"dtype {name!r} has no torch equivalent in torch {torch.__version__}; "
            f"known: {known}. Upgrade torch or convert the checkpoint."
        ) from None


def to_safetensors(dtype: torch.dtype) -> str:
    """The safetensors dtype name for a torch dtype; :class:`TransferError` if none."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise TransferError(
            f"torch dtype {dtype} cannot be stored in the pool; "
            f"supported: {', '.join(str(d) for d in _BY_DTYPE)}"
        ) from None
