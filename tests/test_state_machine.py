import pytest

from spswap.errors import IllegalTransition
from spswap.instance.state import TRANSITIONS, Instance, Primitive, State, can_apply, path


def test_up_sleep_up_records_history():
    inst = Instance("m")
    inst.begin(Primitive.SLEEP)
    assert inst.commit(0.1) is State.SLEEP
    inst.begin(Primitive.WAKE)
    assert inst.commit(0.2) is State.UP
    assert [h["primitive"] for h in inst.history] == ["sleep", "wake"]
    assert inst.to_json()["state"] == "up"


@pytest.mark.parametrize("prim", list(Primitive))
@pytest.mark.parametrize("state", list(State))
def test_every_illegal_transition_raises_and_names_the_legal_ones(state, prim):
    inst = Instance("m", state=state)
    if can_apply(state, prim):
        inst.begin(prim)
        assert inst.commit(0.0) is TRANSITIONS[prim][1]
    else:
        with pytest.raises(IllegalTransition, match="legal steps are"):
            inst.begin(prim)
        assert inst.state is state


def test_abort_keeps_the_old_state_and_concurrent_begin_is_refused():
    inst = Instance("m")
    inst.begin(Primitive.SLEEP)
    with pytest.raises(IllegalTransition, match="still running"):
        inst.begin(Primitive.SLEEP)
    inst.abort()
    assert inst.state is State.UP
    with pytest.raises(IllegalTransition, match="without a primitive"):
        inst.commit(0.0)


def test_path_walks_the_line_both_ways():
    assert path(State.UP, State.SAVED) == [
        Primitive.SLEEP,
        Primitive.CUDA_CHECKPOINT,
        Primitive.DUMP,
    ]
    assert path(State.SAVED, State.UP) == [
        Primitive.RESTORE,
        Primitive.CUDA_RESTORE,
        Primitive.WAKE,
    ]
    assert path(State.SLEEP, State.SLEEP) == []


def test_step_commits_with_its_duration_or_aborts():
    inst = Instance("m")
    with inst.step(Primitive.SLEEP):
        pass
    assert inst.state is State.SLEEP and inst.last_duration_s >= 0
    with pytest.raises(RuntimeError, match="boom"):
        with inst.step(Primitive.WAKE):
            raise RuntimeError("boom")
    assert inst.state is State.SLEEP and len(inst.history) == 1
    inst.begin(Primitive.WAKE)  # the failed step left nothing pending
    inst.commit(0.0)
    assert inst.state is State.UP
