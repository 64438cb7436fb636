"""Who writes the node's bookkeeping: root directly, every other user through spswapd.

The slot table and the pool index are writable by root only (a user who could write
them could grant themselves GPUs or hold the lock forever). This module is what the
serving side calls to reserve a slot, import a checkpoint and use a pool entry; it
picks the path by privilege:

- euid 0 (the daemon itself, root on the command line, root-run tests): the
  :class:`~spswap.slots.table.SlotTable` and :class:`~spswap.pool.store.Pool` as before;
- anyone else: a request to spswapd, which acts for the caller as the kernel names it
  (``SO_PEERCRED``): the reservation or pool use is held by the calling process, a job id
  is accepted only for the caller's own running job, and an import reads only the files
  the caller opened itself (their descriptors travel over the socket).

A daemon that cannot be reached is a :class:`~spswap.errors.DaemonError` that says to run
``spswap daemon start`` (as root) or to look at the prolog's log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.daemon.client import Client
from spswap.daemon.lifecycle import ping, prepare_dirs
from spswap.errors import DaemonError, InvalidCheckpoint, PoolCorrupt, PoolEntryNotFound
from spswap.liveness import Holder
from spswap.pool.index import alias_key
from spswap.pool.layout import MANIFEST_FILE
from spswap.pool.manifest import Manifest
from spswap.pool.safetensors_format import INDEX_FILE, resolve_checkpoint
from spswap.pool.store import Pool
from spswap.pool.verify import (
    check_unless_sealed,
    import_checked,
    remove_if_damaged,
    verify_entry,
)
from spswap.slots.alloc import UNITS_PER_GPU
from spswap.slots.table import Reservation, SlotTable

RESERVE_MARGIN_S = 60.0
"""How much longer than the slot wait the client waits for the daemon's answer."""
DEFAULT_IMPORT_TIMEOUT_S = 6 * 3600.0
"""How long a user's import may take in the daemon (it reads the whole checkpoint)."""


def privileged() -> bool:
    """True when this process writes the bookkeeping itself (effective uid 0)."""
    return os.geteuid() == 0


def writes_directly(cfg: Config) -> bool:
    """:func:`privileged`, after claiming and checking the state tree as spswapd's start
    does: on a node where no spswapd ran yet, a user may have made ``$SPSWAP_ROOT`` (with
    links where the pool or slots go), and root must not write into it."""
    if not privileged():
        return False

    prepare_dirs(cfg)
    return True


def _job_id(job_id: str | None) -> str | None:
    # the same default as Holder.current, on both paths: inside a job, bind to the job
    return job_id if job_id is not None else (os.environ.get("SLURM_JOB_ID") or None)


def _client(cfg: Config, timeout_s: float) -> Any:
    return Client(cfg, timeout_s=timeout_s)


# -- slots ------------------------------------------------------------------------------


def reserve_slot(
    cfg: Config,
    *,
    model: str,
    units: int = UNITS_PER_GPU,
    allowed_gpus: Sequence[int] | None = None,
    job_id: str | None = None,
    timeout_s: float = 600.0,
    whole_gpus: int | None = None,
) -> Reservation:
    """Reserve ``units`` of one GPU (or ``whole_gpus`` GPUs) of ``allowed_gpus`` for this
    process, bound to ``job_id`` (default ``$SLURM_JOB_ID``); waits up to ``timeout_s``.

    Raises :class:`~spswap.errors.SlotTimeout` naming the holders, :class:`SlotError`
    for a request that can never be met, :class:`PermissionDenied` for another user's job.
    """
    job_id = _job_id(job_id)
    if writes_directly(cfg):
        gpus = list(allowed_gpus) if allowed_gpus else None
        table = SlotTable.from_config(cfg, gpus=gpus)
        return table.reserve(
            model=model, units=units, whole_gpus=whole_gpus, allowed_gpus=allowed_gpus,
            holder=Holder.current(job_id=job_id), timeout_s=timeout_s,
        )  # fmt: skip
    result = _client(cfg, timeout_s + RESERVE_MARGIN_S).call(
        "slots.reserve", model=model, units=units, whole_gpus=whole_gpus,
        allowed_gpus=list(allowed_gpus) if allowed_gpus is not None else None,
        job_id=job_id, timeout_s=timeout_s,
    )  # fmt: skip
    return Reservation.from_json(result)


def release_slot(cfg: Config, reservation_id: str) -> Reservation:
    """Give back a reservation (yours; root: anyone's). Returns what was released. Root's
    goes through spswapd too where it answers, so that its event log has the release (the
    walk: an admin's forced release left no trace); without spswapd root writes the table."""
    if privileged() and not ping(cfg) and writes_directly(cfg):
        return SlotTable(cfg.paths.slots, []).release(reservation_id, uid=0)
    result = _client(cfg, 30.0).call("slots.release", reservation_id=reservation_id)
    return Reservation.from_json(result)


# -- pool -------------------------------------------------------------------------------


def import_model(
    cfg: Config, path: Path | str, name: str | None = None, *,
    timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S,
    progress: Callable[[int, int], None] | None = None,
    identity: dict[str, Any] | None = None, job_id: str | None = None,
    on_damaged: Callable[[str], None] | None = None,
) -> Manifest:  # fmt: skip
    """Import a safetensors checkpoint (file or directory) into the node's pool.

    A user's import reads only what the user can open: the files are opened here, as the
    caller, and the daemon reads them through those descriptors. ``progress`` is called
    only on the direct (root) path. ``identity`` (an engine's layout, e.g. weights as vLLM
    holds them) is recorded in the entry with ``owner_uid``, the importing user's uid.
    ``job_id`` (default ``$SLURM_JOB_ID``) names the job in spswapd's event log. An entry
    found for the same files that was written over since it was sealed is read, and if
    damaged removed and imported again: ``on_damaged`` is told what was wrong.
    """
    if writes_directly(cfg):
        pool = Pool.from_config(cfg)
        if identity is not None:
            identity = {**identity, "owner_uid": os.getuid()}

        def told(_found: Manifest, problem: str) -> None:
            if on_damaged is not None:
                on_damaged(problem)

        manifest = import_checked(pool, lambda: pool.import_checkpoint(
            Path(path), name=name, progress=progress, identity=identity), told)  # fmt: skip
        if identity is not None:
            pool.remember_alias(alias_key(identity, os.getuid()), manifest.digest)
        return manifest

    ckpt = resolve_checkpoint(Path(path))  # headers checked as the user, before any fd moves
    files = [(f.path, f.path.name) for f in ckpt.files]
    if ckpt.extra_sources:
        files.append((ckpt.path / INDEX_FILE, INDEX_FILE))
    with ExitStack() as stack:
        fds = []
        for file_path, _ in files:
            fds.append(_open_for_import(file_path))
            stack.callback(os.close, fds[-1])
        extra: dict[str, Any] = {"identity": identity} if identity is not None else {}
        if (job := _job_id(job_id)) is not None:
            extra["job_id"] = job
        result = _client(cfg, timeout_s).call_with_fds(
            "pool.import", fds, files=[n for _, n in files], name=name or ckpt.name, **extra
        )
    if result.get("damaged") and on_damaged is not None:
        on_damaged(str(result["damaged"]))
    return Manifest.from_json(result)


def _open_for_import(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        raise InvalidCheckpoint(
            f"{path}: permission denied; you (uid {os.getuid()}) can import only files you "
            "can read: make it readable for your user"
        ) from None
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{path}: removed before it was opened; import again") from None


@contextmanager
def use_entry(cfg: Config, ref: str, *, job_id: str | None = None) -> Iterator[Manifest]:
    """Hold a use of pool entry ``ref`` (name or digest) for the ``with`` block: it is never
    evicted while this process (or its job) lives. Yields the entry's manifest."""
    job_id = _job_id(job_id)
    if writes_directly(cfg):
        pool = Pool.from_config(cfg)
        problem = check_unless_sealed(pool, ref)[1]  # as spswapd's pool.use
        if problem is not None:
            raise PoolCorrupt(problem)
        with pool.use(ref, Holder.current(job_id=job_id)) as manifest:
            yield manifest
        return
    client = _client(cfg, 60.0)
    manifest = Manifest.from_json(client.call("pool.use", ref=ref, job_id=job_id))
    try:
        yield manifest
    finally:
        try:
            client.call("pool.unuse", ref=manifest.digest)
        except DaemonError:
            pass  # the daemon went away: the use goes stale when this process exits


def check_entry(cfg: Config, ref: str, *, job_id: str | None = None) -> str | None:
    """Read pool entry ``ref`` against its checksums: what is wrong with it, or None
    when it is whole. A damaged entry is removed, by spswapd (``pool.check``: one check
    at a time, a ``pool.damaged`` event), so the model is imported again; where no
    spswapd answers, root removes it here and a user's check only reads it."""
    try:
        got = _client(cfg, DEFAULT_IMPORT_TIMEOUT_S).call("pool.check", ref=ref,
                                                          job_id=_job_id(job_id))  # fmt: skip
    except DaemonError:
        if writes_directly(cfg):
            return remove_if_damaged(Pool.from_config(cfg), ref)[1]
        pool = Pool.from_config(cfg)
        manifest = pool.find(ref)
        try:
            verify_entry(manifest, pool.data_path(manifest), fix=(
                "the pool is root's: ask the node's admin to remove it (spswap pool rm "
                f"{manifest.digest[:12]}); no spswapd answered to do it"))  # fmt: skip
        except PoolCorrupt as e:
            return str(e)
        return None
    problem: str | None = got.get("problem")
    return problem


class PoolAccess:
    """What a serving process needs of the pool, for root and users alike.

    Duck-compatible with :class:`~spswap.pool.store.Pool` for engines'
    ``load_from_pool(pool, ref)`` (``use`` and ``data_path``) and for ``find`` /
    ``entries``; reads go to the pool directly (its files are world-readable), writes
    through :func:`import_model` and :func:`use_entry`.
    """

    def __init__(self, cfg: Config, *, job_id: str | None = None) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.pool = Pool.from_config(cfg)

    def use(self, ref: str, holder: Holder | None = None) -> Any:
        """Context manager holding a use of ``ref`` (``holder`` must be None: it is you)."""
        if holder is not None:
            raise ValueError("the holder of a use is always the calling process")
        return use_entry(self.cfg, ref, job_id=self.job_id)

    @property
    def pool_dir(self) -> Path:
        return self.pool.pool_dir

    def data_path(self, manifest: Manifest) -> Path:
        return self.pool.data_path(manifest)

    def find(self, ref: str) -> Manifest:
        return self.pool.find(ref)

    def find_alias(self, key: str) -> Manifest | None:
        return self.pool.find_alias(key)

    def remember_alias(self, key: str, digest: str) -> None:
        """Root only (a user's aliases are recorded by spswapd with its imports)."""
        self.pool.remember_alias(key, digest)

    def entries(self) -> list[Any]:
        return self.pool.entries()

    def has(self, digest: str) -> bool:
        """Whether entry ``digest`` is in the pool (not removed meanwhile)."""
        return (self.pool.entry_dir(digest) / MANIFEST_FILE).is_file()

    def check(self, ref: str) -> str | None:
        """What is wrong with entry ``ref`` (removed then), or None: :func:`check_entry`."""
        try:
            return check_entry(self.cfg, ref, job_id=self.job_id)
        except PoolEntryNotFound:  # another run of the model found it damaged first
            return f"pool entry {ref[:12]} was removed while this run asked about it"

    def import_checkpoint(
        self, path: Path | str, *, name: str | None = None,
        identity: dict[str, Any] | None = None,
        on_damaged: Callable[[str], None] | None = None,
    ) -> Manifest:  # fmt: skip
        return import_model(self.cfg, path, name=name, identity=identity, job_id=self.job_id,
                            on_damaged=on_damaged)  # fmt: skip
