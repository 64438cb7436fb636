"""Registering a job run whose prolog never reached spswapd (missed_prolog.missed_run)."""

from __future__ import annotations

import pytest

from spswap.daemon.jobs import JobRecord
from spswap.daemon.missed_prolog import missed_run
from spswap.slurm.parse import JobInfo

ENDED = JobRecord(job_id="31", uid=1000, user="ada", gpus=[1], restart_count=0,
                  registered_at=1.0, state="ended", ended_at=2.0)  # fmt: skip
HERE = {"gpu07"}


def _info(**kw: object) -> JobInfo:
    base: dict = {"job_id": "31", "state": "RUNNING", "restart_count": 1, "uid": 1000,
                  "nodes": "gpu07", "gpus": (0,)}  # fmt: skip
    return JobInfo(**{**base, **kw})


def test_a_requeued_run_slurm_places_here_is_registered() -> None:
    new = missed_run(ENDED, _info(), HERE, now=5.0)
    assert new == JobRecord(job_id="31", uid=1000, user="ada", gpus=[0], restart_count=1,
                            registered_at=5.0, state="running")  # fmt: skip
    # a requeued record, or the same restart count (an epilog that came early): the same
    requeued = JobRecord(**{**ENDED.__dict__, "state": "requeued", "restart_count": 1})
    assert missed_run(requeued, _info(), HERE, now=5.0) == new


@pytest.mark.parametrize(("why", "rec", "info", "here"), [
    ("registered already", JobRecord(job_id="31", uid=1000), _info(), HERE),
    ("Slurm does not know it", ENDED, None, HERE),
    ("not running", ENDED, _info(state="PENDING"), HERE),
    ("completing", ENDED, _info(state="COMPLETING"), HERE),
    ("another user's", ENDED, _info(uid=1001), HERE),
    ("no owner given", ENDED, _info(uid=None), HERE),
    ("on another node", ENDED, _info(nodes="gpu08"), HERE),
    ("no node list", ENDED, _info(nodes=None), HERE),
    ("a bad node list", ENDED, _info(nodes="gpu[3-1]"), HERE),
    ("this node's name not known", ENDED, _info(), set()),
    ("an older run than recorded",
     JobRecord(**{**ENDED.__dict__, "restart_count": 3}), _info(restart_count=2), HERE),
])  # fmt: skip
def test_nothing_is_registered_unless_slurm_says_it_runs_here(
    why: str, rec: JobRecord, info: JobInfo | None, here: set[str]
) -> None:
    assert missed_run(rec, info, here, now=5.0) is None, why


def test_the_gpus_are_slurms_for_this_node() -> None:
    two_nodes = _info(nodes="gpu[07-08]", gpus=(0, 1, 3),
                      gpus_by_node={"gpu08": (3,), "gpu[06-07]": (0, 1)})  # fmt: skip
    new = missed_run(ENDED, two_nodes, HERE, now=5.0)
    assert new is not None and new.gpus == [0, 1]
    # several nodes and none given per node: the union is not this node's, keep the last run's
    unknown = _info(nodes="gpu[07-08]", gpus=(0, 3))
    new = missed_run(ENDED, unknown, HERE, now=5.0)
    assert new is not None and new.gpus == [1]
