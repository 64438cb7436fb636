"""One row of ``spswap doctor``'s report (shared by doctor and doctor_criu)."""

from __future__ import annotations

from typing import Any


def check(
    name: str, ok: bool | None, value: str, detail: str = "", *, required: bool = False
) -> dict[str, Any]:
    """One check result."""
    return {"name": name, "ok": ok, "required": required, "value": value, "detail": detail}
