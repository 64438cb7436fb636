"""The node's settings file, ``/etc/default/spswap`` (``$SPSWAP_DEFAULTS`` names another).

One file of ``VAR=value`` lines that every reader takes the same way: the Slurm hooks
(``set -a; . FILE`` in bash), ``slurm/spswapd.service`` (systemd's ``EnvironmentFile=``),
and every ``spswap`` command and the daemon itself (:meth:`spswap.config.Config.load`),
so that root's ``spswap status``, ``doctor``, a ``daemon start`` by hand and the
prolog-started daemon all see one set of settings. Pure parsing here; the one read is
:func:`read_settings_file`.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SETTINGS_FILE = Path("/etc/default/spswap")
SETTINGS_FILE_VAR = "SPSWAP_DEFAULTS"


def settings_file_path(env: Mapping[str, str]) -> Path:
    """The settings file ``env`` points at (``$SPSWAP_DEFAULTS``), else the default."""
    given = env.get(SETTINGS_FILE_VAR, "").strip()
    return Path(given) if given else DEFAULT_SETTINGS_FILE


@dataclass(frozen=True)
class SettingsFile:
    """What one read of the settings file gave."""

    path: Path
    values: dict[str, str] = field(default_factory=dict)
    """Each ``VAR`` the file sets (all of them, not only ``SPSWAP_*``), as bash reads it."""
    problem: str | None = None
    """Why it could not be read (None when it was, or is simply absent)."""
    exists: bool = False


def strip_inline_comment(raw: str) -> str:
    """A value without an inline comment (``256G   # optional``): a ``#`` after
    whitespace starts a comment for bash, which the hooks source the file with; systemd's
    ``EnvironmentFile=`` keeps it in the value, so spswap drops it as bash does."""
    for i, ch in enumerate(raw):
        if ch == "#" and i > 0 and raw[i - 1].isspace():
            return raw[:i].rstrip()
    return raw


def parse_settings_text(text: str) -> dict[str, str]:
    """``VAR=value`` lines as the hooks' ``bash`` gives them: blank and ``#`` lines
    skipped, an ``export`` in front allowed, single or double quotes removed, an inline
    ``# comment`` after an unquoted value dropped. A line of another shape (a command, a
    ``$VAR``) is not a setting and is skipped here; ``bash`` would run it."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, eq, raw = line.partition("=")
        if not eq or not name.isidentifier():
            continue
        raw = raw.strip()
        if raw[:1] in ("'", '"'):
            try:
                words = shlex.split(raw, comments=True)
            except ValueError:
                continue
            out[name] = words[0] if words else ""
        else:
            out[name] = strip_inline_comment(raw)
    return out


def read_settings_file(path: Path) -> SettingsFile:
    """The file's settings; an absent file is no settings, and one that cannot be read
    (a user where root made it 0600) says so in :attr:`SettingsFile.problem`."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return SettingsFile(path)
    except OSError as e:
        return SettingsFile(path, problem=f"cannot read {path} ({e.strerror or e})", exists=True)
    return SettingsFile(path, parse_settings_text(text), exists=True)
