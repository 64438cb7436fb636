"""The one configuration of spswap: a dataclass filled from ``SPSWAP_*`` variables.

Derived runtime values (the paths under the root) live in :class:`Paths`, apart from
the settings themselves.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spswap.errors import ConfigError
from spswap.settings_file import (
    SettingsFile,
    read_settings_file,
    settings_file_path,
    strip_inline_comment,
)

ENV_PREFIX = "SPSWAP_"
DEFAULT_ROOT = Path("/dev/shm/spswap")


def _parse_size(text: str) -> int:
    """Parse ``"64G"``, ``"512MiB"``, ``"1000000"`` into bytes."""
    units = {
        "": 1, "B": 1,
        "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10,
        "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
        "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
        "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40,
    }  # fmt: skip
    s = text.strip().upper()
    digits = s.rstrip("KMGTIB")
    suffix = s[len(digits) :]
    bad = ConfigError(f"cannot read {text!r} as a size: use bytes or a K/M/G/T suffix")
    try:
        value = float(digits)
    except ValueError:
        raise bad from None
    if suffix not in units or value < 0:
        raise bad
    return int(value * units[suffix])


def setting_text(raw: str) -> str:
    """A setting's value as the shell reads ``/etc/default/spswap``: without an inline
    comment (``256G   # optional``). The Slurm hooks source that file with bash, which drops
    the comment; systemd's ``EnvironmentFile=`` (slurm/spswapd.service) keeps it in the
    value: both must give spswap the same settings."""
    return strip_inline_comment(raw)


def _parse_gpus(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a GPU list: use e.g. 0,1,2,3") from None


IMAGE_CHECKS = ("quick", "full")


@dataclass(frozen=True)
class Config:
    """spswap settings. Every field can be set as ``SPSWAP_<FIELD>`` (upper case)."""

    root: Path = DEFAULT_ROOT
    """Where the pool, slots, images and sockets live (node-local tmpfs)."""
    pool_capacity_bytes: int | None = None
    """Pool size limit; default: 80% of the root file system's size."""
    pool_user_bytes: int | None = None
    """What the entries one user imported through spswapd may hold together; an import
    over it makes room from that user's own least recently used entries no job uses,
    else it is refused (so no user evicts the others' weights to hold more). Root's
    imports count in no share. Default: half of the pool's capacity."""
    gpus: tuple[int, ...] | None = None
    """GPU indexes of this node; default: NVML, else the node's ``/dev/nvidiaN`` devices
    (never a job's ``CUDA_VISIBLE_DEVICES``: that is one job's view, not the node's)."""
    slot_poll_interval_s: float = 0.02
    """How often a waiting reservation looks again."""
    slot_timeout_s: float = 600.0
    """Default time a reservation waits before it fails with the current holders."""
    keep_bytes: int | None = None
    """Host memory that dumped instances may go on using, alive and frozen beside their
    images, so that their job's next run skips CRIU's restore (seconds saved per swap);
    the oldest are ended first when over it (their images stay). Default: 1/8 of the
    node's memory; 0 turns keeping off."""
    keep_on_gpu: bool = False
    """A kept instance's sleeping GPU state goes back onto its GPU right after its dump
    and stays there, frozen and locked, while its job waits (``SPSWAP_KEEP_ON_GPU=1``):
    its job's next run skips the CUDA restore (0.24-0.37 s of a kept 0.5B swap on the
    H100s and the H200). It holds that memory (a sleeping vLLM 0.5B: 0.7 GB eager, 1.1 GB
    compiled; 1-2 GB for larger models) on a GPU that Slurm has given to another job
    meanwhile: turn it on only where jobs leave that much free (vLLM's
    ``--gpu-memory-utilization`` 0.9 leaves 8-14 GB). A slot reservation of another job
    on that GPU moves that state back into the tree's host memory (a CUDA checkpoint,
    0.3-0.6 s, beside the reservation: the tree stays kept, its run restores the GPU
    state itself). Off by default."""
    images_bytes: int | None = None
    """What the node's checkpoint images may hold together on the root's file system (a
    tmpfs holds them in memory while their jobs wait); a dump that would go over it drops
    its user's older images first, else it is refused (its job's next run starts from the
    pool). Default: half the file system's size."""
    images_user_bytes: int | None = None
    """What one user's images may hold together (the same rule, so no user takes the room
    of the others). Default: half of :attr:`images_bytes`."""
    criu_as_root: bool = False
    """Run CRIU as root for users' processes too (``SPSWAP_CRIU_AS_ROOT=1``). Default: CRIU
    runs as the job's user in ``--unprivileged`` mode, so the kernel checks every path it
    opens with that user's rights (a kept instance's freeze is still root's, asked for by
    CRIU's post-dump script). Root's CRIU cannot dump another uid where root lacks
    CAP_SYS_RESOURCE."""
    image_check: str = "quick"
    """How a restore checks a process image's files (``SPSWAP_IMAGE_CHECK``): ``quick``
    (default): every file there with its recorded size (none missing, added or cut short);
    ``full``: every byte hashed as recorded (it reads the whole image, a few GB, on the
    swap's path). Either way the restored instance answers a check prompt as it did before
    its checkpoint before it serves (spswap.serve.restore_check), which catches damage to
    what it computes with; images live in a root-only folder."""
    restore_hugepages: bool = False
    """CRIU's restore fills a large private memory region (a CUDA checkpoint's host copy of
    the GPU state, GBs) in transparent huge pages instead of 4 KiB pages
    (``SPSWAP_RESTORE_HUGEPAGES=1``; needs the CRIU that scripts/build_criu.sh builds, with
    spswap's thp-fill patch). Faster where the node fills huge pages faster (on the H200
    machine a 2 GiB restore took 0.90-0.96 s against 1.50-1.54 s, a 3B vLLM image's 1.39 s
    against 1.69 s), slower where it does not (a small VM): measure before you turn it on
    (docs/benchmarks.md). The advice stays on the restored mappings (only large ones the
    image fills densely). Off by default: stock CRIU's fill."""
    sweep_interval_s: float = 30.0
    """How often spswapd asks Slurm whether the jobs it holds images or kept instances
    of will come back, and frees those of jobs that will not: a job cancelled while it
    waits in the queue runs no epilog here, so nothing else would tell it."""

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        settings: SettingsFile | None = None,
        **overrides: object,
    ) -> Config:
        """The settings every command and the daemon use: the node's settings file
        (``/etc/default/spswap``, or ``$SPSWAP_DEFAULTS``), then ``SPSWAP_*`` variables of
        ``env`` (default: the environment) over it, then ``overrides`` (``--root``)."""
        env = os.environ if env is None else env
        if settings is None:
            settings = read_settings_file(settings_file_path(env))
        merged = {k: v for k, v in settings.values.items() if k.startswith(ENV_PREFIX)}
        merged.update(env)
        try:
            return cls.from_env(merged, **overrides)
        except ConfigError as e:
            if not any(k.startswith(ENV_PREFIX) for k in settings.values):
                raise
            raise ConfigError(f"{e} ({_where_set(str(e), env, settings)})") from None

    @classmethod
    def root_only(cls, env: Mapping[str, str] | None = None, *, root: Path | None = None
                  ) -> Config:  # fmt: skip
        """Only where spswap lives, from the same places as :meth:`load` (``root``, then
        ``SPSWAP_ROOT`` of ``env``, then the settings file's), every other setting left at
        its default: for ``spswap daemon stop``, which must stop a running spswapd while
        the settings file has an error (an edit with a typo would leave the old daemon
        running on the old settings)."""
        env = os.environ if env is None else env
        raw = env.get("SPSWAP_ROOT") or read_settings_file(settings_file_path(env)).values.get(
            "SPSWAP_ROOT")  # fmt: skip
        return cls.from_env({}, root=root or (Path(setting_text(raw)) if raw else None))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Build the config from ``SPSWAP_*`` variables; unknown ones are an error."""
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in names:
                if name in _NON_CONFIG_VARS:
                    continue
                valid = ", ".join(ENV_PREFIX + n.upper() for n in sorted(names))
                raise ConfigError(f"unknown setting {key}; valid settings: {valid}")
            values[name] = _convert(name, setting_text(raw))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - names
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)}; valid: {sorted(names)}")
        cfg = cls(**values)  # type: ignore[arg-type]
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the bad field and the fix."""
        if not self.root.is_absolute():
            raise ConfigError(f"SPSWAP_ROOT must be an absolute path, got {self.root}")
        if self.pool_capacity_bytes is not None and self.pool_capacity_bytes <= 0:
            raise ConfigError("SPSWAP_POOL_CAPACITY_BYTES must be positive (e.g. 64G)")
        if self.slot_poll_interval_s <= 0:
            raise ConfigError("SPSWAP_SLOT_POLL_INTERVAL_S must be positive")
        if self.slot_timeout_s < 0:
            raise ConfigError("SPSWAP_SLOT_TIMEOUT_S must be >= 0")
        if self.image_check not in IMAGE_CHECKS:
            raise ConfigError(f"SPSWAP_IMAGE_CHECK={self.image_check!r}: use quick or full")
        if self.keep_bytes is not None and self.keep_bytes < 0:
            raise ConfigError("SPSWAP_KEEP_BYTES must be >= 0 (0: no instance is kept alive)")
        for name in ("pool_user_bytes", "images_bytes", "images_user_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be positive (e.g. 32G); "
                                  "leave it out for its default")  # fmt: skip
        if self.sweep_interval_s <= 0:
            raise ConfigError("SPSWAP_SWEEP_INTERVAL_S must be positive (seconds, e.g. 30)")

    def keep_budget_bytes(self, meminfo: Path = Path("/proc/meminfo")) -> int:
        """:attr:`keep_bytes`, or its default: 1/8 of MemTotal (0 when unreadable)."""
        if self.keep_bytes is not None:
            return self.keep_bytes
        try:
            for line in meminfo.read_text().splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // 8
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def to_json(self) -> dict[str, object]:
        """The settings as ``SPSWAP_*`` names and JSON values (what the daemon reports)."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = (
                str(value) if isinstance(value, Path)
                else list(value) if isinstance(value, tuple) else value
            )  # fmt: skip
        return out

    @property
    def paths(self) -> Paths:
        return Paths(self.root)


# Variables with the prefix that are not settings of this dataclass: read by the shell
# hooks and scripts (bin, hook_timeout_s, defaults, torch, venv), by the CRIU finder (criu)
# and by the test suite (test_slurm, accept_golden).
# SPSWAP_* variables that are not node settings: read by one process or script (the
# reference engine's threads, the hooks' binary, install and test scripts), so a node
# setting never refuses them.
_NON_CONFIG_VARS = frozenset(
    {
        "bin",
        "hook_timeout_s",
        "defaults",
        "torch",
        "venv",
        "criu",
        "test_slurm",
        "accept_golden",
        "test_pool",
        "test_vllm_model",
        "test_vllm_models",
        "test_root",
        "cpu_threads",
        "user",
        "prefix",
        "python",
    }
)


def _where_set(message: str, env: Mapping[str, str], settings: SettingsFile) -> str:
    """Where the setting a load refused (named in ``message`` as ``SPSWAP_X=``) came from,
    so that an admin looks in the right place: the environment over the file, or the
    file. Pure."""
    named = [k for k in (*env, *settings.values)
             if k.startswith(ENV_PREFIX) and f"{k}=" in message]  # fmt: skip
    if named and named[0] in env:
        return f"{named[0]} is set in the environment, over the settings file {settings.path}"
    if named:
        return f"set in the settings file {settings.path}"
    return f"settings: {settings.path}, then the environment"


def _convert(name: str, raw: str) -> object:
    if name == "root":
        return Path(raw)
    if name in (
        "pool_capacity_bytes",
        "pool_user_bytes",
        "keep_bytes",
        "images_bytes",
        "images_user_bytes",
    ):
        return _parse_size(raw)
    if name == "gpus":
        return _parse_gpus(raw)
    if name == "image_check":
        if raw.strip().lower() in IMAGE_CHECKS:
            return raw.strip().lower()
        raise ConfigError(f"{ENV_PREFIX}IMAGE_CHECK={raw!r}: use quick (the files' names and "
                          "sizes) or full (every byte hashed)")  # fmt: skip
    if name == "criu_as_root":
        return _parse_bool(name, raw, "1 (root's CRIU) or 0")
    if name == "keep_on_gpu":
        return _parse_bool(name, raw, "1 (kept instances stay on their GPU) or 0")
    if name == "restore_hugepages":
        return _parse_bool(name, raw, "1 (huge pages) or 0 (CRIU's 4 KiB pages)")
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None


def _parse_bool(name: str, raw: str, choices: str) -> bool:
    if raw.strip().lower() in ("1", "yes", "true", "on"):
        return True
    if raw.strip().lower() in ("0", "no", "false", "off", ""):
        return False
    raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: use {choices}")


@dataclass(frozen=True)
class Paths:
    """Where each piece keeps its files under the root."""

    root: Path
    pool: Path = field(init=False)
    slots: Path = field(init=False)
    images: Path = field(init=False)
    run: Path = field(init=False)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pool", self.root / "pool")
        object.__setattr__(self, "slots", self.root / "slots")
        object.__setattr__(self, "images", self.root / "images")
        object.__setattr__(self, "run", self.root / "run")
        object.__setattr__(self, "log", self.root / "log")

    @property
    def events(self) -> Path:
        """The daemon's append-only event log (JSON lines)."""
        return self.log / "events.jsonl"

    @property
    def socket(self) -> Path:
        return self.run / "spswapd.sock"

    @property
    def instances(self) -> Path:
        """The instance records (one JSON file each), shared by the serving runs and spswapd."""
        return self.run / "instances"


parse_size = _parse_size
