"""docs/cli.md is generated from the commands: it must match them exactly."""

import difflib

import pytest

from spswap.cli.app import app
from spswap.cli.docs import DOC_PATH, render_cli_md


def test_cli_reference_is_current():
    expected = render_cli_md(app)
    actual = DOC_PATH.read_text()
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                actual.splitlines(True), expected.splitlines(True), "docs/cli.md", "generated"
            )
        )
        pytest.fail(
            f"docs/cli.md is out of date:\n{diff}\n"
            "regenerate with: python -m spswap.cli.docs --write"
        )


def test_every_command_has_help():
    text = render_cli_md(app)
    for block in text.split("### ")[1:]:
        title, _, body = block.partition("\n")
        assert body.strip(), f"{title} has no help text"
