"""What ``spswap status`` shows: collected as JSON-ready data, rendered by pure functions.

Collection reads the files under the root (pool index, slot state, instance records, the
daemon's pid file); it needs no daemon, no torch and no Slurm.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from spswap import __version__
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.daemon.image_room import ImageRoom
from spswap.daemon.lifecycle import daemon_running
from spswap.errors import DaemonError
from spswap.fsutil import read_json
from spswap.instance.registry import InstanceRegistry
from spswap.liveness import IMAGE_USE_NOTE, Holder
from spswap.plain import DropToFit, TitleOnOneLine, plain_row
from spswap.pool.capacity import imported_bytes
from spswap.pool.store import Pool
from spswap.settings_check import (
    restart_hint,
    settings_differences,
    settings_problems,
    spswap_command,
)
from spswap.settings_file import settings_file_path
from spswap.slots.gpus import discover_gpus
from spswap.slots.state import build_snapshot
from spswap.slots.table import SlotTable
from spswap.slurm.backend import job_probe
from spswap.units import fmt_bytes
from spswap.users import user_cell, user_label

STATUS_VERSION = 1


def collect_status(cfg: Config, *, gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything ``spswap status`` shows, as data (what ``--json`` prints)."""
    if gpus is None:
        gpus = [g.to_json() for g in discover_gpus(cfg)]
    pid = daemon_running(cfg)
    settings = _settings(cfg, pid is not None)
    daemon_gpus = settings.pop("daemon_gpus")
    # the keep budget spswapd enforces (a walk saw this shell's edit before the restart)
    keep_cfg = dataclasses.replace(cfg, keep_bytes=settings.pop("daemon_keep_bytes")) \
        if "daemon_keep_bytes" in settings else cfg  # fmt: skip
    if daemon_gpus is not None and daemon_gpus != [g["index"] for g in gpus]:
        # the slot table is the daemon's: show its GPUs (the difference is listed)
        gpus = [{"index": i, "name": None, "memory_total_bytes": None, "source": "spswapd"}
                for i in daemon_gpus]  # fmt: skip
    pool = Pool.from_config(cfg)
    entries = pool.entries()

    indexes = [g["index"] for g in gpus]
    if cfg.root.is_dir():
        # with the job probe: a reservation of a live job outlives the process that made it
        slots = SlotTable(cfg.paths.slots, indexes, job_alive=job_probe()).snapshot()
    else:  # a read makes nothing: the slot table would make the root (and be a user's)
        slots = build_snapshot(indexes, [], [])
        settings["problems"].append(missing_root_text(str(cfg.root)))
    instances = [
        {**rec.to_json(), "alive": alive}
        for rec, alive in InstanceRegistry(cfg.paths.instances).list()
    ]
    checkpoints = _checkpoints(cfg.paths.run / "checkpoints")
    limits = ImageRoom.from_config(cfg).limits()
    saved = [c for c in checkpoints if c.get("state") == "saved"]
    return {
        "version": STATUS_VERSION,
        "spswap": __version__,
        "root": str(cfg.root),
        # -1: running, its pid file root's alone (a user asked) or not written yet
        "daemon": {"running": pid is not None, "pid": pid if pid and pid > 0 else None},
        "gpus": gpus,
        "slots": slots,
        "pool": {
            "capacity_bytes": pool.capacity_bytes,
            "used_bytes": sum(e.size_bytes for e in entries),
            "user_budget_bytes": pool.user_bytes,
            "yours_bytes": imported_bytes(entries, os.getuid()),
            "entries": [e.to_json() for e in entries],
        },
        "instances": instances,
        "checkpoints": checkpoints,
        "images": {  # (the saved images' sizes from their statuses: the images are root's)
            "used_bytes": sum(c.get("size_bytes") or 0 for c in saved),
            "budget_bytes": limits.total_bytes,
            "user_budget_bytes": limits.user_bytes,
            # the asking user's, against their share (the limit a user's dump meets first)
            "yours_bytes": sum(
                c.get("size_bytes") or 0 for c in saved if c.get("uid") == os.getuid()
            ),
            # what the dumped trees kept alive may hold (SPSWAP_KEEP_BYTES; 0: none kept),
            # and whether it was set (unset: 1/8 of RAM, 0 where RAM cannot be read): the
            # running spswapd's, else this shell's (what a daemon started now would read)
            "keep_budget_bytes": keep_cfg.keep_budget_bytes(),
            "keep_bytes_set": keep_cfg.keep_bytes is not None,
        },  # fmt: skip
        "settings": settings,
    }


def missing_root_text(root: str) -> str:
    """What ``spswap status`` says of a root that does not exist. Pure."""
    return (f"{root} does not exist: nothing of spswap has run on this node yet (a job's "
            "prolog starts spswapd, which makes it), or SPSWAP_ROOT / --root names another "
            "directory")  # fmt: skip


def _settings(cfg: Config, daemon_up: bool) -> dict[str, Any]:
    """Where this command's settings came from, what cannot hold of them, and where they
    differ from the running daemon's own (which it reports in its ``status``)."""

    out: dict[str, Any] = {"file": str(settings_file_path(os.environ)),
                           "problems": settings_problems(cfg), "differs": [],
                           "daemon_gpus": None}  # fmt: skip
    if not daemon_up:
        return out

    try:
        theirs = Client(cfg, timeout_s=2.0).call("status")
    except DaemonError:
        return out
    if isinstance(theirs.get("settings"), dict):
        out["differs"] = settings_differences(cfg.to_json(), theirs["settings"])
        if out["differs"]:  # how this shell runs spswap, for the restart hint
            out["command"] = spswap_command()
    if isinstance(theirs.get("settings_file"), str):
        out["daemon_file"] = theirs["settings_file"]  # the one it read, not this shell's
    if isinstance(theirs.get("gpus"), list):
        out["daemon_gpus"] = [int(g) for g in theirs["gpus"]]
    keep = (theirs.get("settings") or {}).get("SPSWAP_KEEP_BYTES", "absent")
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool)):
        out["daemon_keep_bytes"] = keep  # the budget in force is the daemon's (None: unset)
    return out


def _checkpoints(directory: Any) -> list[dict[str, Any]]:
    """Each job's checkpoint status as the daemon wrote it (readable by everyone: it says
    where a job's image stands and, after a cold start, why)."""
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        data = read_json(path)
        if isinstance(data, dict):
            keep = ("job_id", "uid", "state", "size_bytes", "reason", "timings_s", "kept",
                    "on_gpu")  # fmt: skip
            out.append({k: data.get(k) for k in keep})
    return out


def _ago(ts: float, now: float) -> str:
    if not ts:
        return "never"
    s = max(0.0, now - ts)
    if s < 60:
        return f"{s:.0f} s ago"
    if s < 3600:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _user(h: dict[str, Any]) -> str:
    return Holder.from_json(h).brief()


def pool_title(pool: dict[str, Any], uid: int, where: str = "") -> str:
    """What the pool holds of its capacity, and of one user's share (SPSWAP_POOL_USER_BYTES):
    the share's size for root, what the asking user's imports hold of it for a user. Pure."""
    title = f"pool{where}: {fmt_bytes(pool['used_bytes'])} of {fmt_bytes(pool['capacity_bytes'])}"
    if pool.get("user_budget_bytes") is None:  # (a listing without the share: none to show)
        return title
    share = fmt_bytes(pool["user_budget_bytes"])
    if uid == 0:
        return f"{title}; each user's imports at most {share}"
    return f"{title}; yours {fmt_bytes(pool.get('yours_bytes') or 0)} of {share}"


def render_pool(pool: dict[str, Any], now: float, where: str = "") -> Group:
    """One row per pool entry, most recently used first: whose share it counts in
    ("imported by"; "-": root's, or imported before shares), who uses it (in brief; what
    an image's use is, under the table), its last use."""
    title = pool_title(pool, os.getuid(), where)
    if not pool["entries"]:
        return Group(Text(f"{title}: no entries yet (a job's first run, or `spswap pool "
                          "import PATH`, puts its model in)"))  # fmt: skip
    t = Table(title=title)
    for col in ("name", "digest", "size", "tensors", "imported by", "users", "last use"):
        # a narrow terminal folds values, never cuts them; a digest stays whole (no_wrap:
        # a column's min_width made rich crop the table's right edge at 80 columns)
        t.add_column(col, overflow="fold", no_wrap=col == "digest")
    for e in pool["entries"]:
        users = "\n".join(_user(h) for h in e["users"]) or "-"
        importers = ", ".join(user_label(u) for u in e.get("importers") or []) or "-"
        plain_row(t, e["name"], e["digest"][:12], fmt_bytes(e["size_bytes"]),
                  str(e["tensor_count"]), importers, users, _last_use(e, now))  # fmt: skip
    images = any(h.get("purpose") == "image" for e in pool["entries"] for h in e["users"])
    table = TitleOnOneLine(t)
    return Group(table, Text(IMAGE_USE_NOTE)) if images else Group(table)


def _last_use(entry: dict[str, Any], now: float) -> str:
    """An entry's last use: "in use now" while a process or job uses it; kept for an
    image alone (its job is not running), since it was last used."""
    if any(h.get("purpose") != "image" for h in entry["users"]):
        return "in use now"
    ago = _ago(entry["last_used"], now)
    return f"{ago}, kept for an image" if entry["users"] else ago


INSTANCE_COLUMNS = ("id", "model", "engine", "state", "device", "job", "pid", "updated")


def render_instances(instances: list[dict[str, Any]], now: float,
                     checkpoints: list[dict[str, Any]] | None = None) -> DropToFit:  # fmt: skip
    """One row per model instance the node knows of; in a narrow terminal without its
    device, engine and pid columns (then named under it)."""
    rows: list[list[object]] = []
    by_job = {str(c.get("job_id")): c for c in checkpoints or []}
    newest = newest_of_jobs(instances)
    for i in instances:
        pid = str(i["pid"]) + ("" if i["alive"] else " (gone)")
        job = str(i.get("job_id"))
        later = newest.get(job) if i.get("job_id") else None
        # another run's (another process: a multi-model run's models share their pid)
        replaced_by = later["id"] if later is not None and later["pid"] != i["pid"] else None
        rows.append([i["id"], i["model"], i["engine"],
                     instance_state_text(i, by_job.get(job), replaced_by), i["device"],
                     i.get("job_id") or "-", pid, _ago(i["updated"], now)])  # fmt: skip
    return DropToFit(
        "instances",
        INSTANCE_COLUMNS,
        rows,
        droppable=("device", "engine", "pid"),
        left_out_note="left out at this width (spswap status --json has them)",
    )


def checkpoint_state_text(state: str, kept: bool, on_gpu: bool = False) -> str:
    """A job's checkpoint state as a table shows it: a saved one kept alive (frozen
    beside its image) says so, and where its GPU state waits on its GPU
    (SPSWAP_KEEP_ON_GPU). Pure."""
    if not (kept and state == "saved"):
        return state
    return "saved, kept alive on its GPU" if on_gpu else "saved, kept alive"


def newest_of_jobs(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each job's most recently updated instance record (job id -> the record). Pure."""
    newest: dict[str, dict[str, Any]] = {}
    for i in instances:
        job = i.get("job_id")
        if job and (str(job) not in newest or i["updated"] > newest[str(job)]["updated"]):
            newest[str(job)] = i
    return newest


def instance_state_text(instance: dict[str, Any], checkpoint: dict[str, Any] | None,
                        replaced_by: str | None = None) -> str:  # fmt: skip
    """An instance's state as its row shows it: a record whose process is gone after its
    checkpoint (its last word) also says where its job's checkpoint stands now (saved,
    restored, deleted ...), which spswapd keeps up to date and the record does not; one
    that a later run of its job replaced (``replaced_by``: that run's instance) says so
    instead (the job's checkpoint is that run's now). Pure."""
    state = str(instance["state"])
    if instance["alive"] or state != "checkpoint":
        return state
    if replaced_by is not None:
        return f"{state}; replaced by {replaced_by}"
    if not checkpoint:
        return state
    return f"{state}; job's checkpoint {checkpoint.get('state')}"


NOTE_CHARS = 120


def short_note(text: str) -> str:
    """A note cut to :data:`NOTE_CHARS` for a table cell (a refused dump's reason runs to
    several hundred characters: at 80 columns one cell grew 80 lines); whole in --json
    and `spswap events`. Pure."""
    if len(text) <= NOTE_CHARS:
        return text
    return text[: NOTE_CHARS - 1].rstrip() + "… (whole in --json)"


def kept_text(keep_budget_bytes: int, set_by_site: bool = True) -> str:
    """What the keep budget lets stay alive after a dump, for the status's head;
    ``set_by_site``: SPSWAP_KEEP_BYTES was set (else its default, 1/8 of RAM). Pure."""
    if keep_budget_bytes <= 0 and not set_by_site:
        return ("none: this node's memory size could not be read for the default (1/8 of "
                "RAM): set SPSWAP_KEEP_BYTES")  # fmt: skip
    if keep_budget_bytes <= 0:
        return "none: dumped instances come back from their images (SPSWAP_KEEP_BYTES=0)"
    how = "SPSWAP_KEEP_BYTES" if set_by_site else "SPSWAP_KEEP_BYTES unset: 1/8 of RAM"
    return f"up to {fmt_bytes(keep_budget_bytes)} of dumped instances ({how})"


def render_checkpoints(checkpoints: list[dict[str, Any]],
                       images: dict[str, Any] | None = None) -> TitleOnOneLine:  # fmt: skip
    """One row per job with a checkpoint: state, image size, and the reason of a failure;
    the title says what the saved images hold of their budget (``images``)."""
    title = "checkpoints"
    if images:
        yours = images.get("yours_bytes") or 0
        title += (f" (images: {fmt_bytes(images['used_bytes'])} of "
                  f"{fmt_bytes(images['budget_bytes'])}, one user's up to "
                  f"{fmt_bytes(images['user_budget_bytes'])}"
                  + (f", yours {fmt_bytes(yours)}" if yours else "") + ")")  # fmt: skip
    t = Table(title=title)
    for col in ("job", "user", "state", "image"):
        t.add_column(col, overflow="fold")  # a narrow terminal folds values, never cuts them
    for c in checkpoints:
        size = fmt_bytes(c["size_bytes"]) if c.get("size_bytes") else "-"
        state = checkpoint_state_text(str(c.get("state")), bool(c.get("kept")),
                                      bool(c.get("on_gpu")))  # fmt: skip
        plain_row(t, c.get("job_id"), user_cell(c.get("uid")), state, size)
    return TitleOnOneLine(t)


def notes_text(label: str, notes: list[tuple[str, str]]) -> Text | None:
    """A table's long texts (an instance's note, a checkpoint's reason) under it, a line
    each ("  key: text"), not in a column that a narrow terminal folds to a word a line;
    None when there are none. Plain text, not markup. Pure."""
    lines = [f"  {key}: {short_note(note)}" for key, note in notes if note]
    return Text("\n".join([f"{label}:", *lines])) if lines else None


def render_status(data: dict[str, Any], *, now: float | None = None) -> Group:
    """The rich view of :func:`collect_status`'s data."""
    from spswap.cli.slots import render_slots

    now = time.time() if now is None else now
    d = data["daemon"]
    head = Table.grid(padding=(0, 2))
    head.add_row("spswap", data["spswap"])
    head.add_row("root", data["root"])
    head.add_row("daemon", "not running (the Slurm prolog starts it at a job's start; root: "
                 "spswap daemon start)"
                 if not d["running"] else f"running (pid {d['pid']})" if d.get("pid")
                 else "running")  # fmt: skip
    gpus = (
        ", ".join(
            f"{g['index']}" + (f" {g['name']}" if g.get("name") else "") for g in data["gpus"]
        )
        or "none found (no NVIDIA GPU seen here; on a GPU node that NVML cannot read, set "
        "SPSWAP_GPUS, e.g. 0,1)"
    )
    head.add_row("GPUs", gpus)  # fmt: skip
    images = data.get("images") or {}
    if (keep := images.get("keep_budget_bytes")) is not None:
        head.add_row("kept alive", kept_text(int(keep), bool(images.get("keep_bytes_set", True))))
    settings = data.get("settings") or {}
    for line in settings.get("problems", []):
        head.add_row("warning", line)
    if settings.get("differs"):
        head.add_row(
            "settings",
            "spswapd runs with other settings than this shell reads: "
            + "; ".join(settings["differs"])
            + ". "
            + restart_hint(
                settings.get("daemon_file") or settings.get("file"),
                settings.get("command") or "spswap",
            ),
        )
    parts: list[Any] = [head]
    if data["gpus"]:
        parts.extend(render_slots(data["slots"]))
    parts.append(render_pool(data["pool"], now))
    parts.append(render_instances(data["instances"], now, data.get("checkpoints"))
                 if data["instances"] else
                 "instances: none (a running `spswap serve` shows here)")  # fmt: skip
    parts.append(notes_text("notes", [(str(i["id"]), str(i.get("reason") or ""))
                                      for i in data["instances"]]))  # fmt: skip
    if not data.get("checkpoints"):
        parts.append("checkpoints: none (a preempted job's checkpoint shows here)")
    else:
        parts.append(render_checkpoints(data["checkpoints"], data.get("images")))
        parts.append(notes_text("reasons", [(f"job {c.get('job_id')}", str(c.get("reason") or ""))
                                            for c in data["checkpoints"]]))  # fmt: skip
    return Group(*[p for p in parts if p is not None])
