"""The pure placement policy: awake slots, LRU victims, busy models, idle timeout, budget."""

from __future__ import annotations

import pytest

from spswap.errors import ConfigError
from spswap.multi.placement import ModelState, Placement, WakePlan, awake_slots, budget_refusal


@pytest.mark.parametrize(("n", "units", "devices", "max_awake", "want"), [
    (3, 2, 1, None, 2),  # default: two at half a device each
    (1, 2, 1, None, 1),  # never more than the models
    (6, 1, 1, None, 4),
    (6, 4, 2, None, 2),
    (6, 1, 1, 3, 3),
])  # fmt: skip
def test_awake_slots(n, units, devices, max_awake, want):
    assert awake_slots(n, units, devices, max_awake) == want


def test_awake_slots_refuse_bad_units():
    with pytest.raises(ConfigError, match="--units 5: give 1 to 4"):
        awake_slots(3, 5)
    with pytest.raises(ConfigError, match="--awake 0"):
        awake_slots(3, 2, max_awake=0)


def test_first_slots_awake_rest_asleep():
    p = Placement(("a", "b", "c"), 2)
    assert p.states == {"a": ModelState.AWAKE, "b": ModelState.AWAKE, "c": ModelState.ASLEEP}
    assert p.plan_wake("a") == WakePlan()


def test_lru_idle_awake_model_is_the_victim():
    p = Placement(("a", "b", "c"), 2)
    p.begin("a", 1.0), p.end("a", 2.0)
    p.begin("b", 3.0), p.end("b", 4.0)
    assert p.plan_wake("c") == WakePlan(sleep=("a",), wake=True)
    p.begin("a", 5.0), p.end("a", 6.0)
    assert p.plan_wake("c") == WakePlan(sleep=("b",), wake=True)


def test_busy_models_are_never_victims_and_all_busy_blocks():
    p = Placement(("a", "b", "c"), 2)
    p.begin("a", 1.0)  # answering, and older than b
    p.begin("b", 2.0), p.end("b", 3.0)
    assert p.plan_wake("c") == WakePlan(sleep=("b",), wake=True)
    p.begin("b", 4.0)
    assert p.plan_wake("c") == WakePlan(blocked=True)


def test_a_swap_holds_its_victim_until_it_ends():
    p = Placement(("a", "b", "c"), 2)
    plan = p.plan_wake("c")
    p.begin_swap("c", plan, 1.0)
    assert p.awake() == ["b", "c"] and "c" in p.busy
    assert p.plan_wake("a") == WakePlan(blocked=True)  # still going to sleep
    p.end_swap(plan.sleep)
    assert p.plan_wake("a") == WakePlan(sleep=("b",), wake=True)


def test_free_slot_wakes_without_a_victim():
    p = Placement(("a", "b"), 2, states={"a": ModelState.ASLEEP, "b": ModelState.ASLEEP})
    assert p.plan_wake("a") == WakePlan(wake=True)


def test_a_model_nobody_asked_is_idle_from_the_start_not_from_the_clocks_zero():
    p = Placement(("a", "b"), slots=2)
    p.touch_all(1000.0)  # the router's start, on a monotonic clock long past zero
    assert p.idle_too_long(1005.0, 10.0) == []
    assert p.idle_too_long(1010.0, 10.0) == ["a", "b"]
    p.touch_all(5000.0)  # restored after a long stop: not idle because of the stop
    assert p.idle_too_long(5001.0, 10.0) == []


def test_idle_timeout():
    p = Placement(("a", "b", "c"), 2)
    p.begin("a", 10.0), p.end("a", 10.0)
    p.begin("b", 0.0)  # busy: kept however old
    assert p.idle_too_long(15.0, 10.0) == []
    assert p.idle_too_long(20.0, 10.0) == ["a"]
    assert p.idle_too_long(99.0, None) == []


def test_names_must_be_unique():
    with pytest.raises(ConfigError, match="named twice"):
        Placement(("a", "a"), 1)


@pytest.mark.parametrize(("n", "slots", "target", "swap", "ok"), [
    (4, 2, 15.0, 4.59, True),  # Nodus: 2 + floor(15 / 4.59) = 5
    (6, 2, 15.0, 4.59, False),
    (6, 2, 2.0, 0.1, True),
    (3, 1, None, 100.0, True),  # no target: no check
    (3, 1, 1.0, 0.0, True),
])  # fmt: skip
def test_budget(n, slots, target, swap, ok):
    assert (budget_refusal(n, slots, target, swap) is None) is ok


def test_budget_reason_is_exact():
    assert budget_refusal(6, 2, 15.0, 4.59) == (
        "6 models cannot meet --latency-target-s 15: with 2 awake and a swap of 4.590 s at "
        "most 5 fit the target; serve fewer models, raise --latency-target-s, or allow more "
        "awake (--units / --awake)"
    )


def test_vllm_on_cpu_is_refused_before_any_import(tmp_path):
    from spswap.config import Config
    from spswap.multi.serve import MultiOptions, start_router

    opts = MultiOptions(models=(tmp_path / "a",), socket_path=tmp_path / "s", engine="vllm",
                        state_dir=tmp_path / "st")  # fmt: skip
    with pytest.raises(ConfigError, match="--engine vllm runs on a GPU, not on 'cpu'"):
        start_router(Config.from_env({}, root=tmp_path / "root"), opts)
    assert not (tmp_path / "root").exists()


def test_resize_puts_the_least_recently_used_idle_ones_to_sleep():
    p = Placement(("a", "b", "c"), slots=2)
    p.last_used_s.update(a=5.0, b=1.0)
    assert p.resize(1) == ["b"]
    assert p.awake() == ["a"] and p.slots == 1
    assert p.resize(3) == [] and p.slots == 3
    p.busy.add("a")
    assert p.resize(1) == [] and p.awake() == ["a"]  # a busy model is never put to sleep
    with pytest.raises(ConfigError, match="--awake 0: at least one"):
        p.resize(0)
