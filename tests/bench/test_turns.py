"""The pure parts of `spswap bench turns`: the plan, one turn's shares, the summary, the
report, the job script, the Slurm argv, the spool asker, and the errors before any job."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from spswap.bench.turns import (
    TurnJob,
    TurnsOptions,
    TurnsRun,
    job_script,
    slurm_preflight,
    turns_serve_args,
)
from spswap.bench.turns_ask import SpoolAsker, completion_body, socket_of
from spswap.bench.turns_plan import PlannedTurn, TurnKind, measure_turn, plan_turns, summarize
from spswap.bench.turns_report import came_back_text, render_turns, turn_line, turn_table
from spswap.config import Config
from spswap.errors import ConfigError, SlurmCommandError, SpswapError
from spswap.serve.spool import Spool
from spswap.slurm.jobctl import (
    JobControl,
    cancel_argv,
    parse_job_id,
    release_argv,
    requeue_hold_argv,
    sbatch_argv,
)  # fmt: skip
from spswap.slurm.parse import JobInfo


def test_plan_is_cold_turns_then_rounds_each_displacing_the_one_before() -> None:
    plan = plan_turns(3, 2)
    assert [(t.round, t.model, t.displaced, t.kind.value) for t in plan] == [
        (0, 0, None, "cold"), (0, 1, 0, "cold"), (0, 2, 1, "cold"),
        (1, 0, 2, "restore"), (1, 1, 0, "restore"), (1, 2, 1, "restore"),
        (2, 0, 2, "restore"), (2, 1, 0, "restore"), (2, 2, 1, "restore"),
    ]  # fmt: skip
    assert [t.index for t in plan] == list(range(9))


@pytest.mark.parametrize("models,rounds,message", [
    (1, 3, "at least 2 models"), (3, 0, "--rounds must be at least 1"),
])  # fmt: skip
def test_plan_refuses_what_cannot_take_turns(models: int, rounds: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_turns(models, rounds)


def test_a_turn_splits_at_the_run_start() -> None:
    turn = PlannedTurn(index=4, round=1, model=1, displaced=0, kind=TurnKind.RESTORE)
    r = measure_turn(turn, "m1", action_s=100.0, run_started_s=101.25, answered_s=102.0,
                     path="kept", identical=True)  # fmt: skip
    assert (r.total_s, r.slurm_s, r.spswap_s, r.restored) == (2.0, 1.25, 0.75, True)
    # the start time has a 10 ms tick: a start "before" the action is Slurm's 0 s
    early = measure_turn(turn, "m1", action_s=100.0, run_started_s=99.995, answered_s=100.5,
                         path="image", identical=True)  # fmt: skip
    assert (early.slurm_s, early.spswap_s) == (0.0, 0.5)


def test_a_turn_s_requeue_wait_is_slurm_s_share_before_the_job_was_allowed_to_start() -> None:
    turn = PlannedTurn(index=7, round=1, model=3, displaced=2, kind=TurnKind.RESTORE)
    at = {"action_s": 100.0, "run_started_s": 101.9, "answered_s": 102.7, "path": "kept",
          "identical": True}  # fmt: skip
    assert measure_turn(turn, "m3", **at, eligible_s=101.0).requeue_wait_s == 1.0
    assert measure_turn(turn, "m3", **at, eligible_s=95.0).requeue_wait_s == 0.0  # before
    assert measure_turn(turn, "m3", **at, eligible_s=None).requeue_wait_s == 0.0  # not said
    assert measure_turn(turn, "m3", **at, eligible_s=103.0).requeue_wait_s == \
        pytest.approx(1.9)  # never more than Slurm's share  # fmt: skip


def _results(paths: list[str], same: list[bool]) -> list:
    plan = plan_turns(2, 2)
    out = []
    for turn, path, ok in zip(plan, paths, same, strict=True):
        total = 10.0 if turn.kind is TurnKind.COLD else 2.0
        out.append(measure_turn(turn, f"m{turn.model}", action_s=0.0, run_started_s=0.5,
                                answered_s=total, path=path, identical=ok))  # fmt: skip
    return out


def test_summary_counts_restored_identical_and_the_ratio() -> None:
    results = _results(["cold", "cold", "kept", "image", "kept", "kept"], [True] * 6)
    s = summarize(["m0", "m1"], results, wall_s=8.0, settings={"engine": "reference"})
    assert (s.cold.mean_s, s.restored.mean_s, s.speedup) == (10.0, 2.0, 5.0)
    assert (s.identical, s.compared, s.not_restored, s.ok) == (4, 4, 0, True)
    assert (s.device_s, s.dedicated_device_s) == (8.0, 16.0)
    assert s.per_model["m1"]["restored"].count == 2
    js = s.to_json()
    assert js["ok"] is True and js["turns"][2]["kind"] == "restore"
    assert js["turns"][2]["path"] == "kept"
    # a turn's JSON number is the table's (from 1; the walk: JSON counted from 0)
    assert [t["turn"] for t in js["turns"]] == [1, 2, 3, 4, 5, 6] and "index" not in js["turns"][0]


def test_summary_is_not_ok_for_a_differing_answer_a_cold_turn_or_a_leftover() -> None:
    differs = summarize(["m0", "m1"], _results(["cold"] * 2 + ["kept"] * 4,
                                               [True, True, True, False, True, True]),
                        wall_s=1.0)  # fmt: skip
    assert (differs.identical, differs.ok) == (3, False)
    pool = summarize(["m0", "m1"], _results(["cold"] * 2 + ["pool", "kept", "kept", "kept"],
                                            [True] * 6), wall_s=1.0)  # fmt: skip
    assert (pool.not_restored, pool.restored.count, pool.ok) == (1, 3, False)
    left = summarize(["m0", "m1"], _results(["cold"] * 2 + ["kept"] * 4, [True] * 6),
                     wall_s=1.0, leftovers=["GPU slot r3 of job 7"])  # fmt: skip
    assert left.ok is False
    # none restored: the paths that would have counted are said
    none = summarize(["m0", "m1"], _results(["cold"] * 2 + ["pool"] * 4, [True] * 6), wall_s=1.0)
    assert came_back_text(none) == "0 of 4 later turns came back kept or from the image"


def test_a_first_start_never_counts_a_requeue_wait() -> None:
    # a first start's job is released from its hold at the action; its EligibleTime (whole
    # seconds) read up to 0.25 s past it and the verdict counted "requeue delay" for jobs
    # never requeued (newcomer walk)
    cold, later = plan_turns(2, 1)[0], plan_turns(2, 1)[2]
    first = measure_turn(cold, "m0", action_s=100.0, run_started_s=101.0, answered_s=103.0,
                         path="cold", identical=True, eligible_s=100.25)  # fmt: skip
    assert first.requeue_wait_s == 0.0 and first.slurm_s == 1.0
    again = measure_turn(later, "m0", action_s=100.0, run_started_s=101.0, answered_s=102.0,
                         path="kept", identical=True, eligible_s=100.25)  # fmt: skip
    assert again.requeue_wait_s == 0.25


def test_report_names_every_turn_and_the_verdict() -> None:
    results = _results(["cold", "cold", "kept", "image", "kept", "pool"],
                       [True, True, True, True, False, True])  # fmt: skip
    results[4] = replace(results[4], requeue_wait_s=0.25)
    s = summarize(["m0", "m1"], results, wall_s=8.0)
    console = Console(width=200, record=True)
    console.print(render_turns(s))
    text = console.export_text()
    assert "reference" in text and "DIFFERS" in text and "image" in text
    assert (
        "NOT ok: 3 of 4 answers identical to cold, 3 of 4 later turns came back (2 kept, 1 "
        "from the image), after the cold starts the rounds held one device 8 s, against 16 "
        "device-seconds for 2 dedicated devices (one per model, held as long), "
        "1 turn(s) waited 0.25 s in "
        "all for Slurm's requeue delay (a requeued job may start again only "
        "AuthInfo=cred_expire + 1 s after its requeue: lower cred_expire, 5 at least, to "
        "shorten it; a preempted job that comes back after the preemptor's work does not "
        "wait)"
    ) in " ".join(text.split())  # (the verdict wraps)
    assert "wait: the part of Slurm's that was its requeue delay" in " ".join(text.split())
    (header,) = [line for line in text.splitlines() if "┃ turn ┃" in line]
    assert " wait " in header, text
    # no turn waited: no such column
    plain = Console(width=200, record=True)
    plain.print(turn_table(summarize(["m0", "m1"], _results(["cold"] * 2 + ["kept"] * 4,
                                                            [True] * 6), wall_s=1.0)))  # fmt: skip
    assert "wait" not in plain.export_text()


def test_at_80_columns_every_model_s_name_is_whole() -> None:
    # a pipe or a file gets 80 columns: "small-…" hid which model a turn was
    plan = plan_turns(2, 2)
    results = [measure_turn(t, f"small-s{t.model + 2}", action_s=0.0, run_started_s=0.5,
                            answered_s=2.0, path="cold" if t.kind is TurnKind.COLD else "kept",
                            identical=True, eligible_s=0.25) for t in plan]  # fmt: skip
    s = summarize(["small-s2", "small-s3"], results, wall_s=8.0,
                  settings={"work_dir": "/home/alice/spswap-turns-x", "rounds": 2})  # fmt: skip
    narrow = Console(width=80, record=True)
    narrow.print(render_turns(s))
    said = " ".join(narrow.export_text(clear=False).split())
    assert ("models, job scripts and logs: /home/alice/spswap-turns-x (remove it when done)"
            in said and "rounds=2" in said and "work_dir=" not in said)  # fmt: skip
    rows = [line for line in narrow.export_text().splitlines() if "small-s" in line]
    assert sum("small-s2" in r for r in rows) == 3 + 1  # its turns, then its stats row
    assert sum("small-s3" in r for r in rows) == 3 + 1
    assert not any("small-…" in r or "small-s…" in r for r in rows)


def test_at_80_columns_no_value_is_cut_and_a_reason_is_said_whole() -> None:
    # the stats table ran past 80 columns (its right edge cut, "restor/ed" split) and a
    # turn's reason in the path column squeezed every other column (newcomer walk)
    plan = plan_turns(2, 2)
    results = [measure_turn(t, f"small-s{t.model + 2}", action_s=0.0, run_started_s=0.5,
                            answered_s=2.0, path="cold" if t.kind is TurnKind.COLD else "image",
                            identical=True, eligible_s=0.25,
                            reason="image damaged: a page of pages-3.img differs from its "
                            "checksum" if t.index == 3 else None) for t in plan]  # fmt: skip
    narrow = Console(width=80, record=True)
    narrow.print(render_turns(summarize(["small-s2", "small-s3"], results, wall_s=8.0)))
    text = narrow.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines()), text
    cells = {cell.strip() for line in text.splitlines()
             for cell in line.replace("┃", "│").split("│")}  # fmt: skip
    assert {"turns", "faster", "1.0x", "reference", "identical", "wait"} <= cells, text
    assert ("turn 4 (small-s3, image): image damaged: a page of pages-3.img differs from its "
            "checksum") in " ".join(text.split()), text  # fmt: skip


def test_a_turn_s_log_line() -> None:
    turn = PlannedTurn(index=7, round=1, model=3, displaced=2, kind=TurnKind.RESTORE)
    r = measure_turn(turn, "qwen2-1.5b-s7", action_s=100.0, run_started_s=102.01,
                     answered_s=103.25, path="kept", identical=True, eligible_s=101.0)  # fmt: skip
    assert turn_line(r) == ("bench turns: turn 8 round 1 qwen2-1.5b-s7: kept 3.25 s (Slurm "
                            "2.01 of which requeue wait 1.00, spswap 1.24)")  # fmt: skip
    r = measure_turn(turn, "m1", action_s=100.0, run_started_s=101.0, answered_s=102.5,
                     path="image", identical=False)  # fmt: skip
    assert turn_line(r) == ("bench turns: turn 8 round 1 m1: image 2.50 s (Slurm 1.00, spswap "
                            "1.50) ANSWER DIFFERS")  # fmt: skip


def test_job_script_is_the_template_with_the_model_and_the_bench_options(tmp_path: Path) -> None:
    opts = TurnsOptions(models=(tmp_path / "m",), work_dir=tmp_path, partition="debug",
                        gpus=2, serve_args="--kv-cache-gib 4")  # fmt: skip
    script = job_script(opts, TurnJob(name="m", model=tmp_path / "m"), 0)
    assert ("#SBATCH --job-name=turns-0-m\n# CHANGE the next line: your site's partition "
            "whose jobs others may preempt\n#SBATCH --partition=debug\n#SBATCH --gres=gpu:2\n"
            ) in script  # fmt: skip
    assert "#SBATCH --requeue\n" in script
    assert (
        'spswap serve "$MODEL" --state-dir "$STATE" --units 4 --kv-cache-gib 4 --socket auto &'
    ) in script
    assert script.count("export PATH=") == 1 and f"MODEL={tmp_path / 'm'}" in script


def test_a_vllm_job_script_carries_the_bench_options_in_serve_args(tmp_path: Path) -> None:
    """vLLM's template takes `spswap serve`'s options on its SERVE_ARGS line: the bench's
    --no-eager there replaces the template's --eager (never both: the last would win)."""
    opts = TurnsOptions(models=(tmp_path / "m",), work_dir=tmp_path, engine="vllm",
                        serve_args=turns_serve_args("vllm", 4.0, eager=False))  # fmt: skip
    script = job_script(opts, TurnJob(name="m", model=tmp_path / "m"), 0)
    assert "\nSERVE_ARGS=(--units 4 --kv-cache-gib 4 --no-eager)   # CHANGE:" in script
    assert 'spswap serve "$MODEL" --state-dir "$STATE" "${SERVE_ARGS[@]}" --engine vllm' in script
    eager = TurnsOptions(models=(tmp_path / "m",), work_dir=tmp_path, engine="vllm")
    assert "\nSERVE_ARGS=(--units 4 --eager)   # CHANGE:" in job_script(
        eager, TurnJob(name="m", model=tmp_path / "m"), 0)  # fmt: skip


def test_serve_args_name_the_kv_cache_and_compiled_vllm_unless_eager() -> None:
    assert turns_serve_args("vllm", 4.0, eager=False) == "--kv-cache-gib 4 --no-eager"
    assert turns_serve_args("vllm", None, eager=True) == ""
    assert turns_serve_args("vllm", 0.5, eager=True) == "--kv-cache-gib 0.5"
    assert turns_serve_args("reference", None, eager=False) == ""


def test_slurm_argv_exactly(tmp_path: Path) -> None:
    assert sbatch_argv(tmp_path / "j.sbatch", chdir=tmp_path, hold=True) == [
        "sbatch",
        "--parsable",
        "--hold",
        f"--chdir={tmp_path}",
        str(tmp_path / "j.sbatch"),
    ]
    assert release_argv(["7"]) == ["scontrol", "release", "7"]
    assert requeue_hold_argv(["7", "8"]) == ["scontrol", "requeuehold", "7,8"]
    assert cancel_argv(["7", "8"]) == ["scancel", "7", "8"]
    assert parse_job_id("1234\n") == "1234" and parse_job_id("55;cluster\n") == "55"
    with pytest.raises(SlurmCommandError, match="sbatch printed no job id"):
        parse_job_id("sbatch: error: Batch job submission failed\n")


def test_spool_asker_gets_the_servers_own_answer_time(tmp_path: Path) -> None:
    state = tmp_path / "job"
    asker = SpoolAsker([1, 2, 3], 4)
    asker.prepare(state, "turn000")
    assert state.stat().st_mode & 0o777 == 0o700
    spool = Spool(state)
    (req,) = list(spool.pending())
    assert (req.id, req.prompt_ids, req.max_new_tokens) == ("turn000", [1, 2, 3], 4)

    def server() -> None:
        time.sleep(0.05)
        spool.complete(req, [9, 9, 9, 9])

    threading.Thread(target=server).start()
    answer = asker.wait(state, "turn000", time.monotonic() + 10)
    assert answer.output_ids == [9, 9, 9, 9]
    assert answer.answered_s == spool.answer("turn000")["answered"]
    with pytest.raises(SpswapError, match="no answer to turn001"):
        asker.wait(state, "turn001", time.monotonic() + 0.05)


def test_openai_body_and_socket(tmp_path: Path) -> None:
    assert completion_body("/m", [1, 2], 8) == {
        "model": "/m", "prompt": [1, 2], "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    assert socket_of(tmp_path) == tmp_path / "sock" / "vllm.sock"
    (tmp_path / "endpoint.json").write_text('{"uds": "/x/vllm.sock"}')
    assert socket_of(tmp_path) == Path("/x/vllm.sock")


def test_preflight_without_slurm_names_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, scontrol, ...
    with pytest.raises(ConfigError, match="needs Slurm's commands .* on PATH"):
        slurm_preflight("low")


def test_preflight_refuses_two_models_of_one_name(tmp_path: Path) -> None:
    models = (tmp_path / "a" / "m", tmp_path / "b" / "m")
    run = TurnsRun(TurnsOptions(models=models, work_dir=tmp_path),
                   Config.from_env({}, root=tmp_path / "root"))  # fmt: skip
    run.make_jobs()
    with pytest.raises(ConfigError, match="two models share a name"):
        run.preflight()


class _EndedJobs(JobControl):
    """Slurm's answer for a job that failed (the real `scontrol show job` and its parsing
    are tested on the CI's Slurm and on stored outputs in tests/slurm/)."""

    def job(self, job_id: str) -> JobInfo | None:
        return JobInfo(job_id=job_id, state="FAILED")


def test_a_job_that_ended_stops_the_wait_with_its_log(tmp_path: Path) -> None:
    run = TurnsRun(
        TurnsOptions(models=(tmp_path / "a", tmp_path / "b"), work_dir=tmp_path),
        Config.from_env({}, root=tmp_path / "root"),
        slurm=_EndedJobs(),
    )
    run.make_jobs()
    run.jobs[1].job_id = "17"
    (tmp_path / "turns-1-b-17.log").write_text("spswap: job 17 run 0 on n1\nerror: not private\n")
    asker = run.jobs[1].asker
    assert asker is not None
    with pytest.raises(
        SpswapError,
        match=r"job 17 \(b\) ended before it answered.*\n"
        r".*\n  error: not private",
    ):
        asker.wait(
            tmp_path / "state",
            "turn000",
            time.monotonic() + 30,
            check=lambda: run._still_queued(run.jobs[1]),
        )


def test_a_work_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    work.chmod(0o775)
    run = TurnsRun(
        TurnsOptions(models=(tmp_path / "a", tmp_path / "b"), work_dir=work),
        Config.from_env({}, root=tmp_path / "root"),
    )
    run.make_jobs()
    with pytest.raises(ConfigError, match="writable by others .* chmod 700 it"):
        run.submit()
    fresh = TurnsRun(
        TurnsOptions(models=(tmp_path / "a",), work_dir=tmp_path / "new" / "w"),
        Config.from_env({}, root=tmp_path / "root"),
        slurm=_EndedJobs(),
    )
    fresh.jobs = []
    fresh.submit()  # no jobs: only the directory
    assert (tmp_path / "new" / "w").stat().st_mode & 0o777 == 0o700


def test_a_refused_question_is_an_error_naming_why(tmp_path: Path) -> None:
    state = tmp_path / "job"
    asker = SpoolAsker([99999], 4)
    asker.prepare(state, "turn000")
    spool = Spool(state)
    (req,) = list(spool.pending())
    spool.fail(req, "token ids must lie in [0, 1024) for this model; got [99999]")
    with pytest.raises(SpswapError, match=r"refused turn000: token ids must lie"):
        asker.wait(state, "turn000", time.monotonic() + 5)
