"""``spswap images``: the node's checkpoint images (root: the image directory is 0700)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from spswap.checkpoint.images import read_meta
from spswap.cli.common import JsonOpt, RootOpt, console, emit_json, load_config
from spswap.daemon.image_room import ImageRoom
from spswap.errors import PermissionDenied
from spswap.fsutil import dir_size_bytes, read_json
from spswap.plain import plain_row
from spswap.units import fmt_bytes

app = typer.Typer(help="Checkpoint images kept for requeued jobs.", no_args_is_help=True)


def collect_images(images_root: Path, statuses_dir: Path) -> list[dict[str, Any]]:
    """One dict per finished image: key, job, size, identity, and its job's status."""
    out: list[dict[str, Any]] = []
    if not images_root.is_dir():
        return out
    for p in sorted(images_root.iterdir()):
        if not p.is_dir() or p.name.startswith("."):
            continue
        meta = read_meta(p) or {}
        job = p.name[3:].split("-", 1)[0] if p.name.startswith("job") else ""
        status = read_json(statuses_dir / f"{job}.json") or {}
        out.append({
            "key": p.name, "job_id": job, "size_bytes": dir_size_bytes(p),
            "created": meta.get("created_at"), "identity": meta.get("identity", {}),
            "state": status.get("state", "unknown"),
        })  # fmt: skip
    return out


@app.command("ls")
def ls(json: bool = JsonOpt, root: Path | None = RootOpt) -> None:
    """List the checkpoint images on this node: job, size, engine, model and state.

    Images are single use: restoring one deletes it; the epilog and later prologs delete
    the images of jobs that will not come back.
    """
    cfg = load_config(root)
    try:
        images = collect_images(cfg.paths.images, cfg.paths.run / "checkpoints")
    except PermissionError:
        raise PermissionDenied(
            f"{cfg.paths.images} is root's: run as root (users see their jobs' checkpoint "
            "state in `spswap status` and `spswap events`)"
        ) from None
    if json:
        emit_json(images)
        return
    if not images:
        console.print(f"no checkpoint images in {cfg.paths.images} (a restore uses its image "
                      "up; `spswap status` shows where each job's checkpoint stands)",
                      markup=False)  # fmt: skip
        return
    limits = ImageRoom.from_config(cfg).limits()
    t = Table(title=f"checkpoint images in {cfg.paths.images}",
              caption=f"{fmt_bytes(sum(i['size_bytes'] for i in images))} of the images' "
              f"budget {fmt_bytes(limits.total_bytes)} (SPSWAP_IMAGES_BYTES); one user's "
              f"up to {fmt_bytes(limits.user_bytes)} (SPSWAP_IMAGES_USER_BYTES)")  # fmt: skip
    for col in ("job", "state", "size", "engine", "model", "uid", "age"):
        t.add_column(col, overflow="fold")  # a narrow terminal folds values, never cuts them
    now = time.time()
    for i in images:
        ident = i["identity"]
        age = f"{(now - i['created']) / 60:.0f} min" if i["created"] else "?"
        plain_row(t, i["job_id"], i["state"], fmt_bytes(i["size_bytes"]),
                  str(ident.get("engine", "?")), str(ident.get("model_digest", "?"))[:12],
                  str(ident.get("uid", "?")), age)  # fmt: skip
    console.print(t)
