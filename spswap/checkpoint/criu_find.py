"""Which CRIU spswap runs: found (``$SPSWAP_CRIU``, PATH, /usr/local/sbin), its version
checked (>= 4.1) and ``criu check`` run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from spswap.checkpoint import criu_argv
from spswap.checkpoint.criu_log import NOISE
from spswap.config import setting_text
from spswap.errors import CheckpointFailed
from spswap.settings_file import read_settings_file, settings_file_path

MIN_VERSION = (4, 1, 0)
BUILD_HINT = "build one with scripts/build_criu.sh (CRIU >= 4.1 is needed on kernels >= 6.13)"


def criu_setting(env: dict[str, str] | None = None) -> str:
    """``SPSWAP_CRIU``: the environment's, else the node's settings file's (as every other
    setting); "" when neither sets it. With ``env`` given, that alone."""
    if env is None:
        env = dict(os.environ)
        if "SPSWAP_CRIU" not in env:
            env["SPSWAP_CRIU"] = read_settings_file(settings_file_path(env)).values.get(
                "SPSWAP_CRIU", "")  # fmt: skip
    return setting_text(env.get("SPSWAP_CRIU") or "")  # as the hooks' shell reads it


def find_criu(env: dict[str, str] | None = None, *, setting: str | None = None) -> Path | None:
    """The criu to use: :func:`criu_setting` (``setting``: that value, already read), then
    PATH, then /usr/local/sbin/criu."""
    explicit = criu_setting(env) if setting is None else setting
    env = dict(os.environ) if env is None else env
    if explicit:
        return Path(explicit) if os.access(explicit, os.X_OK) else None
    on_path = shutil.which("criu", path=env.get("PATH", os.defpath) + ":/usr/sbin:/sbin")
    if on_path:
        return Path(on_path)
    fallback = Path("/usr/local/sbin/criu")
    return fallback if os.access(fallback, os.X_OK) else None


# what to do where SPSWAP_CRIU names no executable file (also spswap doctor's advice)
SETTING_FIX = ("set SPSWAP_CRIU to the criu binary (in /etc/default/spswap), or remove it to "
               "use PATH's or /usr/local/sbin/criu")  # fmt: skip


def missing_text(setting: str) -> str:
    """Why no CRIU was found, and the fix: a ``SPSWAP_CRIU`` naming no program is the
    setting's fault, not a missing CRIU."""
    if setting:
        return f"SPSWAP_CRIU={setting} is not an executable file: {SETTING_FIX}"
    return f"no criu found (SPSWAP_CRIU, PATH, /usr/local/sbin): {BUILD_HINT}"


def criu_version(path: Path) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a criu binary; CheckpointFailed when it cannot say."""
    try:
        res = subprocess.run(
            criu_argv.version_argv(str(path)), capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckpointFailed(f"cannot run {path} --version ({e}); {BUILD_HINT}") from None
    version = criu_argv.parse_version(res.stdout + res.stderr)
    if version is None:
        raise CheckpointFailed(
            f"{path} --version printed no version ({(res.stdout + res.stderr).strip()!r}); "
            f"{BUILD_HINT}"
        )
    return version


def criu_check(path: Path) -> tuple[bool, str]:
    """Run ``criu check``: (passed, its output). Needs root."""
    try:
        res = subprocess.run(
            criu_argv.check_argv(str(path)), capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    output = "\n".join(
        line for line in (res.stdout + res.stderr).splitlines() if NOISE not in line
    ).strip()
    return res.returncode == 0, output


def available() -> bool:
    """True when a criu >= 4.1 is found (whether the kernel agrees is ``criu_check``'s job)."""
    path = find_criu()
    if path is None:
        return False
    try:
        return criu_version(path) >= MIN_VERSION
    except CheckpointFailed:
        return False


def _require_criu(criu: Path | None) -> tuple[Path, tuple[int, int, int]]:
    setting = None if criu else criu_setting()  # read once, for the search and the message
    path = criu or find_criu(setting=setting)
    if path is None:
        raise CheckpointFailed(missing_text(setting or ""))
    version = criu_version(path)
    if version < MIN_VERSION:
        have = ".".join(map(str, version))
        raise CheckpointFailed(f"{path} is CRIU {have}, too old; {BUILD_HINT}")
    if os.geteuid() != 0:
        raise CheckpointFailed(
            "CRIU dumps and restores need root: ask the spswap daemon (it runs as root) to do it"
        )
    return path, version
