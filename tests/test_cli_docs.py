"""docs/cli.md is generated from the commands: it must match them exactly."""

import difflib
import itertools
import re

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


def _sections(text):
    """(heading level, command path, body) of each command's and group's section."""
    parts = re.split(r"^(#+) `(spswap[^`]*)`$", text, flags=re.M)
    return [(len(parts[i]), parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3)]


def test_every_command_has_help():
    sections = _sections(render_cli_md(app))
    assert len(sections) > 20
    for _, path, body in sections:
        assert body.strip(), f"{path} has no help text"


def test_heading_levels_follow_the_command_tree():
    # top-level commands were ### right under the title (and under the group before them:
    # `spswap demo` read as part of `spswap daemon`), groups ## (newcomer walk)
    text = render_cli_md(app)
    levels = [len(h) for h in re.findall(r"^(#+) ", text, flags=re.M)]
    assert levels[0] == 1 and levels.count(1) == 1  # the title
    assert all(b <= a + 1 for a, b in itertools.pairwise(levels)), "a level skipped"
    for level, path, _ in _sections(text):
        assert level == len(path.split()), f"{path} is a level-{level} heading"
    assert ("## `spswap doctor`\n" in text and "## `spswap pool`\n" in text
            and "### `spswap pool ls`\n" in text)  # fmt: skip
