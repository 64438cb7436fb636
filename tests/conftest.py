"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest

from tests.uids import TEST_USER

# Every spswap command reads the node's settings file (/etc/default/spswap); the tests'
# commands and daemons read none unless a test names one (SPSWAP_DEFAULTS), so a file on
# this machine (scripts/slurm_up.sh writes one while its cluster runs) changes no test.
os.environ.setdefault("SPSWAP_DEFAULTS", os.devnull)


@pytest.fixture(scope="session")
def user_uid() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root to create and switch to a second uid")
    try:
        return pwd.getpwnam(TEST_USER).pw_uid
    except KeyError:
        pass
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        TEST_USER], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"useradd {TEST_USER} failed: {r.stderr.strip()}")
    return pwd.getpwnam(TEST_USER).pw_uid
