"""The request spool: the saved state of a preempted server."""

from __future__ import annotations

import pytest

from spswap.errors import RequestIdTaken, SpswapError
from spswap.serve.spool import Request, Spool


def _req(rid: str, t: float, prompt: list[int] | None = None) -> Request:
    return Request(id=rid, prompt_ids=prompt or [1, 2, 3], max_new_tokens=4, submitted=t)


def test_submit_pending_complete_roundtrip(tmp_path):
    spool = Spool(tmp_path / "state")
    spool.create()
    assert spool.submit(_req("b", 2.0))
    assert spool.submit(_req("a", 1.0))
    assert [r.id for r in spool.pending()] == ["a", "b"]  # oldest first
    spool.complete(_req("a", 1.0), [7, 8])
    assert [r.id for r in spool.pending()] == ["b"]
    assert spool.answer("a")["output_ids"] == [7, 8]
    assert set(spool.answers()) == {"a"}


def test_submit_is_idempotent_for_pending_and_answered(tmp_path):
    spool = Spool(tmp_path)
    spool.create()
    assert spool.submit(_req("x", 1.0))
    assert not spool.submit(_req("x", 1.0))
    spool.complete(_req("x", 1.0), [1])
    assert not spool.submit(_req("x", 1.0))
    assert list(spool.pending()) == []


def test_an_id_asked_before_with_another_prompt_is_refused(tmp_path):
    """Not the saved answer of another prompt, silently: the id names one request."""
    spool = Spool(tmp_path)
    spool.create()
    spool.submit(_req("x", 1.0, [5, 6]))
    with pytest.raises(RequestIdTaken, match="^request x was asked before with the prompt 5,6 "
                       "and 4 new tokens: ask with that prompt"):  # fmt: skip
        spool.submit(_req("x", 2.0, [7]))
    with pytest.raises(RequestIdTaken, match="and 4 new tokens"):
        spool.submit(Request(id="x", prompt_ids=[5, 6], max_new_tokens=9))
    spool.complete(_req("x", 1.0, [5, 6]), [1])
    assert not spool.submit(Request(id="x", prompt_ids=[5, 6], max_new_tokens=9))  # (not kept)
    with pytest.raises(RequestIdTaken, match="^request x was asked before with the prompt 5,6: "):
        spool.submit(_req("x", 3.0, [7]))
    assert [r.id for r in spool.pending()] == [] and spool.answer("x")["output_ids"] == [1]


def test_a_new_spool_object_sees_saved_requests(tmp_path):
    """What a preempted run leaves is what the requeued run resumes."""
    Spool(tmp_path).create()
    Spool(tmp_path).submit(_req("r1", 1.0, [5, 6]))
    resumed = list(Spool(tmp_path).pending())
    assert [(r.id, r.prompt_ids) for r in resumed] == [("r1", [5, 6])]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"id": "../etc", "prompt_ids": [1]}, "must be 1-128 characters"),
        ({"id": "ok", "prompt_ids": []}, "non-empty list of ints"),
        ({"id": "ok", "prompt_ids": ["a"]}, "non-empty list of ints"),
        ({"id": "ok", "prompt_ids": [1], "max_new_tokens": 0}, "1..4096"),
        ({"id": "ok", "prompt_ids": [1], "max_new_tokens": "3"}, "1..4096"),
    ],
)
def test_bad_requests_are_refused_with_the_rule(data, needle):
    with pytest.raises(SpswapError, match=needle):
        Request.from_json(data)


def test_request_without_id_gets_one():
    r = Request.from_json({"prompt_ids": [1, 2]})
    assert len(r.id) == 32 and r.max_new_tokens == 16
