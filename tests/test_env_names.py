"""Every SPSWAP_* variable the project reads or documents is one Config accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spswap.config import Config

REPO = Path(__file__).resolve().parents[1]
PLACES = ("spswap", "scripts", "slurm", "sbatch_templates", "docs")


def _names() -> set[str]:
    found: set[str] = set()
    for top in PLACES:
        for path in (REPO / top).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".sh", ".sbatch", ".md", ""}:
                text = path.read_text(errors="replace")
                found |= set(re.findall(r"\bSPSWAP_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))
    return found


@pytest.mark.parametrize("name", sorted(_names()))
def test_config_never_refuses_a_name_the_project_uses(name: str) -> None:
    # SPSWAP_CPU_THREADS=2 in a job's environment made every command fail with
    # "unknown setting" although the reference engine reads it
    try:
        Config.from_env({name: "x"})
    except Exception as e:  # a bad value for a real setting is fine; an unknown name is not
        assert "unknown setting" not in str(e), f"{name} is read by spswap but refused: {e}"
