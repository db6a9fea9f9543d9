"""The state machine as a table: every step refuses the states it does not list (changing
nothing), leads where the table says, and the documentation's table is the code's.

The model test (test_controller_model.py) drives the same steps through the real controller;
this one walks the table itself, every step from every state.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from jupyter_gpushare.core import lifecycle
from jupyter_gpushare.core.lifecycle import (
    PREVIOUS,
    STEPS,
    UNCHANGED,
    Held,
    IllegalTransition,
    Lifecycle,
)
from jupyter_gpushare.core.operations import Operation
from jupyter_gpushare.states import (
    ACTIVE,
    ALL,
    FAILED,
    HELD,
    IDLE,
    RELEASED,
    RELEASING,
    RESTORING,
    UNTRACKED,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "how-it-works.md"


def held() -> Held:
    return Held(method="simulated", bytes=4 << 30, gpus={0: 4 << 30}, pids=[10], pid_bytes={},
                kernel_pid=10, attributed=True, since=0.0)


def in_state(state: str, moving: bool = True) -> Lifecycle:
    """A record in ``state``; ``moving``: a release that already holds its bytes."""
    st = Lifecycle("k")
    if state in (ACTIVE, IDLE, UNTRACKED):
        st.resident = state
    elif state == RELEASING:
        st.resident = IDLE
        st.op = Operation("release", "test")
        if moving:
            st.op.phase = "moving"
            st.held = held()
    else:
        st.resident = IDLE
        st.held = held()
        st.failed = state == FAILED
        if state == RESTORING:
            st.op = Operation("restore", "test")
            st.op.phase = "moving"
    assert st.state == state
    return st


def take(st: Lifecycle, name: str) -> None:
    """Take step ``name`` with the arguments it needs."""
    h = st.held or held()
    if name in ("begin_release", "begin_restore"):
        getattr(st, name)(Operation("release" if name == "begin_release" else "restore", "t"))
    elif name == "hold":
        st.hold(h)
    elif name == "release_done":
        st.release_done(h, 4 << 30, 1.5, "2 objects left on the GPU")
    elif name == "release_undone":
        st.release_undone(h, "nothing moved", 5.0)
    elif name == "release_unconfirmed":
        st.release_unconfirmed(h, "timeout", True, 5.0)
    elif name == "restore_done":
        st.restore_done(h, 0.5)
    elif name == "restore_failed":
        st.restore_failed("restore failed: out of memory", True, stays_released=False)
    elif name == "note_error":
        st.note_error("not restored ahead of your next cell")
    elif name == "restore_moving":
        if st.op is None and st.state in (RELEASED, FAILED):
            st.begin_restore(Operation("restore", "t"))  # it moves what a restore waited for
        st.restore_moving()
    elif name == "drop":
        st.drop("the kernel restarted")
    else:
        getattr(st, name)()


def end_operation(st: Lifecycle) -> None:
    """The operation in flight ends, as the controller ends it (a drop it held back follows)."""
    if st.op is not None:
        dropped = st.operation_ended(st.op)
        if dropped:
            assert st.drop(dropped)


GUARDED = sorted({s.name for s in STEPS} - {"observe"})  # observe records every poll


@pytest.mark.parametrize("name", GUARDED)
def test_a_step_from_a_state_it_does_not_list_is_refused_and_changes_nothing(name):
    sources = {s for step in STEPS if step.name == name for s in step.sources}
    refused = [state for state in ALL if state not in sources]
    if name in ("release_refused", "hold"):  # before bytes are held only
        refused.append(RELEASING)
    for state in refused:
        for moving in (True, False) if state == RELEASING else (True,):
            st = in_state(state, moving)
            if state == RELEASING and not moving and name in ("release_refused", "hold"):
                continue  # the state is listed; the finer condition is tested below
            before = copy.deepcopy(st)
            with pytest.raises(IllegalTransition, match=name):
                take(st, name)
            assert st == before, (name, state)


@pytest.mark.parametrize("step", [s for s in STEPS if s.name != "observe"],
                         ids=lambda s: f"{s.name}->{s.target}")
def test_every_step_leads_where_the_table_says(step):
    for source in step.sources:
        st = in_state(source, moving=step.name not in ("release_refused", "hold"))
        take(st, step.name)
        if step.target == UNCHANGED:
            assert st.state == source
            continue
        if step.name in ("begin_release", "restore_moving"):  # for as long as the operation runs
            assert st.state == step.target, (step.name, source)
            continue
        end_operation(st)
        # PREVIOUS: the state before the release (in_state's resident)
        expected = IDLE if step.target == PREVIOUS else step.target
        assert st.state == expected, (step.name, source)


def test_a_release_whose_bytes_did_not_move_goes_back_to_the_state_before_it():
    st = in_state(IDLE)
    take(st, "begin_release")
    assert st.state == RELEASING and st.is_held  # cells wait from the first moment
    st.release_refused()
    end_operation(st)
    assert st.state == IDLE and st.held is None and st.error is None


def test_a_drop_while_bytes_move_waits_for_the_operation_to_end():
    st = in_state(RESTORING)
    assert st.drop("the kernel restarted") is False
    assert st.state == RESTORING and st.held is not None  # the method fails on its own first
    why = st.operation_ended(st.op)  # type: ignore[arg-type]
    assert why == "the kernel restarted"
    assert st.drop(why) is True
    assert st.state == UNTRACKED and st.drops == 1 and not st.retryable
    assert st.error == "the kernel restarted: its released GPU state is gone"


def test_a_restore_ahead_that_fails_stays_released_and_says_why():
    st = in_state(RESTORING)
    st.restore_failed("not restored ahead: no room", True, stays_released=True)
    end_operation(st)
    assert st.state == RELEASED and st.error == "not restored ahead: no room"
    failed = in_state(RESTORING)
    failed.failed = True
    failed.restore_failed("again", True, stays_released=True)
    end_operation(failed)
    assert failed.state == FAILED  # a failed state is not made to look released


def test_what_a_method_said_about_a_release_is_kept_with_the_held_state():
    st = in_state(RELEASING)
    take(st, "release_done")
    end_operation(st)
    assert st.state == RELEASED and st.held is not None
    assert st.held.detail == "2 objects left on the GPU" and st.held.complete


def test_the_actions_a_person_may_ask_for_follow_the_states_that_hold():
    assert set(lifecycle.ACTIONS["restore"]) == set(HELD)
    assert lifecycle.ACTIONS["release"] == (ACTIVE, IDLE)
    assert set(lifecycle.ACTIONS["pin"]) == set(ALL)
    for state in ALL:
        st = in_state(state)
        assert st.allows("restore") == st.is_held, state


def test_the_documented_transitions_are_the_code_s_table():
    text = DOCS.read_text()
    assert lifecycle.transition_table() in text, (
        "docs/how-it-works.md's table of transitions differs from "
        "`python -m jupyter_gpushare.core.lifecycle`: paste its output")
