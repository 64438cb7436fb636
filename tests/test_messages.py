"""Messages that misled (issue 15, item 16), each checked on its exact text; the ones a
second uid sees are in tests/security/test_user_messages.py."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from spswap import doctor_node
from spswap.cli.events import event_line, events_table, short_value
from spswap.config import Config
from spswap.slots.request import timeout_error
from spswap.slots.state import SlotRequest
from spswap.status import render_status

CRIU_REASON = "\n".join(
    ["criu dump of job 12 failed (exit 1): see the log for the reason",
     "last lines of /dev/shm/spswap/log/criu/dump-12.log:",
     "(00.002) Error (criu/cr-dump.c:1210): Can't get rlimit 0: Operation not permitted",
     "(00.002) Error (criu/cr-dump.c:1800): Dump core (pid: 4242) failed with -1",
     "..."] + [f"(00.{i:03d}) Unfreezing tasks into 1" for i in range(25)]
    + ["(00.031) Error (criu/cr-dump.c:2100): Dumping FAILED."]
)  # fmt: skip


def test_slot_timeout_names_the_flags_of_both_commands() -> None:
    err = timeout_error(SlotRequest(4, None, [0]), "m", 5.0, [], [])
    assert str(err) == (
        "no slot for model m (4 unit(s) on GPU 0) after 5 s.\n"
        "wait longer (`spswap serve --slot-timeout-s`, `spswap slots reserve --timeout-s`) "
        "or release a reservation no process of yours needs any more (`spswap slots release "
        "ID`; a running server's is its own)"
    )
    assert SlotRequest(1, None, (0, 1)).describe() == "1 unit(s) on one of GPUs 0,1"
    assert SlotRequest(4, 2, (0, 1, 2)).describe() == "2 whole GPU(s) of GPUs 0,1,2"


def test_doctor_does_not_call_a_missing_root_ok(tmp_path: Path) -> None:
    cfg = Config.from_env({}, root=tmp_path / "nothing")
    got = doctor_node.root_ownership(cfg)
    assert (got["ok"], got["value"]) == (None, f"{tmp_path / 'nothing'} does not exist yet")
    assert got["detail"].startswith("spswapd makes it at its first start (the Slurm prolog")
    (tmp_path / "nothing").mkdir(mode=0o755)
    got = doctor_node.root_ownership(cfg)
    assert got["ok"] is True and "root's, not writable by others" in got["value"]


def test_a_failed_checkpoints_reason_is_cut_to_its_first_error_lines() -> None:
    assert short_value(CRIU_REASON) == (
        "criu dump of job 12 failed (exit 1): see the log for the reason\n"
        "(00.002) Error (criu/cr-dump.c:1210): Can't get rlimit 0: Operation not permitted\n"
        "(00.002) Error (criu/cr-dump.c:1800): Dump core (pid: 4242) failed with -1\n"
        "(+28 more lines: spswap events --json)"
    )
    assert short_value("one line") == "one line" and short_value(42) == "42"
    event = {"ts": 0, "kind": "checkpoint.failed", "job_id": "12", "uid": 1001,
             "detail": {"reason": CRIU_REASON}}  # fmt: skip
    console = Console(width=200, record=True)
    console.print(events_table([event]))
    rows = [ln for ln in console.export_text().splitlines() if ln.startswith("│")]
    assert len(rows) == 4  # 4 lines, not ~30
    assert event_line(event).endswith(
        "reason=criu dump of job 12 failed (exit 1): see the log for the reason | (00.002) "
        "Error (criu/cr-dump.c:1210): Can't get rlimit 0: Operation not permitted | (00.002) "
        "Error (criu/cr-dump.c:1800): Dump core (pid: 4242) failed with -1 | (+28 more "
        "lines: spswap events --json)")  # fmt: skip


def test_status_of_a_daemon_whose_pid_is_not_shown() -> None:
    data = {"spswap": "0", "root": "/r", "daemon": {"running": True, "pid": None},
            "gpus": [], "pool": {"capacity_bytes": 0, "used_bytes": 0, "entries": []},
            "instances": [], "checkpoints": []}  # fmt: skip
    console = Console(width=120, record=True)
    console.print(render_status(data, now=0.0))
    text = console.export_text()
    assert "pid -1" not in text and "pid None" not in text
    assert "instances: none (a running `spswap serve` shows here)" in text  # not an empty box
    assert next(ln for ln in text.splitlines() if ln.startswith("daemon")).split() == [
        "daemon",
        "running",
    ]


def _help(*args: str) -> str:
    from typer.testing import CliRunner

    from spswap.cli.app import app

    r = CliRunner().invoke(app, [*args, "--help"], prog_name="spswap", env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    return r.stdout


def test_help_names_arguments_in_capitals_and_flags_without_a_type() -> None:
    serve = _help("serve")
    assert "Usage: spswap serve [OPTIONS] MODEL" in serve
    assert "<bool>" not in serve and "{model}" not in serve
    assert "Usage: spswap ask [OPTIONS] [PROMPT_IDS]" in _help("ask")  # optional: --id alone
    assert "Usage: spswap pool rm [OPTIONS] REF" in _help("pool", "rm")
    assert "Usage: spswap pool [OPTIONS] COMMAND [ARGS]..." in _help("pool")
    assert "<int>" in _help("slots", "reserve")  # options that take a value keep their type
    for args in (("status",), ("models", "make"), ("pool", "import"), ()):
        text = _help(*args)
        assert "<bool>" not in text and "{" not in text.split("\n", 3)[1], args


def test_cli_reference_marks_required_options() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    ask = text.split("## `spswap ask`", 1)[1].split("\n#", 1)[0]
    # ask takes one of --socket, --job, --state-dir: none of them is required alone
    assert "- `--socket`: The socket `spswap serve` listens on" in ask and "- `--job`:" in ask
    reserve = text.split("### `spswap slots reserve`", 1)[1].split("\n#", 1)[0]
    assert "- `--model` (required): Model the reservation is for (shown to others)." in reserve


def test_a_saved_images_report_is_one_short_line_in_the_events_table() -> None:
    """checkpoint.saved carries the whole image report (every timing): the table shows its
    plain fields and says where the rest is."""
    image = {"key": "job7-m", "path": "/dev/shm/spswap/images/job7-m", "size_bytes": 2_300_000_000,
             "cuda_pids": [11, 12], "timings_s": {f"step{i}": 0.1 for i in range(20)},
             "kept": False}  # fmt: skip
    event = {"ts": 0, "kind": "checkpoint.saved", "job_id": "7", "uid": 1001,
             "detail": {"image": image, "pids": list(range(10))}}  # fmt: skip
    assert event_line(event).endswith(
        "image={kept=False key=job7-m path=/dev/shm/spswap/images/job7-m size=2.1 GiB "
        "(+2 more: spswap events --json)} pids=[0,1,2,3,4,5,...] (+4 more)")  # fmt: skip


def test_the_events_table_wraps_a_long_detail_instead_of_cutting_it() -> None:
    """Piped, rich prints 80 columns: a detail was cut with an ellipsis (a cgroup path, a
    socket path); now it wraps, and seconds are shown to 4 digits."""
    path = "/sys/fs/cgroup/freezer/spswap-parked-b11caf3f-6-13484"
    event = {"ts": 0, "kind": "restore.done", "job_id": "6", "uid": 1001,
             "detail": {"cgroups": [path],
                        "timings_s": {"thaw": 0.0003939660000469303}}}  # fmt: skip
    console = Console(width=80, record=True)
    console.print(events_table([event]))
    cells = "".join(ln.split("│")[-2].strip() for ln in console.export_text().splitlines()
                    if ln.startswith("│"))  # fmt: skip
    assert "…" not in cells and f"cgroups=[{path}]" in cells and "timings_s={thaw=0.000394}" \
        in cells, cells  # fmt: skip


def test_the_events_table_fits_a_digest_and_lists_in_80_columns() -> None:
    """In an 80-column terminal a pool digest (64 hex) broke over four lines and lists
    showed Python's quotes: a digest is shown as `spswap pool ls` shows it (12 characters),
    lists as their plain items, and the table's time has no year."""
    digest = "95539f5c9038bb27f111e15ae657d0b77399f5aa54c85687b12a605d0769a972"
    event = {"ts": 0, "kind": "pool.import", "job_id": "3", "uid": 1001,
             "detail": {"digest": digest, "name": "vllm-qwen2-0.5b", "pid": 1576}}  # fmt: skip
    dropped = {"ts": 0, "kind": "job.end", "job_id": "3", "uid": 1001,
               "detail": {"dropped_pool_uses": [digest], "fate": "back"}}  # fmt: skip
    console = Console(width=80, record=True)
    console.print(events_table([event, dropped]))
    rows = [ln for ln in console.export_text().splitlines() if ln.startswith("│")]
    # wrapped between whole key=value pairs only, none broken
    assert " ".join(ln.split("│")[-2].strip() for ln in rows) == (
        "digest=95539f5c9038 name=vllm-qwen2-0.5b pid=1576 "
        "dropped_pool_uses=[95539f5c9038] fate=back")  # fmt: skip
    assert rows[0].split("│")[1].strip() == time.strftime("%m-%d %H:%M:%S", time.localtime(0))
    assert event_line(dropped).endswith("dropped_pool_uses=[95539f5c9038] fate=back")
    assert (
        short_value({"model_digest": digest, "kept": True})
        == "{kept=True model_digest=95539f5c9038}"
    )


def test_images_ls_on_a_node_without_images_says_so(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from spswap.cli.app import app

    root = tmp_path / "root"
    (root / "images").mkdir(parents=True)
    r = CliRunner().invoke(app, ["images", "ls", "--root", str(root)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert r.stdout == (
        f"no checkpoint images in {root / 'images'} (a restore uses its image up; "
        "`spswap status` shows where each job's checkpoint stands)\n"
    )


def test_images_ls_says_what_images_hold_of_their_budget(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from spswap.cli.app import app

    root = tmp_path / "root"
    image = root / "images" / "job7-model-config-ident"
    image.mkdir(parents=True)
    (image / "pages-1.img").write_bytes(b"x" * (3 << 20))
    (image / "meta.json").write_text(json.dumps({"identity": {"uid": 0}, "created_at": 1.0}))
    env = {"COLUMNS": "200", "SPSWAP_IMAGES_BYTES": "1G", "SPSWAP_IMAGES_USER_BYTES": "256M"}
    r = CliRunner().invoke(app, ["images", "ls", "--root", str(root)], env=env)
    assert r.exit_code == 0, r.output
    assert "3.0 MiB of the images' budget 1.0 GiB (SPSWAP_IMAGES_BYTES); one user's up to " \
        "256.0 MiB (SPSWAP_IMAGES_USER_BYTES)" in " ".join(r.stdout.split()), r.stdout  # fmt: skip
    assert "on disk" in r.stdout  # (`images show` gives the dumped bytes, a little less)
    assert "left out" not in r.stdout
    row = next(ln for ln in r.stdout.splitlines() if ln.lstrip("│ ").startswith("7 "))
    assert "root" in [c.strip() for c in row.split("│")], row  # its owner by name
    # a walk at 80 columns: "multi-referenc" / "e"; columns go instead, named under it
    r = CliRunner().invoke(app, ["images", "ls", "--root", str(root)], env={**env, "COLUMNS": "60"})
    assert "user: left out at this width (--json has them)" in " ".join(r.stdout.split())
    assert "256.0 MiB (SPSWAP_IMAGES_USER_BYTES)" in " ".join(r.stdout.split()), r.stdout
    r = CliRunner().invoke(app, ["images", "ls", "--json", "--root", str(root)], env=env)
    listed = json.loads(r.stdout)  # an object, as every other --json listing
    assert listed["used_bytes"] == listed["images"][0]["size_bytes"] >= 3 << 20  # + meta
    assert (listed["budget_bytes"], listed["user_budget_bytes"]) == (1 << 30, 256 << 20)
    assert [(i["job_id"], i["model"]) for i in listed["images"]] == [("7", None)]  # (no pool)


def test_events_piped_are_one_plain_line_each(tmp_path: Path) -> None:
    """Not a terminal (a pipe, a file): no 80-column table breaking values mid-word, one
    grep-able line per event, whole."""
    from typer.testing import CliRunner

    from spswap.cli.app import app
    from spswap.daemon import events as log

    root = tmp_path / "root"
    path = "/sys/fs/cgroup/freezer/spswap-parked-b11caf3f-88-15834"
    log.append(root / "log" / "events.jsonl", "checkpoint.parked", job_id="88", uid=1001,
               cgroups=[path], pids=[15834])  # fmt: skip
    log.append(root / "log" / "events.jsonl", "job.end", job_id="88", uid=1001, fate="back",
               released_reservations=[], state="requeued")  # fmt: skip
    r = CliRunner().invoke(app, ["events", "--root", str(root)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert [ln.split("  ", 1)[1] for ln in lines] == [
        f"checkpoint.parked job=88 uid=1001 cgroups=[{path}] pids=[15834]",
        "job.end        job=88 uid=1001 fate=back released_reservations=[] state=requeued",
    ]


def test_an_images_layout_event_shows_its_sizes_in_the_events_table() -> None:
    """checkpoint.layout: the dumped total and each kind the image holds, readable, largest
    first (the walk found only `shared=0 B` shown and the rest left to --json)."""
    kinds = {"anonymous": 114868224, "heap": 113713152, "file private": 6610944,
             "stack": 86016, "other": 8192, "shared": 0}  # fmt: skip
    layout = {
        "bytes_by_kind": kinds,
        "shared_bytes": 0,
        "processes": [{"pid": 5, "dumped_bytes": 235286528, "bytes_by_kind": kinds}],
    }
    event = {"ts": 0, "kind": "checkpoint.layout", "job_id": "727", "uid": 1001,
             "detail": {"key": "job727-m", "dumped_bytes": 235286528, "layout": layout,
                        "read_s": 0.0046}}  # fmt: skip
    assert event_line(event).endswith(
        "uid=1001 dumped=224.4 MiB key=job727-m layout={anonymous=109.5 MiB heap=108.4 MiB "
        "file_private=6.3 MiB stack=84.0 KiB other=8.0 KiB shared=0 B "
        "(+1 more: spswap events --json)} read_s=0.0046")  # fmt: skip
    kept = {"ts": 0, "kind": "checkpoint.kept", "job_id": "727", "uid": 1001,
            "detail": {"pid": 9, "size_bytes": 235278336}}  # fmt: skip
    assert event_line(kept).endswith("pid=9 size=224.4 MiB")
