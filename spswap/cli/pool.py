"""``spswap pool``: import checkpoints into the node's weight pool, list, remove, verify."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from spswap.access import import_model, privileged
from spswap.cli.common import (
    JsonOpt,
    RootOpt,
    console,
    emit_json,
    err_console,
    error_json,
    load_config,
    print_error,
)
from spswap.errors import PermissionDenied, PoolCorrupt
from spswap.pool.capacity import imported_bytes
from spswap.pool.manifest import Manifest
from spswap.pool.store import Pool
from spswap.slurm.backend import job_probe
from spswap.status import render_pool
from spswap.units import fmt_bytes, fmt_rate, fmt_seconds

app = typer.Typer(
    help=(
        "The node's weight pool: model weights as flat, DMA-aligned files on tmpfs "
        "($SPSWAP_ROOT/pool), read from disk once and shared by every job of the node."
    ),
    no_args_is_help=True,
)

# Below this, a progress bar only flickers.
PROGRESS_MIN_BYTES = 256 << 20


def _pool(root: Path | None) -> Pool:
    return Pool.from_config(load_config(root), job_alive=job_probe())


@app.command("import")
def import_(
    path: Path = typer.Argument(..., help="A .safetensors file, or a directory with "
                                "model.safetensors or model.safetensors.index.json + shards."),
    name: str | None = typer.Option(None, "--name", help="Entry name (default: the "
                                    "directory or file name); not 6 or more hex digits "
                                    "alone, which would read as a digest."),
    root: Path | None = RootOpt,
    json_out: bool = JsonOpt,
) -> None:  # fmt: skip
    """Read a safetensors checkpoint once into the pool (reused if already imported)."""
    pool = _pool(root)
    started = time.time()
    t0 = time.perf_counter()
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=err_console, transient=True,
        disable=json_out or not err_console.is_terminal,
    ) as bar:  # fmt: skip
        task = bar.add_task(f"importing {path.name}", total=None, visible=False)

        def progress(done_bytes: int, total_bytes: int) -> None:
            visible = total_bytes >= PROGRESS_MIN_BYTES
            bar.update(task, completed=done_bytes, total=total_bytes, visible=visible)

        # root writes the pool itself; a user's files go to spswapd as open descriptors
        manifest = import_model(load_config(root), path, name, progress=progress)
    seconds = time.perf_counter() - t0
    # An entry written by this call was created after it started; an older one was reused.
    reused = manifest.created < started
    _report_import(pool, manifest, seconds, reused, json_out)


def _report_import(pool: Pool, m: Manifest, seconds: float, reused: bool, json_out: bool) -> None:
    out = {
        "name": m.name, "digest": m.digest, "path": str(pool.entry_dir(m.digest)),
        "data_size_bytes": m.data_size_bytes, "tensor_count": len(m.tensors),
        "seconds": seconds, "bytes_per_s": m.tensor_bytes / seconds if seconds > 0 else None,
        "reused": reused,
    }  # fmt: skip
    if json_out:
        emit_json(out)
        return
    how = "reused" if reused else "imported"
    rate = "" if reused else f" at {fmt_rate(m.tensor_bytes, seconds)}"
    console.print(
        f"{how} {m.name} {m.digest[:12]}: {len(m.tensors)} tensors, "
        f"{fmt_bytes(m.data_size_bytes)} in {fmt_seconds(seconds)}{rate}\n"
        f"digest {m.digest}"
    )


@app.command("ls")
def ls(root: Path | None = RootOpt, json_out: bool = JsonOpt) -> None:
    """List the pool's entries, most recently used first, with size and live users.

    --json: each entry's `sources` are the files it was imported from, with size and
    mtime: an import by root names their paths; one by a user goes through spswapd as open
    files, named `/fd-import/uid<UID>/dev<D>-ino<I>/<file>` (the file's device and inode:
    spswapd does not trust a path a user sends). `identity` is the engine layout an export
    from a running engine recorded (the engine, its version, dtype, tensor-parallel
    rank ...); empty for an import from files."""
    pool = _pool(root)
    infos = pool.entries()
    listing = {
        "pool": str(pool.pool_dir), "capacity_bytes": pool.capacity_bytes,
        "used_bytes": sum(e.size_bytes for e in infos),
        "user_budget_bytes": pool.user_bytes, "yours_bytes": imported_bytes(infos, os.getuid()),
        "entries": [e.to_json() for e in infos],
    }  # fmt: skip
    if json_out:
        emit_json(listing)
        return
    console.print(render_pool(listing, time.time(), f" {listing['pool']}"))


@app.command("rm")
def rm(
    ref: str = typer.Argument(..., help="Entry name, digest, or digest prefix (>= 6 chars)."),
    force: bool = typer.Option(False, "--force", help="Remove even while a live job uses it."),
    root: Path | None = RootOpt,
) -> None:
    """Remove an entry (refused while a live process or job uses it, unless --force).

    Root only: the pool is every job's on the node. Entries no job uses are evicted by
    themselves, least recently used first, when an import needs their room.
    """
    pool = _pool(root)
    if not privileged():
        m = pool.find(ref)  # an unknown name is said as such first
        raise PermissionDenied(
            f"only root removes pool entries (the pool is every job's on this node; you are "
            f"uid {os.getuid()}): ask the node's admin to run `spswap pool rm {ref}`. "
            f"{m.name} needs no removal to make room: entries no job uses are evicted, least "
            "recently used first, when an import needs their space"
        )
    m = pool.remove(ref, force=force)
    console.print(f"removed {m.name} {m.digest[:12]} ({fmt_bytes(m.data_size_bytes)})")


@app.command("verify")
def verify(
    ref: str = typer.Argument(..., help="Entry name, digest, or digest prefix (>= 6 chars)."),
    root: Path | None = RootOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Recompute every tensor's checksum; exit 1 naming the first bad tensor and the jobs
    that use the entry (`--json`: `bad_tensor`, `users`; looked up only for a damaged one).

    It only reads the entry and removes nothing (`spswap pool rm` does, as root; a
    restored run whose check prompt failed has spswapd remove a damaged entry)."""
    pool = _pool(root)
    m = pool.find(ref)
    t0 = time.perf_counter()
    try:
        pool.verify(m.digest)
    except PoolCorrupt as e:
        if not json_out:
            raise
        # the error object every --json failure prints (`kind`, `message`, `exit_code`)
        emit_json({"name": m.name, "digest": m.digest, "ok": False, "bad_tensor": e.tensor,
                   "users": list(e.users), **error_json(e)})  # fmt: skip
        print_error(e)  # the text on stderr too, as for any failure
        raise typer.Exit(e.exit_code) from None
    seconds = time.perf_counter() - t0
    if json_out:
        emit_json({"name": m.name, "digest": m.digest, "ok": True, "bad_tensor": None,
                   "error": None, "tensor_count": len(m.tensors),
                   "data_size_bytes": m.data_size_bytes, "seconds": seconds,
                   "bytes_per_s": m.tensor_bytes / seconds if seconds > 0 else None})  # fmt: skip
        return
    console.print(f"ok {m.name} {m.digest[:12]}: {len(m.tensors)} tensors, "
                  f"{fmt_bytes(m.data_size_bytes)}, match, read in {fmt_seconds(seconds)} "
                  f"at {fmt_rate(m.tensor_bytes, seconds)}")  # fmt: skip
