"""Golden tests of `spswap status --json` and of the table output."""

from __future__ import annotations

import difflib
import io
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from spswap.cli.app import app
from spswap.config import Config
from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.liveness import Holder
from spswap.pool.store import Pool
from spswap.slots.table import SlotTable
from spswap.status import collect_status, render_status

GOLDEN = Path(__file__).parent / "golden"
ACCEPT = os.environ.get("SPSWAP_ACCEPT_GOLDEN") == "1"
FIXED_T = 1_800_000_000.0


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if ACCEPT:
        path.write_text(text)
    expected = path.read_text()
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True), text.splitlines(True), f"golden/{name}", "actual"
            )
        )
        pytest.fail(
            f"{name} changed:\n{diff}\naccept with: SPSWAP_ACCEPT_GOLDEN=1 pytest "
            f"tests/test_status.py"
        )


def _write_safetensors(path: Path) -> None:
    """A two-tensor F32 checkpoint with fixed bytes (no torch needed)."""
    a = struct.pack("<4f", 1, 2, 3, 4)
    b = struct.pack("<2f", 5, 6)
    header = {
        "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b.bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + a + b)


def _normalize(data: dict[str, Any]) -> dict[str, Any]:
    """Replace what differs between runs (times, pids, temp paths) with placeholders."""
    text = json.dumps(data)
    root = data["root"]
    text = text.replace(root, "<root>")
    d = json.loads(text)
    d["spswap"] = "<version>"
    d["pool"]["capacity_bytes"] = 1 << 30
    # on-disk size includes manifest.json, whose length follows the temp path and the time
    d["pool"]["used_bytes"] = sum(e["data_size_bytes"] for e in d["pool"]["entries"])
    for e in d["pool"]["entries"]:
        e["created"] = e["last_used"] = FIXED_T
        e["size_bytes"] = e["data_size_bytes"]
        e["sources"] = [{**s, "path": Path(s["path"]).name, "mtime_ns": 0} for s in e["sources"]]
        for h in e["users"]:
            h.update(pid=1234, pid_start=None, since=FIXED_T)
    for r in d["slots"]["reservations"]:
        r["granted_at"] = FIXED_T
        r["holder"].update(pid=1234, pid_start=None, since=FIXED_T)
    for i in d["instances"]:
        i.update(pid=1234, updated=FIXED_T)
    for c in d["checkpoints"]:
        if c["uid"] == os.getuid():  # (the asking user's own: "yours"; a uid in no
            c["uid"] = 3_999_999_999  # user database, so the table is the same everywhere)
    return d


@pytest.fixture
def node(tmp_path: Path) -> Config:
    cfg = Config.from_env(
        {},
        root=tmp_path / "root",
        pool_capacity_bytes=1 << 30,
        images_bytes=8 << 30,
        images_user_bytes=4 << 30,
        keep_bytes=2 << 30,
    )
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _write_safetensors(ckpt / "model.safetensors")
    pool = Pool.from_config(cfg)
    m = pool.import_checkpoint(ckpt, name="tiny")
    me = Holder.current(job_id="77")
    pool.acquire_use(m.digest, me)
    table = SlotTable(cfg.paths.slots, [0, 1])
    table.reserve(model="tiny", units=2, holder=me, timeout_s=1)
    table.reserve(
        model="other", units=4, allowed_gpus=[1], holder=Holder.current(job_id="78"), timeout_s=1
    )
    reg = InstanceRegistry(cfg.paths.instances)
    reg.put(
        InstanceRecord(
            id="77-1234",
            model="tiny",
            state="up",
            pid=os.getpid(),
            uid=0,
            job_id="77",
            device="cuda:0",
        )
    )
    from spswap.fsutil import atomic_write_json

    atomic_write_json(
        cfg.paths.run / "checkpoints" / "78.json",
        {
            "job_id": "78",
            "uid": os.getuid(),
            "state": "saved",
            "pid": 99,
            "size_bytes": 1631701505,
            "timings_s": {"criu_dump": 1.01},
            "kept": True,
        },
    )
    atomic_write_json(
        cfg.paths.run / "checkpoints" / "79.json",
        {
            "job_id": "79",
            "state": "rejected",
            "reason": "image job79-ab not "
            "restored: the image was made under another identity (torch: image "
            "'2.11.0', here '2.13.0')",
        },
    )
    reg.put(
        InstanceRecord(
            id="78-99",
            model="other",
            state="saved",
            pid=2**22 + 1,
            uid=0,
            job_id="78",
            device="cuda:1",
            reason="starts anew: image identity differs (driver 570 != 580)",
        )
    )
    return cfg


GPUS = [
    {"index": 0, "name": "Fake H200", "memory_total_bytes": 150_000_000_000, "source": "test"},
    {"index": 1, "name": "Fake H200", "memory_total_bytes": 150_000_000_000, "source": "test"},
]


def test_status_json_golden(node: Config):
    data = _normalize(collect_status(node, gpus=GPUS))
    _check_golden("status.json", json.dumps(data, indent=2, sort_keys=True) + "\n")


def test_status_table_golden(node: Config, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    data = _normalize(collect_status(node, gpus=GPUS))
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None, legacy_windows=False).print(
        render_status(data, now=FIXED_T + 90)
    )
    _check_golden("status.txt", buf.getvalue())


def test_status_cli_json_has_every_section(node: Config):
    res = CliRunner().invoke(
        app, ["status", "--json", "--root", str(node.root)], env={"SPSWAP_GPUS": "0,1"}
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert set(data) == {
        "version",
        "spswap",
        "root",
        "daemon",
        "gpus",
        "slots",
        "pool",
        "instances",
        "checkpoints",
        "images",
        "settings",
    }
    assert [c["state"] for c in data["checkpoints"]] == ["saved", "rejected"]
    assert [g["index"] for g in data["gpus"]] == [0, 1]
    assert len(data["slots"]["reservations"]) == 2
    assert data["pool"]["entries"][0]["name"] == "tiny"


def test_a_long_note_is_cut_in_the_table_only() -> None:
    from spswap.status import NOTE_CHARS, short_note

    assert short_note("short") == "short"
    long = "no room for job 806's image: " + "x" * 400
    cut = short_note(long)
    assert cut.startswith("no room for job 806's image: ") and cut.endswith("… (whole in --json)")
    assert len(cut) <= NOTE_CHARS + len(" (whole in --json)")


def test_the_pool_title_shows_the_share_root_or_yours() -> None:
    from spswap.status import pool_title

    pool = {"used_bytes": 3 << 30, "capacity_bytes": 16 << 30, "user_budget_bytes": 8 << 30,
            "yours_bytes": 1 << 30}  # fmt: skip
    assert pool_title(pool, 0) == "pool: 3.0 GiB of 16.0 GiB; each user's imports at most 8.0 GiB"
    assert pool_title(pool, 1000, " /dev/shm/spswap/pool") == (
        "pool /dev/shm/spswap/pool: 3.0 GiB of 16.0 GiB; yours 1.0 GiB of 8.0 GiB"
    )
    assert pool_title({"used_bytes": 0, "capacity_bytes": 1 << 30}, 1000) == "pool: 0 B of 1.0 GiB"


def test_a_gone_instance_after_its_checkpoint_says_where_its_job_stands() -> None:
    """A record whose process is gone after its checkpoint (a kept tree ended, an image
    deleted by `spswap images rm`) shows its job's checkpoint state beside its own."""
    from spswap.status import instance_state_text, render_instances

    gone = {"state": "checkpoint", "alive": False, "job_id": "533"}
    assert instance_state_text(gone, {"job_id": "533", "state": "deleted"}) == (
        "checkpoint; job's checkpoint deleted"
    )
    assert instance_state_text(gone, None) == "checkpoint"  # no status: as recorded
    assert instance_state_text({**gone, "alive": True}, {"state": "saved"}) == "checkpoint"
    assert instance_state_text({**gone, "state": "up"}, {"state": "deleted"}) == "up"
    row = {**gone, "id": "533-1", "model": "m", "engine": "reference", "device": "cpu",
           "pid": 1, "updated": 0.0}  # fmt: skip
    table = render_instances([row], now=10.0, checkpoints=[{"job_id": "533",
                                                           "state": "deleted"}])  # fmt: skip
    assert [str(c) for c in table.build(table.columns).columns[3]._cells] == [
        "checkpoint; job's checkpoint deleted"
    ]
    # a later run of the job (its image deleted, the run started anew, its dump failed):
    # the job's checkpoint is that run's, not the old record's (the walk saw "failed" there)
    later = {**row, "id": "533-2", "pid": 2, "updated": 5.0, "alive": True, "state": "up"}
    table = render_instances([row, later], now=10.0, checkpoints=[{"job_id": "533",
                                                                  "state": "failed"}])  # fmt: skip
    assert [str(c) for c in table.build(table.columns).columns[3]._cells] == [
        "checkpoint; replaced by 533-2",
        "up",
    ]
    assert instance_state_text(gone, {"state": "failed"}, "533-2") == (
        "checkpoint; replaced by 533-2"
    )
    # a parked multi-model run: its models' records share the run's pid, none replaced
    models = [{**row, "id": f"533-1-m{k}", "updated": float(k)} for k in range(3)]
    table = render_instances(models, now=10.0, checkpoints=[{"job_id": "533",
                                                            "state": "saved"}])  # fmt: skip
    assert [str(c) for c in table.build(table.columns).columns[3]._cells] == [
        "checkpoint; job's checkpoint saved"
    ] * 3


def test_a_saved_checkpoint_kept_alive_says_so_in_status_and_images_ls() -> None:
    from spswap.status import checkpoint_state_text

    assert checkpoint_state_text("saved", True) == "saved, kept alive"
    assert checkpoint_state_text("saved", False) == "saved"
    assert checkpoint_state_text("restored", True) == "restored"
    assert checkpoint_state_text("saved", True, True) == "saved, kept alive on its GPU"
    assert checkpoint_state_text("restored", True, True) == "restored"


def test_status_of_a_root_that_does_not_exist_makes_nothing_and_says_why(tmp_path: Path):
    """The walk: a mistyped `--root` (or SPSWAP_ROOT) gave an empty, plausible status, and
    status, a read, made the root's slot directory (a user's, where the daemon would come)."""
    root = tmp_path / "no" / "root"
    data = collect_status(Config.load({}, root=root), gpus=[{"index": 0}])
    assert not (tmp_path / "no").exists()
    assert data["slots"]["gpus"][0]["index"] == 0 and data["slots"]["reservations"] == []
    assert f"{root} does not exist: nothing of spswap has run on this node yet" in \
        data["settings"]["problems"][-1]  # fmt: skip


def test_long_notes_go_under_their_table_a_line_each() -> None:
    """The walk: at 80 columns a note column folded to a word a line (23 lines for one
    note); notes and reasons now follow their table, whole lines, as plain text."""
    from rich.console import Console

    from spswap.status import notes_text

    text = notes_text("notes", [("958-1", "starts anew: job 958 has no saved image"),
                                ("958-2", ""), ("959-1", "x [bold]y[/bold]")])  # fmt: skip
    assert text is not None and text.plain == (
        "notes:\n  958-1: starts anew: job 958 has no saved image\n  959-1: x [bold]y[/bold]"
    )
    assert notes_text("notes", [("958-2", "")]) is None
    console = Console(width=80, record=True)
    console.print(text)
    assert "959-1: x [bold]y[/bold]" in console.export_text()  # not read as markup


def test_the_pool_table_keeps_its_right_edge_at_80_columns() -> None:
    """A long title over narrow columns: the table fits the terminal, its title folded at
    a word (a fixed minimum width, or one on a column, cropped the right edge)."""
    import io

    from spswap.status import render_pool

    entry = {"name": "small", "digest": "940df1c24f55" * 5, "size_bytes": 84428800,
             "tensor_count": 40, "importers": [1001], "last_used": 1.0,
             "users": [{"pid": 5, "uid": 0, "purpose": "image", "for_job": "1271"}]}  # fmt: skip
    pool = {"used_bytes": 84428800, "capacity_bytes": 20 << 30, "user_budget_bytes": 10 << 30,
            "yours_bytes": 0, "entries": [entry]}  # fmt: skip
    for width in (80, 140):
        console = Console(width=width, file=io.StringIO(), record=True)
        console.print(render_pool(pool, 100.0, " /dev/shm/spswap/pool"))
        lines = console.export_text().splitlines()
        table = [ln for ln in lines if ln[:1] in "┏┃┡│└"]
        assert table and all(ln.rstrip()[-1] in "┓┃┩│┘" for ln in table), "\n".join(lines)
        assert "940df1c24f55" in "\n".join(lines)  # the digest whole
        if width == 140:  # the title on one line where it fits
            assert lines[0].strip().endswith("each user's imports at most 10.0 GiB"), lines[0]


def test_the_instances_table_leaves_out_columns_rather_than_fold_words_at_80_columns() -> None:
    """The walk, at 80 columns: "1428-1875" / "3" and "checkpoin" / "t" over two lines;
    now device, engine and pid go (named under the table), every word whole. Wide, all."""
    import io

    from spswap.status import render_instances

    gone = {
        "id": "1428-18753",
        "model": "small",
        "engine": "reference",
        "state": "checkpoint",
        "device": "cpu",
        "job_id": "1428",
        "pid": 18753,
        "alive": False,
        "updated": 20.0,
    }
    multi = {**gone, "id": "1430-19999", "model": "m1+m2+m3", "engine": "multi-reference",
             "state": "serving", "device": "cuda:0", "job_id": "1430", "pid": 19999,
             "alive": True}  # fmt: skip
    table = render_instances([gone, multi], now=200.0,
                             checkpoints=[{"job_id": "1428", "state": "saved"}])  # fmt: skip
    for width in (80, 140):
        console = Console(width=width, file=io.StringIO(), record=True)
        console.print(table)
        text = console.export_text()
        words = ("1428-18753", "1430-19999", "checkpoint;", "m1+m2+m3", "3 min ago")
        assert all(w in text for w in words), text
        narrow = "engine, device, pid: left out at this width (spswap status --json has them)"
        assert (narrow in text) is (width == 80), text
        assert ("multi-reference" in text) is (width == 140), text


def test_the_pool_table_names_importers_and_status_says_when_no_checkpoint_is_left() -> None:
    """The walk: "imported by" showed "uid 1001" where the node knows the name; with no
    checkpoint left, status printed nothing of checkpoints (as "instances: none" does)."""
    from spswap.status import render_pool, render_status

    unknown = 3_999_999_999  # in no user database
    entry = {"name": "small", "digest": "940df1c24f55" * 5, "size_bytes": 1 << 20,
             "tensor_count": 4, "importers": [0, unknown], "last_used": 1.0,
             "users": [{"pid": 5, "uid": 0, "job_id": "7"}]}  # fmt: skip
    pool = {"used_bytes": 1 << 20, "capacity_bytes": 1 << 30, "user_budget_bytes": 1 << 29,
            "yours_bytes": 0, "entries": [entry]}  # fmt: skip
    console = Console(width=140, file=io.StringIO(), record=True)
    console.print(render_pool(pool, 100.0))
    row = next(ln for ln in console.export_text().splitlines() if "small" in ln)
    cells = [c.strip() for c in row.split("│")]
    assert f"root, uid {unknown}" in cells and "job 7 (root)" in cells, row
    data = {"spswap": "0", "root": "/r", "daemon": {"running": False}, "gpus": [],
            "pool": pool, "instances": [], "checkpoints": []}  # fmt: skip
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(render_status(data, now=100.0))
    text = console.export_text()
    assert "instances: none" in text
    assert "checkpoints: none (a preempted job's checkpoint shows here)" in text, text


def test_the_keep_budget_is_said_both_ways() -> None:
    """A walk changed SPSWAP_KEEP_BYTES and found it in `spswap doctor` only."""
    from spswap.status import kept_text

    assert kept_text(2 << 30) == "up to 2.0 GiB of dumped instances (SPSWAP_KEEP_BYTES)"
    assert kept_text(0) == ("none: dumped instances come back from their images "
                            "(SPSWAP_KEEP_BYTES=0)")  # fmt: skip
    assert kept_text(2 << 30, set_by_site=False) == (
        "up to 2.0 GiB of dumped instances (SPSWAP_KEEP_BYTES unset: 1/8 of RAM)"
    )
    assert kept_text(0, set_by_site=False) == (  # a review: it said "=0", never set
        "none: this node's memory size could not be read for the default (1/8 of RAM): set "
        "SPSWAP_KEEP_BYTES"
    )


def test_the_kept_alive_line_is_the_running_daemons_budget(monkeypatch) -> None:
    """A walk edited SPSWAP_KEEP_BYTES and, before restarting spswapd, read this shell's
    1 GiB in the line while spswapd kept its default: the line is the daemon's now (the
    difference is listed under settings)."""
    from spswap.daemon import lifecycle
    from tests.uids import node_root

    if os.geteuid() != 0:
        pytest.skip("spswapd's tree is root's")
    for name in [k for k in os.environ if k.startswith("SPSWAP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPSWAP_GPUS", "0")
    monkeypatch.setenv("SPSWAP_KEEP_BYTES", str(3 << 30))  # the daemon's (it inherits it)
    monkeypatch.setenv("SPSWAP_DEFAULTS", "/nonexistent")
    with node_root("spsst-", {"SPSWAP_GPUS": "0", "SPSWAP_KEEP_BYTES": str(3 << 30)}) as cfg:
        lifecycle.start(cfg, wait_s=15.0)
        edited = Config.from_env({"SPSWAP_GPUS": "0", "SPSWAP_KEEP_BYTES": str(1 << 30)},
                                 root=cfg.root)  # fmt: skip
        data = collect_status(edited, gpus=GPUS[:1])
        assert (data["images"]["keep_budget_bytes"], data["images"]["keep_bytes_set"]) == \
            (3 << 30, True)  # fmt: skip
        assert any("SPSWAP_KEEP_BYTES" in d for d in data["settings"]["differs"])
    data = collect_status(edited, gpus=GPUS[:1])  # no daemon now: this shell's
    assert data["images"]["keep_budget_bytes"] == 1 << 30
