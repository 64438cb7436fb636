"""The examples in spswap's docstrings (``>>>``) are run, so none says what the code does
not do."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import spswap

PACKAGE = Path(spswap.__file__).parent
WITH_EXAMPLES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if ">>>" in p.read_text()
)


def test_some_modules_have_examples() -> None:
    assert "spswap.checkpoint.criu_run" in WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
