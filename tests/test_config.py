from pathlib import Path

import pytest

from spswap.config import DEFAULT_ROOT, Config, parse_size
from spswap.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1000", 1000),
        ("4K", 4096),
        ("64M", 64 << 20),
        ("1.5G", 3 << 29),
        ("2GiB", 2 << 30),
        ("1T", 1 << 40),
        ("512mb", 512 << 20),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "12Q", "-1G", "abc"])
def test_parse_size_rejects_with_the_fix(text):
    with pytest.raises(ConfigError, match="K/M/G/T suffix"):
        parse_size(text)


def test_from_env_reads_prefixed_settings():
    cfg = Config.from_env(
        {
            "SPSWAP_ROOT": "/tmp/x",
            "SPSWAP_GPUS": "0, 2",
            "SPSWAP_POOL_CAPACITY_BYTES": "1G",
            "SPSWAP_SLOT_TIMEOUT_S": "5",
            "OTHER": "ignored",
        }
    )
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


def test_restore_hugepages_is_a_yes_no_setting_off_by_default() -> None:
    assert Config.from_env({}).restore_hugepages is False
    assert Config.from_env({"SPSWAP_RESTORE_HUGEPAGES": "1"}).restore_hugepages is True
    assert Config.from_env({"SPSWAP_RESTORE_HUGEPAGES": "off"}).restore_hugepages is False
    with pytest.raises(ConfigError) as e:
        Config.from_env({"SPSWAP_RESTORE_HUGEPAGES": "2"})
    assert str(e.value) == ("SPSWAP_RESTORE_HUGEPAGES='2': use 1 (huge pages) or 0 (CRIU's "
                            "4 KiB pages)")  # fmt: skip


# -- /etc/default/spswap, read by the hooks' bash and by systemd's EnvironmentFile= ----------

OLD_DEFAULTS = """SPSWAP_BIN=/opt/spswap/venv/bin/spswap
SPSWAP_ROOT=/dev/shm/spswap          # node-local tmpfs: pool, slots, images, socket
SPSWAP_POOL_CAPACITY_BYTES=256G      # optional: default 80% of the tmpfs size
SPSWAP_KEEP_BYTES=64G                # optional: dumped instances kept alive (default 1/8 of RAM)
SPSWAP_CRIU_AS_ROOT=0                # optional: 1 runs CRIU as root for users' jobs too
"""


def _systemd_env(text: str) -> dict[str, str]:
    """What systemd's EnvironmentFile= makes of ``text``: comment lines only (starting with
    # or ;) are dropped; a value is what follows '=', whitespace trimmed, quotes removed."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) > 1 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def _bash_env(text: str, tmp_path) -> dict[str, str]:
    """What slurm/hook.sh makes of it: ``set -a; . FILE``."""
    import subprocess

    f = tmp_path / "defaults"
    f.write_text(text)
    out = subprocess.run(["bash", "-c", f'set -a; . "{f}"; env -0'], capture_output=True,
                         check=True, env={"PATH": "/usr/bin:/bin"}).stdout.decode()  # fmt: skip
    pairs = (item.partition("=") for item in out.split("\0") if item.startswith("SPSWAP_"))
    return {k: v for k, _, v in pairs}


def _documented_defaults() -> str:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "slurm.md").read_text()
    after = doc.split("`/etc/default/spswap`", 1)[1]
    return after.split("```sh\n", 1)[1].split("```", 1)[0]


def test_inline_comment_is_dropped_as_the_hooks_shell_does() -> None:
    from spswap.config import setting_text

    assert setting_text("256G   # optional: default 80% of the tmpfs size") == "256G"
    assert setting_text("/dev/shm/spswap\t# tmpfs") == "/dev/shm/spswap"
    assert setting_text("/dev/shm/a#b") == "/dev/shm/a#b"  # not a comment for bash either
    cfg = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "256G   # optional: default 80%",
                           "SPSWAP_CRIU_AS_ROOT": "0                # optional"})  # fmt: skip
    assert cfg.pool_capacity_bytes == 256 << 30 and cfg.criu_as_root is False


def test_the_settings_file_reads_the_same_for_bash_and_systemd(tmp_path) -> None:
    documented = _documented_defaults()
    systemd, bash = _systemd_env(documented), _bash_env(documented, tmp_path)
    assert systemd == bash and "SPSWAP_POOL_CAPACITY_BYTES" in systemd
    assert not [v for v in systemd.values() if "#" in v], systemd
    want = Config.from_env(bash)
    assert want.pool_capacity_bytes == 256 << 30 and want.keep_bytes == 64 << 30
    # a file written from the old guide, with inline comments: the same settings too
    old_systemd = _systemd_env(OLD_DEFAULTS)
    assert old_systemd["SPSWAP_POOL_CAPACITY_BYTES"].startswith("256G      # optional")
    assert Config.from_env(old_systemd) == Config.from_env(_bash_env(OLD_DEFAULTS, tmp_path))
    assert Config.from_env(old_systemd) == want


def test_sweep_interval_is_positive_seconds() -> None:
    from spswap.config import Config
    from spswap.errors import ConfigError

    assert Config.from_env({"SPSWAP_SWEEP_INTERVAL_S": "5"}).sweep_interval_s == 5.0
    assert Config.from_env({}).sweep_interval_s == 30.0
    with pytest.raises(ConfigError, match="SPSWAP_SWEEP_INTERVAL_S must be positive"):
        Config.from_env({"SPSWAP_SWEEP_INTERVAL_S": "0"})


def test_image_check_is_quick_by_default_and_full_on_request() -> None:
    assert Config.from_env({}).image_check == "quick"
    assert Config.from_env({"SPSWAP_IMAGE_CHECK": "FULL"}).image_check == "full"
    with pytest.raises(ConfigError, match="use quick .* or full"):
        Config.from_env({"SPSWAP_IMAGE_CHECK": "fast"})


def test_root_only_finds_the_root_where_load_does_and_reads_nothing_else(tmp_path: Path) -> None:
    """(spswap daemon stop with a settings file that has an error elsewhere)"""
    f = tmp_path / "defaults"
    f.write_text("SPSWAP_ROOT=/srv/spswap   # the node's\nSPSWAP_KEEP_ON_GPU=maybe\n")
    env = {"SPSWAP_DEFAULTS": str(f)}
    with pytest.raises(ConfigError, match="SPSWAP_KEEP_ON_GPU='maybe'"):
        Config.load(env)
    assert Config.root_only(env).root == Path("/srv/spswap")
    assert Config.root_only({**env, "SPSWAP_ROOT": "/dev/shm/x"}).root == Path("/dev/shm/x")
    assert Config.root_only(env, root=Path("/tmp/r")).root == Path("/tmp/r")
    assert Config.root_only({"SPSWAP_DEFAULTS": str(tmp_path / "none")}).root == DEFAULT_ROOT


def test_a_refused_setting_says_where_it_was_set(tmp_path: Path) -> None:
    """(The walk: an environment's bad value read as if it were the file's.)"""
    f = tmp_path / "defaults"
    f.write_text("SPSWAP_KEEP_ON_GPU=1\n")
    env = {"SPSWAP_DEFAULTS": str(f), "SPSWAP_KEEP_ON_GPU": "maybe"}
    with pytest.raises(
        ConfigError,
        match=(
            r"SPSWAP_KEEP_ON_GPU is set in the environment, over the settings file .*defaults\)$"
        ),
    ):
        Config.load(env)
    f.write_text("SPSWAP_KEEP_ON_GPU=maybe\n")
    with pytest.raises(ConfigError, match=r"\(set in the settings file .*defaults\)$"):
        Config.load({"SPSWAP_DEFAULTS": str(f)})
