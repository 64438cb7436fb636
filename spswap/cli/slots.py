"""``spswap slots``: list, make and give back GPU slot reservations on this node."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from spswap.access import release_slot, reserve_slot, writes_directly
from spswap.cli.common import JsonOpt, RootOpt, console, emit_json, load_config
from spswap.errors import SlotError
from spswap.liveness import Holder
from spswap.plain import plain_row
from spswap.slots.table import UNITS_PER_GPU, SlotTable
from spswap.slurm.backend import job_probe
from spswap.users import user_label

app = typer.Typer(
    help=(
        "GPU slot reservations: each GPU is split into 4 units; a reservation takes 1, 2 "
        "or 4 units of one GPU, or whole GPUs. Waiters are served first come, first served."
    ),
    no_args_is_help=True,
)

_GpuOpt = typer.Option(
    None, "--gpu", help="Only use this GPU index (repeat for several); default: any."
)


def units_bar(owners: list[str | None]) -> str:
    """``"██░░"``: one block per unit, full when held."""
    return "".join("░" if o is None else "█" for o in owners)


def render_slots(snapshot: dict[str, Any]) -> list[Table]:
    """Rich tables for a :meth:`SlotTable.snapshot`: one row per GPU, then the waiters."""
    by_id = {r["id"]: r for r in snapshot["reservations"]}
    gpus = Table(title="GPU slots")
    for col in ("GPU", "units", "free", "holders"):
        gpus.add_column(col, overflow="fold")
    for g in snapshot["gpus"]:
        holders = []
        for rid in dict.fromkeys(o for o in g["units"] if o is not None):
            r = by_id[rid]
            who = Holder.from_json(r["holder"]).describe()
            since = time.strftime("%H:%M:%S", time.localtime(r["granted_at"]))
            holders.append(f"{rid} {r['model']} ({who}, since {since})")
        name = str(g["index"]) if g.get("known", True) else f"{g['index']} (not seen here)"
        plain_row(
            gpus,
            name, units_bar(g["units"]), f"{g['units_free']}/{g['units_total']}",
            "\n".join(holders) or "-",
        )  # fmt: skip
    tables = [gpus]
    if snapshot["waiters"]:
        waiters = Table(title="waiting (first come, first served)")
        for col in ("ticket", "model", "wants", "GPUs", "holder", "waiting"):
            waiters.add_column(col, overflow="fold")
        now = time.time()
        for q in snapshot["waiters"]:
            h = q["holder"]
            wants = f"{q['whole_gpus']} GPU(s)" if q.get("whole_gpus") else f"{q['units']} unit(s)"
            job = f" job {h['job_id']}" if h.get("job_id") else ""
            plain_row(
                waiters,
                str(q["ticket"]), q["model"], wants, ",".join(map(str, q["candidates"])),
                f"pid {h['pid']}{job} ({user_label(h['uid'])})", f"{now - q['enqueued_at']:.1f} s",
            )  # fmt: skip
        tables.append(waiters)
    return tables


@app.command("ls")
def ls(json_out: bool = JsonOpt, root: Path | None = RootOpt) -> None:
    """Show every GPU's units, who holds them and who waits (stale holders are reclaimed)."""
    table = SlotTable.from_config(load_config(root), job_alive=job_probe())
    snap = table.snapshot()
    if json_out:
        emit_json(snap)
        return
    if not snap["gpus"]:
        console.print("no GPUs known: NVML found none; set SPSWAP_GPUS (e.g. 0,1,2,3)")
    for t in render_slots(snap):
        console.print(t)


@app.command("reserve")
def reserve(
    model: str = typer.Option(
        ..., "--model", help="Model the reservation is for (shown to others)."
    ),
    units: int = typer.Option(
        UNITS_PER_GPU, "--units", help="Units of one GPU: 1 (quarter), 2 (half) or 4 (whole)."
    ),
    whole_gpus: int | None = typer.Option(
        None, "--gpus", help="Reserve N whole GPUs instead of units of one GPU."
    ),
    gpu: list[int] | None = _GpuOpt,
    timeout_s: float | None = typer.Option(
        None, "--timeout-s", help="Seconds to wait in line; default SPSWAP_SLOT_TIMEOUT_S (600)."
    ),
    pid: int | None = typer.Option(
        None,
        "--pid",
        help="Process whose life keeps the reservation (root only); default: the calling shell.",
    ),  # fmt: skip
    job_id: str | None = typer.Option(
        None,
        "--job-id",
        envvar="SLURM_JOB_ID",
        help="Slurm job whose life keeps the reservation; default: $SLURM_JOB_ID.",
    ),  # fmt: skip
    json_out: bool = JsonOpt,
    root: Path | None = RootOpt,
) -> None:
    """Reserve GPU units and print the reservation id (wait in line if they are taken).

    The command waits in line up to --timeout-s, prints the id and exits; the
    reservation stays. Run by root, it is tied to the calling shell (or --pid) and,
    inside a Slurm job, to the job: it is reclaimed when they end. A user's is made by
    spswapd and tied to the job ($SLURM_JOB_ID or --job-id) alone, on that job's GPUs:
    outside a job a user's is refused (it would end with the command). Give it back
    earlier with `spswap slots release ID`.
    """
    cfg = load_config(root)
    wait_s = cfg.slot_timeout_s if timeout_s is None else timeout_s
    if writes_directly(cfg):
        table = SlotTable.from_config(cfg, job_alive=job_probe())
        holder = Holder.current(pid=os.getppid() if pid is None else pid, job_id=job_id or None)
        r = table.reserve(model=model, units=units, whole_gpus=whole_gpus,
                          allowed_gpus=gpu or None, holder=holder, timeout_s=wait_s)  # fmt: skip
    else:
        # Users write the table through spswapd, which holds it for the calling process
        # (this one, gone when it exits) and, when given, for the caller's Slurm job.
        if not job_id:
            raise SlotError(
                "outside a Slurm job a reservation of yours would end with this command "
                "(it is held for the process that asked, which exits at once): run it in "
                "your job (e.g. `srun --jobid=JOB --overlap spswap slots reserve ...`) or "
                "give --job-id JOB of a running job of yours"
            )
        r = reserve_slot(
            cfg,
            model=model,
            units=units,
            whole_gpus=whole_gpus,
            allowed_gpus=gpu or None,
            job_id=job_id or None,
            timeout_s=wait_s,
        )
    if json_out:
        emit_json(r.to_json())
    else:
        console.print(r.id)


@app.command("release")
def release(
    reservation_id: str = typer.Argument(..., help="The id `spswap slots reserve` printed."),
    json_out: bool = JsonOpt,
    root: Path | None = RootOpt,
) -> None:
    """Give a reservation back (your own, or anyone's as root)."""
    r = release_slot(load_config(root), reservation_id)  # a user's goes through spswapd
    if json_out:
        emit_json(r.to_json())
    else:
        console.print(f"released {r.id} ({r.model})")
