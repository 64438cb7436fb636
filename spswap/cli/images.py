"""``spswap images``: the node's checkpoint images (root: the image directory is 0700)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from spswap.access import privileged
from spswap.checkpoint.image_layout import KINDS, ImageLayout, ProcessLayout, image_layout
from spswap.checkpoint.images import DIGEST_SEP, files_problem, read_meta
from spswap.checkpoint.service import images_of_job, job_of_key, real_job_id, real_job_ids
from spswap.cli.common import JsonOpt, RootOpt, console, emit_json, load_config
from spswap.daemon.client import Client
from spswap.daemon.image_room import ImageRoom
from spswap.errors import (
    ConfigError,
    ImageNotFound,
    ImageUnreadable,
    PermissionDenied,
    SpswapError,
)
from spswap.fsutil import dir_size_bytes, read_json
from spswap.plain import DropToFit, plain_row
from spswap.pool.store import Pool
from spswap.status import checkpoint_state_text
from spswap.units import fmt_bytes
from spswap.users import user_cell

app = typer.Typer(help="Checkpoint images kept for requeued jobs.", no_args_is_help=True)


def _job_order(image: dict[str, Any]) -> tuple[int, str]:
    """Images in job order (7 before 10; an array's or het job's by its first number),
    then by key."""
    head = re.split(r"[_+]", image["job_id"], maxsplit=1)[0]
    return (int(head) if head.isdigit() else 1 << 62, image["key"])


def collect_images(images_root: Path, statuses_dir: Path) -> list[dict[str, Any]]:
    """One dict per finished image: key, job, size, identity, and its job's status."""
    out: list[dict[str, Any]] = []
    if not images_root.is_dir():
        return out
    real = real_job_ids(statuses_dir)  # a het job's '+' is '_' in its images' names
    for p in images_root.iterdir():
        if not p.is_dir() or p.name.startswith("."):
            continue
        meta = read_meta(p) or {}
        key_job = job_of_key(p.name)
        job = real_job_id(real, key_job) if key_job else ""
        status = (read_json(statuses_dir / f"{job}.json") or {}) if job else {}
        problem = files_problem(p)  # what a restore would refuse it for, whatever the job
        out.append({
            "key": p.name, "path": str(p), "job_id": job, "size_bytes": dir_size_bytes(p),
            "created": meta.get("created_at"), "identity": meta.get("identity", {}),
            "state": "refused" if problem else status.get("state", "unknown"),
            "kept": bool(status.get("kept")) and not problem, "problem": problem,
            "on_gpu": bool(status.get("on_gpu")) and not problem,
        })  # fmt: skip
    return sorted(out, key=_job_order)


def refused_lines(images: list[dict[str, Any]]) -> list[str]:
    """A line for each image a restore would refuse, saying why and what becomes of it."""
    return [f"job {i['job_id'] or i['key']}: {i['problem']}; a restore refuses it (and "
            f"deletes it), or {_rm_hint(i['job_id'], i['path'])} now"
            for i in images if i.get("problem")]  # fmt: skip


def _rm_hint(job_id: str, path: str) -> str:
    """How root deletes an image: through spswapd by its job, or by hand when its name
    holds no job (spswap never makes such a name)."""
    return f"`spswap images rm {job_id}`" if job_id else f"`rm -r {path}`"


@app.command("ls")
def ls(json: bool = JsonOpt, root: Path | None = RootOpt) -> None:
    """List the checkpoint images on this node: job, state, size on disk, engine, model.

    Images are single use: restoring one deletes it; the epilog and later prologs delete
    the images of jobs that will not come back. State "refused": a restore would refuse
    the image whatever its job (its owner or modes, no record, files missing or changed
    in size); the line under the table says why. `--json`: {"images": [...] (each with
    `model`, its pool entry's name, null where the entry is gone),
    "used_bytes", "budget_bytes", "user_budget_bytes"} (the budgets as in `spswap status`).
    """
    cfg = load_config(root)
    try:
        images = collect_images(cfg.paths.images, cfg.paths.run / "checkpoints")
    except PermissionError:
        raise PermissionDenied(
            f"{cfg.paths.images} is root's: run as root (users see their jobs' checkpoint "
            "state in `spswap status` and `spswap events`)"
        ) from None
    limits = ImageRoom.from_config(cfg).limits()
    names = model_names(cfg)
    for i in images:  # the model's pool entry's name (an image names it by digest)
        i["model"] = image_model_name(str(i["identity"].get("model_digest")), names)
    if json:
        emit_json({"images": images, "used_bytes": sum(i["size_bytes"] for i in images),
                   "budget_bytes": limits.total_bytes,
                   "user_budget_bytes": limits.user_bytes})  # fmt: skip
        return
    if not images:
        console.print(f"no checkpoint images in {cfg.paths.images} (a restore uses its image "
                      "up; `spswap status` shows where each job's checkpoint stands)",
                      markup=False)  # fmt: skip
        return
    caption = (f"{fmt_bytes(sum(i['size_bytes'] for i in images))} of the images' budget "
               f"{fmt_bytes(limits.total_bytes)} (SPSWAP_IMAGES_BYTES); one user's up to "
               f"{fmt_bytes(limits.user_bytes)} (SPSWAP_IMAGES_USER_BYTES)")  # fmt: skip
    now = time.time()
    rows = []
    for i in images:
        ident = i["identity"]
        age = f"{(now - i['created']) / 60:.0f} min" if i["created"] else "?"
        digest = str(ident.get("model_digest", "?"))
        rows.append([i["job_id"], checkpoint_state_text(i["state"], i["kept"], i["on_gpu"]),
                     fmt_bytes(i["size_bytes"]), str(ident.get("engine", "?")),
                     i["model"] or digest[:12], user_cell(ident.get("uid"), "?"), age])  # fmt: skip
    # a narrow terminal: columns left out (named under it) rather than words broken
    console.print(DropToFit(f"checkpoint images in {cfg.paths.images}", IMAGE_COLUMNS, rows,
                            droppable=("user", "age", "engine"), caption=caption,
                            left_out_note="left out at this width (--json has them)"))  # fmt: skip
    for line in refused_lines(images):
        console.print(line, markup=False)


IMAGE_COLUMNS = ("job", "state", "on disk", "engine", "model", "user", "age")


def image_model_name(digest: str, names: dict[str, str]) -> str | None:
    """The name an image's model goes by: its pool entry's; a multi-model job's digests
    (joined by DIGEST_SEP) as its models' names joined by "+", as `spswap status` names
    the job's slot; None where an entry is gone. Pure.

    >>> image_model_name("d1+d2", {"d1": "m1", "d2": "m2"}), image_model_name("d3", {})
    ('m1+m2', None)
    """
    found = [names.get(d) for d in digest.split(DIGEST_SEP)]
    return "+".join(n for n in found if n) if all(found) else None


def model_names(cfg: Any) -> dict[str, str]:
    """The pool's entries' names by digest (an image names its model by digest); empty
    where the pool cannot be read."""
    try:
        return {e.manifest.digest: e.manifest.name for e in Pool.from_config(cfg).entries()}
    except (OSError, SpswapError):
        return {}


SHOWN_PROCESSES = 2  # columns of their own; the rest of an image's processes in one


def layout_rows(layout: ImageLayout) -> list[tuple[str, ...]]:
    """`spswap images show`'s table, its header first: a row per kind of memory (KINDS)
    and their sum; a column for each of the two processes with the most dumped bytes,
    one for the rest (where there are more) and one for the whole image (its shared
    memory too); the dumped bytes, what a restore reads back."""
    ranked = sorted(layout.processes, key=lambda p: p.dumped_bytes, reverse=True)
    shown, rest = ranked[:SHOWN_PROCESSES], ranked[SHOWN_PROCESSES:]
    total = layout.bytes_by_kind()

    def row(name: str, value: Callable[[ProcessLayout], int], whole: int) -> tuple[str, ...]:
        cells = [fmt_bytes(value(p)) for p in shown]
        if rest:
            cells.append(fmt_bytes(sum(value(p) for p in rest)))
        return (name, *cells, fmt_bytes(whole))

    header = ("", *(f"pid {p.pid}" for p in shown),
              *((f"{len(rest)} more",) if rest else ()), "image")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]

    def of_kind(kind: str) -> Callable[[ProcessLayout], int]:
        return lambda p: p.bytes_by_kind[kind]

    rows += [row(kind, of_kind(kind), total[kind]) for kind in KINDS]
    rows.append(row("dumped", lambda p: p.dumped_bytes, layout.dumped_bytes))
    return rows


def largest_lines(layout: ImageLayout) -> list[str]:
    """The largest heap and anonymous areas of each process, a line each, dumped bytes
    first (an area's dumped bytes can be fewer than its size: pages never touched)."""
    lines = [f"  pid {p.pid}  {fmt_bytes(a.dumped_bytes):>10}  {a.kind:<9}  at {a.start:#x} "
             f"(area {fmt_bytes(a.size_bytes)})"
             for p in layout.processes for a in p.largest]  # fmt: skip
    return ["largest areas:", *lines] if lines else []


# what CRIU's restore filled a process's memory at on the GPU nodes measured (H100, H200:
# 1.4-2.4 GB/s, docs/benchmarks.md): for the note's estimate only
RESTORE_FILL_BYTES_PER_S = 2e9


def layout_notes(layout: ImageLayout) -> list[str]:
    """What the table means for a restore: the bytes it fills and about how long the
    largest process takes (processes fill side by side); where shared memory shows."""
    total = layout.dumped_bytes
    largest = max(layout.processes, key=lambda p: p.dumped_bytes)
    fill_s = largest.dumped_bytes / RESTORE_FILL_BYTES_PER_S
    notes = [f"a restore from it fills {fmt_bytes(total)}; each process fills its own, side "
             f"by side: the largest, pid {largest.pid}, {fmt_bytes(largest.dumped_bytes)} in "
             f"about {fill_s:.1f} s at ~2 GB/s"]  # fmt: skip
    if layout.shared_bytes:
        notes.append(f"shared memory ({fmt_bytes(layout.shared_bytes)}) is dumped once for "
                     "the image: only the image column counts it")  # fmt: skip
    return notes


def find_image(images_root: Path, job_or_key: str) -> Path:
    """The image named ``job_or_key`` (its key), else the newest image of that job."""
    if re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,199}", job_or_key) is None:
        raise ConfigError(f"{job_or_key!r} is neither a job id nor an image's key: "
                          "`spswap images ls` lists the node's images")  # fmt: skip
    exact = images_root / job_or_key
    if exact.is_dir():
        return exact
    found = images_of_job(images_root, job_or_key) if len(job_or_key) <= 64 else []
    if not found:
        raise ImageNotFound(f"no checkpoint image of job {job_or_key!r}, nor one of that "
                            f"name, in {images_root}: `spswap images ls` lists the node's "
                            "images")  # fmt: skip
    return max(found, key=lambda p: p.stat().st_mtime)


JOB_ARG = typer.Argument(..., metavar="JOB", help="The image's job id (as `spswap images ls` "
                         "shows it), or the image's key (its directory's name)")  # fmt: skip


@app.command("show")
def show(job: str = JOB_ARG, json: bool = JsonOpt, root: Path | None = RootOpt) -> None:
    """Show what a checkpoint image holds, by kind of memory: the bytes a restore from it
    reads back and fills, at about 2 GB/s a process (processes fill side by side), so
    what makes a restore from an image slow.

    Rows: heap (the C heap; spswap gives its freed pages back before a dump), anonymous
    (other private memory; a CUDA checkpoint's copy of the GPU state is here), stack,
    file private (pages of mapped files the process changed), shared (shared memory,
    dumped once for the image), other (vDSO and pages in no area), dumped (their sum).
    Columns: the two processes with the most dumped bytes, the rest together ("N more"),
    and the whole image. The `largest areas:` list after the table names each process's
    largest heap and anonymous areas. A job with several images: its newest.
    """
    cfg = load_config(root)
    try:
        image = find_image(cfg.paths.images, job)
        layout = image_layout(image)
    except PermissionError:
        raise PermissionDenied(f"{cfg.paths.images} is root's: run as root (users see their "
                               "jobs' images by kind in `spswap events --json`: "
                               "checkpoint.layout)") from None  # fmt: skip
    except ImageUnreadable as e:
        raise ImageUnreadable(f"{image} cannot be read as a CRIU image ({e}): it is damaged; "
                              "a restore refuses it and deletes it, or "
                              f"{_rm_hint(job_of_key(image.name) or '', str(image))} "
                              "now") from None  # fmt: skip
    job_id = job_of_key(image.name) or job
    if json:
        emit_json({"job_id": job_id, "key": image.name, "dumped_bytes": layout.dumped_bytes,
                   **layout.to_json()})  # fmt: skip
        return
    header, *rows = layout_rows(layout)
    t = Table(title=f"job {job_id}'s image: dumped bytes", box=box.SIMPLE_HEAD)
    for i, col in enumerate(header):  # a narrow terminal folds values, never cuts them
        t.add_column(col, justify="right" if i else "left", overflow="fold")
    for row in rows:
        plain_row(t, *row)
    console.print(t)
    # on a line of its own, never folded: a key is copied (`spswap images show KEY`, scripts)
    console.print(f"key: {image.name}", markup=False, soft_wrap=True)
    for line in [*layout_notes(layout), *largest_lines(layout)]:
        console.print(line, markup=False)


@app.command("rm")
def rm(job: str = typer.Argument(..., metavar="JOB", help="The job id whose images go (as "
                                 "`spswap images ls` shows it)"),
       json: bool = JsonOpt, root: Path | None = RootOpt) -> None:  # fmt: skip
    """Delete a job's checkpoint images on this node, and its instance kept alive, as if
    the job would not come back: its memory on the tmpfs (and the kept tree's) is freed
    and its next run here starts from the pool. Root only; spswapd does it (it accounts
    for the images and their pool entries), refusing while the job is being saved or
    restored or runs here (hold a requeued job first: `scontrol hold JOB`). Images of jobs
    that end for good go by themselves. Exits 0 when done or when the job has nothing here
    (--json: found false), 1 when refused, 3 for a user.
    """
    cfg = load_config(root)
    if not privileged():
        raise PermissionDenied(f"only root deletes checkpoint images: ask the node's admin to "
                               f"run `spswap images rm {job}` (yours go by themselves when "
                               "your job ends for good)")  # fmt: skip
    result = Client(cfg, timeout_s=60.0).call("images.remove", job_id=job)
    if json:
        emit_json(result)
    else:
        console.print(removed_text(job, result), markup=False)


def removed_text(job: str, result: dict[str, Any]) -> str:
    """What ``spswap images rm`` did, from spswapd's answer (found, images_deleted,
    kept_ended). Pure."""
    if not result["found"]:
        return f"job {job} has no checkpoint image on this node (`spswap images ls` lists them)"
    done = []
    if result["images_deleted"]:
        done.append(f"deleted job {job}'s checkpoint image ({', '.join(result['images_deleted'])})")
    if result.get("kept_ended"):
        done.append(("ended its" if done else f"ended job {job}'s") + " instance kept alive")
    what = " and ".join(done) or f"released what spswapd held for job {job}"
    return f"{what}: its next run here starts from the pool"
