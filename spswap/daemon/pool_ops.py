"""The pool ops: ``pool.use`` and ``pool.unuse`` (the caller's own uses only),
``pool.import`` (from descriptors the caller opened: only what it can read) and
``pool.check`` (an entry read against its checksums for anyone, removed when damaged:
the pool is root's, so a user whose restored instance answered wrongly could not remove
it, and its next start would read the same bad bytes; only proven damage removes)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from spswap.daemon.caller import peer_holder
from spswap.daemon.protocol import Answer
from spswap.daemon.state import Context
from spswap.errors import PoolCorrupt, PoolFull, ProtocolError, RequestRefused, SpswapError
from spswap.pool.importer import import_from_fds
from spswap.pool.index import alias_key, file_key
from spswap.pool.manifest import Manifest
from spswap.pool.store import Pool
from spswap.pool.verify import check_unless_sealed, import_checked, remove_if_damaged

if TYPE_CHECKING:
    from spswap.pool.store import Pool


CHECK_WAIT_S = 300.0  # a check reads a whole entry: a 70 GB one in about a minute


def _pool(ctx: Context) -> Pool:
    return Pool.from_config(ctx.state.cfg, job_alive=ctx.state.job_probe())


def op_pool_use(ctx: Context, args: dict[str, Any]) -> Answer:
    """Mark a pool entry used by the caller (never evicted while it lives); one whose file
    was written since it was sealed is read first, and removed if damaged (PoolCorrupt:
    the caller starts from the model's files)."""
    holder = peer_holder(ctx, args.get("job_id"))
    pool = _pool(ctx)
    problem = _check_unless_sealed(ctx, pool, args["ref"], args.get("job_id"))
    if problem is not None:
        raise PoolCorrupt(problem)
    return pool.acquire_use(args["ref"], holder).to_json()


def op_pool_unuse(ctx: Context, args: dict[str, Any]) -> Answer:
    """Drop one of the caller's uses of an entry (other holders' uses are untouchable)."""
    pool = _pool(ctx)
    manifest = pool.find(args["ref"])
    rec = pool.index.read_unlocked().entries.get(manifest.digest)
    for h in rec.uses if rec else []:
        if h.pid == ctx.peer_pid and h.uid == ctx.peer_uid:
            pool.release_use(manifest.digest, h)
            return {"digest": manifest.digest, "released": True}
    return {"digest": manifest.digest, "released": False}


def op_pool_import(ctx: Context, args: dict[str, Any]) -> Answer:
    """Import from the descriptors the caller opened: only what the caller can read."""
    names = args["files"]
    if len(names) != len(ctx.fds):
        raise ProtocolError(f"pool.import names {len(names)} file(s) but {len(ctx.fds)} "
                            "descriptor(s) came with it; send one descriptor per name")  # fmt: skip
    files = list(zip(names, ctx.fds, strict=True))
    identity = args.get("identity")
    if identity is not None:
        if not isinstance(identity, dict):
            raise ProtocolError("pool.import identity must be a JSON object")
        # who exported it, from SO_PEERCRED: engines trust only their own user's (and
        # root's) exports, so no user can plant weights under another's identity
        identity = {**identity, "owner_uid": ctx.peer_uid}
    # the caller's imports count in its share of the pool (SPSWAP_POOL_USER_BYTES)
    pool = Pool.from_config(ctx.state.cfg, ctx.state.job_probe(), importer_uid=ctx.peer_uid)
    started = time.time()
    job_id = callers_job(ctx, args.get("job_id"))

    def read() -> Manifest:
        return import_from_fds(pool, files, name=args.get("name"), owner_uid=ctx.peer_uid,
                               identity=identity)  # fmt: skip

    damaged: list[str] = []

    def told(found: Manifest, problem: str) -> None:
        _damaged_event(ctx, found, problem, args.get("job_id"))
        damaged.append(problem)

    try:
        manifest = import_checked(pool, read, told)
    except PoolFull as e:  # the job fails to start: root finds why in the log too
        ctx.state.event("pool.refused", job_id=job_id, uid=ctx.peer_uid, pid=ctx.peer_pid,
                        name=args.get("name"), reason=str(e))  # fmt: skip
        raise
    finally:
        for entry, why in pool.evictions:
            ctx.state.event(
                "pool.evicted", job_id=job_id, uid=ctx.peer_uid, name=entry.manifest.name,
                digest=entry.manifest.digest, size_bytes=entry.size_bytes,
                importers=sorted(entry.importers), to_make_room_for=args.get("name"),
                why="the importing user's share (SPSWAP_POOL_USER_BYTES)" if why == "share"
                else "the pool's capacity",
            )  # fmt: skip
    if identity is not None:
        # the caller's bytes are this entry's (same digest), whoever exported them first:
        # the caller finds it under its own uid from now on

        pool.remember_alias(alias_key(identity, ctx.peer_uid), manifest.digest)
    if manifest.created >= started:  # a new entry; a run that finds its weights is no news
        ctx.state.event("pool.import", job_id=job_id, uid=ctx.peer_uid, pid=ctx.peer_pid,
                        name=manifest.name, digest=manifest.digest)  # fmt: skip
    return {**manifest.to_json(), **({"damaged": damaged[0]} if damaged else {})}


def op_pool_check(ctx: Context, args: dict[str, Any]) -> Answer:
    """Check an entry for the caller; a damaged one is removed (``pool.damaged`` event)."""
    pool = _pool(ctx)
    checks = ctx.state.pool_checks
    if not checks.lock.acquire(timeout=CHECK_WAIT_S):
        raise RequestRefused(f"another pool check has run for over {CHECK_WAIT_S:.0f} s; "
                             "ask again later (`spswap pool verify REF` reads an entry "
                             "without spswapd)")  # fmt: skip
    try:
        manifest = pool.find(args["ref"])
        key = file_key(pool.data_path(manifest))
        if checks.known_whole(manifest.digest, key):
            return {"digest": manifest.digest, "problem": None, "removed": False}
        manifest, problem = remove_if_damaged(pool, manifest.digest)
        checks.record(manifest.digest, key, whole=problem is None)
    finally:
        checks.lock.release()
    if problem is not None:
        _damaged_event(ctx, manifest, problem, args.get("job_id"))
    return {"digest": manifest.digest, "problem": problem, "removed": problem is not None}


def _check_unless_sealed(ctx: Context, pool: Pool, ref: str, job_id: str | None) -> str | None:
    """What is wrong with entry ``ref`` (removed then, with a ``pool.damaged`` event), or
    None; read only where its file changed since sealed (a stat otherwise)."""
    manifest, problem = check_unless_sealed(pool, ref)
    if problem is not None:
        _damaged_event(ctx, manifest, problem, job_id)
    return problem


def _damaged_event(ctx: Context, manifest: Manifest, problem: str, job_id: str | None) -> None:
    ctx.state.event("pool.damaged", job_id=callers_job(ctx, job_id), uid=ctx.peer_uid,
                    pid=ctx.peer_pid, name=manifest.name, digest=manifest.digest,
                    problem=problem)  # fmt: skip


def callers_job(ctx: Context, job_id: str | None) -> str | None:
    """``job_id`` where it names a job of the caller's registered here (the log names
    only a job the caller owns), else None."""
    if job_id is None:
        return None
    try:
        rec = ctx.state.jobs.get(job_id)
    except SpswapError:
        return None
    return job_id if rec is not None and rec.uid == ctx.peer_uid else None
