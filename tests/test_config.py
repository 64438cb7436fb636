from pathlib import Path

import pytest

from spswap.config import Config, parse_size
from spswap.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000", 1000), ("4K", 4096), ("64M", 64 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30),
     ("1T", 1 << 40), ("512mb", 512 << 20)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "12Q", "-1G", "abc"])
def test_parse_size_rejects_with_the_fix(text):
    with pytest.raises(ConfigError, match="K/M/G/T suffix"):
        parse_size(text)


def test_from_env_reads_prefixed_settings():
    cfg = Config.from_env({"SPSWAP_ROOT": "/tmp/x", "SPSWAP_GPUS": "0, 2",
                           "SPSWAP_POOL_CAPACITY_BYTES": "1G", "SPSWAP_SLOT_TIMEOUT_S": "5",
                           "OTHER": "ignored"})
    assert cfg.root == Path("/tmp/x")
    assert cfg.gpus == (0, 2)
    assert cfg.pool_capacity_bytes == 1 << 30
    assert cfg.slot_timeout_s == 5.0
    assert cfg.paths.pool == Path("/tmp/x/pool")
    assert cfg.paths.socket == Path("/tmp/x/run/spswapd.sock")


def test_unknown_setting_lists_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        Config.from_env({"SPSWAP_ROOTT": "/x"})
    assert "SPSWAP_ROOTT" in str(e.value) and "SPSWAP_ROOT," in str(e.value)


def test_overrides_win_and_are_validated():
    assert Config.from_env({"SPSWAP_ROOT": "/a"}, root=Path("/b")).root == Path("/b")
    with pytest.raises(ConfigError, match="absolute"):
        Config.from_env({}, root=Path("rel"))
    with pytest.raises(ConfigError, match="not a number"):
        Config.from_env({"SPSWAP_SLOT_TIMEOUT_S": "soon"})


def test_keep_bytes_reads_a_size_and_defaults_to_an_eighth_of_memory(tmp_path):
    assert Config.from_env({"SPSWAP_KEEP_BYTES": "8G"}).keep_budget_bytes() == 8 << 30
    assert Config.from_env({"SPSWAP_KEEP_BYTES": "0"}).keep_budget_bytes() == 0
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\n")
    assert Config.from_env({}).keep_budget_bytes(meminfo) == 131072000 * 1024 // 8
    assert Config.from_env({}).keep_budget_bytes(tmp_path / "absent") == 0
    with pytest.raises(ConfigError, match="K/M/G/T suffix"):
        Config.from_env({"SPSWAP_KEEP_BYTES": "lots"})


def test_criu_as_root_is_a_yes_no_setting() -> None:
    assert Config.from_env({}).criu_as_root is False
    assert Config.from_env({"SPSWAP_CRIU_AS_ROOT": "1"}).criu_as_root is True
    assert Config.from_env({"SPSWAP_CRIU_AS_ROOT": "no"}).criu_as_root is False
    with pytest.raises(ConfigError, match="SPSWAP_CRIU_AS_ROOT='maybe': use 1"):
        Config.from_env({"SPSWAP_CRIU_AS_ROOT": "maybe"})
