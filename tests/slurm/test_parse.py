# ruff: noqa: E501  (tables of real outputs read best one row per line)
"""Parsers against outputs captured from a real Slurm 22.05 (tests/fixtures/slurm/)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spswap.slurm.parse import (
    JobInfo,
    job_info_from_scontrol,
    parse_gpu_indexes,
    parse_node_gres,
    parse_scontrol_show_job,
    parse_scontrol_show_jobs,
    parse_slurm_time,
    parse_squeue_json,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "slurm"


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("scontrol_show_job_running.txt",
         ("1", "RUNNING", 0, 0, "debug", None, (0,), "keep me, a=b")),
        ("scontrol_show_job_pending.txt", ("2", "PENDING", 0, 0, "debug", "Resources", (), None)),
        ("scontrol_show_job_requeued_pending.txt",
         ("3", "PENDING", 1, 0, "low", "BeginTime", (), "model:qwen")),
        ("scontrol_show_job_restarted.txt", ("3", "RUNNING", 1, 0, "low", None, (0,), "model:qwen")),
        ("scontrol_show_job_cancelled.txt", ("3", "CANCELLED", 1, 0, "low", None, (), "model:qwen")),
        ("scontrol_show_job_failed.txt", ("4", "FAILED", 0, 0, "debug", "NonZeroExitCode", (), None)),
        ("scontrol_show_job_two_gpus_odd_text.txt", ("5", "RUNNING", 0, 0, "high", None, (0, 1), "a  b")),
        ("scontrol_show_job_multiline_forged_name.txt",
         ("8", "RUNNING", 0, 0, "debug", None, (0,), "hi there Restarts=9 UserId=x(5)")),
        ("scontrol_show_job_multiline_pending.txt", ("9", "PENDING", 0, 0, "debug", "Resources", (), None)),
        ("scontrol_show_job_multiline_cancelled.txt",
         ("8", "CANCELLED", 0, 0, "debug", None, (), "hi there Restarts=9 UserId=x(5)")),
    ],
)  # fmt: skip
def test_job_info_from_scontrol(fixture: str, expected: tuple[object, ...]) -> None:
    info = job_info_from_scontrol(_text(fixture))
    got = (info.job_id, info.state, info.restart_count, info.uid, info.partition, info.reason,
           info.gpus, info.comment)  # fmt: skip
    assert got == expected


@pytest.mark.parametrize(
    ("fixture", "key", "value"),
    [
        ("scontrol_show_job_running.txt", "JobName", "env job"),
        ("scontrol_show_job_running.txt", "TRES", "cpu=1,node=1,billing=1"),
        ("scontrol_show_job_running.txt", "AllocNode:Sid", "localhost:3482"),
        ("scontrol_show_job_running.txt", "ReqB:S:C:T", "0:0:*:*"),
        ("scontrol_show_job_running.txt", "Power", ""),
        ("scontrol_show_job_running.txt", "StdOut", "/tmp/envjob.out"),
        ("scontrol_show_job_running.txt", "TresPerNode", "gres:gpu:1"),
        ("scontrol_show_job_two_gpus_odd_text.txt", "JobState", "RUNNING"),
        # one-line layout: a field name inside a free-text value ends it (documented limit)
        ("scontrol_show_job_two_gpus_odd_text.txt", "JobName", "odd name=x"),
        ("scontrol_show_job_multiline_forged_name.txt", "JobName", "x JobState=COMPLETED Restarts=7"),
        ("scontrol_show_job_multiline_forged_name.txt", "Restarts", "0"),
        ("scontrol_show_job_multiline_forged_name.txt", "JobState", "RUNNING"),
        ("scontrol_show_job_multiline_forged_name.txt", "WorkDir", "/tmp"),
        ("scontrol_show_job_multiline_forged_name.txt", "Reason", "None"),
    ],
)  # fmt: skip
def test_fields(fixture: str, key: str, value: str) -> None:
    assert parse_scontrol_show_job(_text(fixture))[key] == value


def test_job_info_says_where_the_job_writes_its_log() -> None:
    # (`spswap ask --job N` of a job that ended without serving points at it)
    assert job_info_from_scontrol(_text("scontrol_show_job_running.txt")).std_out == \
        "/tmp/envjob.out"  # fmt: skip


def test_one_line_layout_can_be_forged_by_a_job_name_multi_line_cannot() -> None:
    # same job (id 8, named "x JobState=COMPLETED Restarts=7"), both layouts
    one_line = parse_scontrol_show_job(_text("scontrol_show_job_oneline_forged_name.txt"))
    multi = parse_scontrol_show_job(_text("scontrol_show_job_multiline_forged_name.txt"))
    assert multi["JobState"] == "RUNNING"
    assert one_line["JobState"] == "COMPLETED"  # why the backend reads the multi-line layout


def test_all_jobs_multiline() -> None:
    jobs = parse_scontrol_show_jobs(_text("scontrol_show_job_multiline_all.txt"))
    assert [job["JobId"] for job in jobs] == [str(i) for i in range(1, 10)]
    assert jobs[7]["JobName"] == "x JobState=COMPLETED Restarts=7"


def test_all_jobs_one_line() -> None:
    text = _text("scontrol_show_job_running.txt") + _text("scontrol_show_job_pending.txt")
    assert [job["JobId"] for job in parse_scontrol_show_jobs(text)] == ["1", "2"]


@pytest.mark.parametrize(
    "text",
    ["", "slurm_load_jobs error: Invalid job id specified", "NodeName=vm Arch=x86_64",
     "JobId=1 JobName=a\nJobId=2 JobName=b"],
)  # fmt: skip
def test_scontrol_rejects_other_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_scontrol_show_job(text)


@pytest.mark.parametrize(
    ("gres", "expected"),
    [
        ("gpu:1(IDX:0)", (0,)),
        ("gpu:2(IDX:0-1)", (0, 1)),
        ("gpu:a100:3(IDX:0,2-3)", (0, 2, 3)),
        ("gpu:h200:1(IDX:7),shard:2(0/4)", (7,)),
        ("shard:2(0/4)", ()),
        ("gpu:1(IDX:N/A)", ()),
        ("", ()),
    ],
)
def test_parse_gpu_indexes(gres: str, expected: tuple[int, ...]) -> None:
    assert parse_gpu_indexes(gres) == expected


def test_parse_node_gres_multi_node() -> None:
    text = ("JobId=1 JobName=a\n   JOB_GRES=gpu:3\n     Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)\n"
            "     Nodes=n2 CPU_IDs=0-1 Mem=10 GRES=gpu:1(IDX:3)\n")  # fmt: skip
    assert parse_node_gres(text) == {"n1": (0, 1), "n2": (3,)}
    assert job_info_from_scontrol(text).gpus == (0, 1, 3)


@pytest.mark.parametrize(
    ("fixture", "job_id", "expected"),
    [
        ("squeue_running_pending.json", None,
         [("1", "RUNNING", 0, (0,)), ("2", "PENDING", 0, ())]),
        ("squeue_running_pending.json", "2", [("2", "PENDING", 0, ())]),
        ("squeue_requeued.json", "3", [("3", "PENDING", 1, ())]),
        ("squeue_after_end.json", "4", [("4", "FAILED", 0, ())]),
        ("squeue_after_end.json", "99", []),
        ("squeue_two_gpus.json", "5", [("5", "RUNNING", 0, (0, 1))]),
    ],
)  # fmt: skip
def test_parse_squeue_json(
    fixture: str, job_id: str | None, expected: list[tuple[object, ...]]
) -> None:
    jobs = parse_squeue_json(_text(fixture), job_id)
    assert [(j.job_id, j.state, j.restart_count, j.gpus) for j in jobs] == expected
    assert all(j.uid == 0 for j in jobs)


def test_squeue_json_fields() -> None:
    (job,) = parse_squeue_json(_text("squeue_running_pending.json"), "1")
    assert job == JobInfo(
        job_id="1", state="RUNNING", restart_count=0, uid=0, partition="debug", reason=None,
        gpus=(0,), gpus_by_node={"vm": (0,)}, comment="keep me, a=b", nodes="vm", requeue=True,
        eligible_s=1795940625.0,
    )  # fmt: skip
    assert job.allocated


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[]", '{"jobs": 3}', '{"errors": [{"error": "x"}], "jobs": []}'],
)
def test_squeue_json_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_squeue_json(text)


def test_squeue_json_later_state_list() -> None:
    text = '{"jobs": [{"job_id": 9, "job_state": ["RUNNING", "REQUEUED"], "restart_cnt": 2}]}'
    (job,) = parse_squeue_json(text)
    assert (job.state, job.restart_count, job.uid) == ("RUNNING", 2, None)


@pytest.mark.parametrize(
    ("state", "allocated"),
    [("RUNNING", True), ("COMPLETING", True), ("SUSPENDED", True), ("CONFIGURING", True),
     ("PENDING", False), ("COMPLETED", False), ("CANCELLED", False), ("FAILED", False),
     ("PREEMPTED", False), ("NODE_FAIL", False), ("TIMEOUT", False), ("OUT_OF_MEMORY", False)],
)  # fmt: skip
def test_allocated_states(state: str, allocated: bool) -> None:
    assert JobInfo(job_id="1", state=state).allocated is allocated


@pytest.mark.parametrize(
    ("text", "names"),
    [("vm", ["vm"]), ("n[1-3]", ["n1", "n2", "n3"]), ("n[01-03,7],gpu1", ["n01", "n02", "n03", "n7", "gpu1"]),
     ("n[8-10]", ["n8", "n9", "n10"]), ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
     ("rack1-n[2]", ["rack1-n2"]), ("", [])],
)  # fmt: skip
def test_expand_hostlist(text: str, names: list[str]) -> None:
    from spswap.slurm.parse import expand_hostlist

    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-3", "n1-3]", "n[a-b]", "n[[1]]", "n[1-]x", "n[3-1]"])
def test_expand_hostlist_rejects(text: str) -> None:
    from spswap.slurm.parse import expand_hostlist

    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_runs_elsewhere_only_when_slurm_says_so() -> None:
    job = JobInfo(job_id="7", state="RUNNING", nodes="gpu[01-02]")
    assert not job.runs_elsewhere({"gpu02"}) and job.runs_elsewhere({"gpu03"})
    assert not job.runs_elsewhere({"gpu03", "gpu01"})  # one host, several slurmd
    assert not job.runs_elsewhere(set())  # this node's name not known
    assert not JobInfo(job_id="7", state="RUNNING").runs_elsewhere({"gpu03"})  # no list
    assert not JobInfo(job_id="7", state="PENDING", nodes="gpu01").runs_elsewhere({"gpu03"})
    assert not JobInfo(job_id="7", state="COMPLETING", nodes="gpu03").runs_elsewhere({"gpu03"})
    assert not JobInfo(job_id="7", state="RUNNING", nodes="gpu[0").runs_elsewhere({"gpu03"})
    running = job_info_from_scontrol(_text("scontrol_show_job_running.txt"))
    assert running.nodes and not running.runs_elsewhere({running.nodes})
    (queued,) = parse_squeue_json(_text("squeue_running_pending.json"), "1")
    assert queued.nodes == "vm"


@pytest.mark.parametrize(("state", "for_good"), [
    ("CANCELLED", True), ("TIMEOUT", True), ("FAILED", True), ("COMPLETED", True),
    ("PREEMPTED", False),  # PreemptMode=REQUEUE brings it back: dump
    ("REQUEUED", False), ("PENDING", False), ("RUNNING", False), ("COMPLETING", False),
    (None, False), ("", False), ("cancelled by 0", True),
])  # fmt: skip
def test_stopped_for_good(state: str | None, for_good: bool) -> None:
    from spswap.slurm.parse import stopped_for_good

    assert stopped_for_good(state) is for_good


def test_a_completing_job_is_gone_unless_its_restart_count_went_up() -> None:
    """While Slurm 22.05 kills a job it shows COMPLETING for scancel and requeue alike;
    a requeue raises Restarts at once (seen: Restarts=1 during the requeue's kill)."""
    from spswap.slurm.parse import stopped_for_good

    assert stopped_for_good("COMPLETING", 0, 0) is True  # scancel
    assert stopped_for_good("COMPLETING", 1, 0) is False  # scontrol requeue
    assert stopped_for_good("COMPLETING", None, 0) is False  # not known: dump


# -- requeueable or not (issue 15 item 8) ----------------------------------------------------


def test_requeue_flag_from_scontrol_and_squeue() -> None:
    from spswap.slurm.parse import parse_squeue_json

    text = _text("scontrol_show_job_cancelled.txt")
    assert job_info_from_scontrol(text).requeue is True
    assert job_info_from_scontrol(text.replace("Requeue=1", "Requeue=0")).requeue is False
    assert job_info_from_scontrol(text.replace("Requeue=1", "")).requeue is None
    jobs = parse_squeue_json(_text("squeue_after_end.json"))
    assert jobs and all(j.requeue is True for j in jobs)


def test_requeue_warning_exact_text() -> None:
    from spswap.slurm.requeue import requeue_warning

    text = _text("scontrol_show_job_cancelled.txt")
    job = job_info_from_scontrol(text.replace("Requeue=1", "Requeue=0"))
    assert requeue_warning(job) == (
        f"spswap serve: warning: job {job.job_id} is not requeueable (Slurm shows Requeue=0: "
        "it was submitted with --no-requeue, or without --requeue where slurm.conf sets "
        "JobRequeue=0). At preemption Slurm ends it instead of requeueing it: spswap serve "
        "then saves nothing (no next run would use it) and the job's work is lost. Submit it "
        "with `sbatch --requeue` (#SBATCH --requeue, as the templates do)."
    )
    assert requeue_warning(job_info_from_scontrol(text)) is None
    assert requeue_warning(job_info_from_scontrol(text.replace("Requeue=1", ""))) is None
    assert requeue_warning(None) is None


def test_a_requeue_refused_for_requeue_0_names_the_flag() -> None:
    from spswap.slurm.requeue import requeue_refusal

    out = "Requested operation is presently disabled for job 202\n"
    assert requeue_refusal("202", out) == (
        "Slurm may not requeue job 202 (it answers 'Requested operation is presently "
        "disabled': the job shows Requeue=0, submitted with --no-requeue or without "
        "--requeue where slurm.conf sets JobRequeue=0); submit it with `sbatch --requeue`"
    )
    assert requeue_refusal("202", "Invalid job id specified") is None


def test_a_requeued_job_may_start_again_cred_expire_plus_1_s_after_its_requeue() -> None:
    info = job_info_from_scontrol(_text("scontrol_show_job_requeued_pending.txt"))
    requeued_s = parse_slurm_time("2026-11-29T08:23:59")  # its SubmitTime: the requeue
    assert info.eligible_s is not None and requeued_s is not None
    assert info.eligible_s - requeued_s == 6  # that Slurm's AuthInfo=cred_expire=5, + 1
    (job,) = parse_squeue_json(_text("squeue_requeued.json"), "3")
    assert job.eligible_s == 1795940645.0  # (submit_time 1795940639: 6 s before)
    assert job_info_from_scontrol(_text("scontrol_show_job_pending.txt")).eligible_s == \
        parse_slurm_time("2026-11-29T08:23:45")  # fmt: skip


@pytest.mark.parametrize("text", ["Unknown", "None", "N/A", "", None, "2026-13-01T00:00:00"])
def test_slurm_time_that_is_no_time(text: str | None) -> None:
    assert parse_slurm_time(text) is None


def test_slurm_time_is_this_machine_s_local_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert parse_slurm_time("2026-12-04T02:33:28") == 1796351608.0
    finally:
        monkeypatch.undo()
        time.tzset()


def test_later_squeue_json_times() -> None:
    text = ('{"jobs": [{"job_id": 9, "job_state": "PENDING", '
            '"eligible_time": {"set": true, "infinite": false, "number": 1796351608}}, '
            '{"job_id": 10, "job_state": "PENDING", "eligible_time": {"set": false, "number": 0}}, '
            '{"job_id": 11, "job_state": "PENDING", "eligible_time": 0}]}')  # fmt: skip
    assert [j.eligible_s for j in parse_squeue_json(text)] == [1796351608.0, None, None]


def test_a_requeued_runs_note_says_slurms_cancelled_line_is_the_requeue() -> None:
    from spswap.slurm.requeue import requeued_note

    assert requeued_note("88", 0) is None
    assert requeued_note("88", 2) == (
        "spswap serve: job 88 run 2: Slurm requeued the job (its 'CANCELLED ... DUE TO JOB "
        "REQUEUE' line above is the requeue, not a failure)")  # fmt: skip
