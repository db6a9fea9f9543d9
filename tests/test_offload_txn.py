"""The all-or-nothing bookkeeping the framework adapters share (PyTorch, CuPy, JAX), on
plain Python objects, and the bounded ``skipped`` list of their reports."""

from __future__ import annotations

import pytest

from jupyter_gpushare.kernel.offload.base import MAX_SKIPPED, MAX_SKIPPED_CHARS, OffloadReport
from jupyter_gpushare.kernel.offload.txn import Change, UndoIncomplete, apply_all


class Slots:
    """Named slots with a log of writes; a slot can be told to refuse writes."""

    def __init__(self, **values):
        self.values = dict(values)
        self.refuse: set[str] = set()
        self.log: list[tuple[str, object]] = []

    def set(self, name, value):
        if name in self.refuse:
            raise PermissionError(f"{name} is read-only")
        self.values[name] = value
        self.log.append((name, value))

    def changes(self, new: dict):
        """One Change per slot, each built (and its old value read) just before it runs."""
        for name, value in new.items():
            old = self.values[name]
            yield Change(
                do=lambda n=name, v=value: self.set(n, v),
                undo=lambda n=name, v=old: self.set(n, v),
                what=f"slot {name}",
            )


def test_every_change_applies():
    slots = Slots(a=1, b=2, c=3)
    assert apply_all(slots.changes({"a": 10, "b": 20, "c": 30})) == 3
    assert slots.values == {"a": 10, "b": 20, "c": 30}


def test_a_refusal_in_the_middle_undoes_the_others_last_first():
    slots = Slots(a=1, b=2, c=3, d=4)
    slots.refuse.add("c")
    with pytest.raises(PermissionError, match="c is read-only"):
        apply_all(slots.changes({"a": 10, "b": 20, "c": 30, "d": 40}))
    assert slots.values == {"a": 1, "b": 2, "c": 3, "d": 4}
    assert slots.log == [("a", 10), ("b", 20), ("b", 2), ("a", 1)]  # d was never touched


def test_an_interrupt_is_undone_too_and_goes_on_up():
    slots = Slots(a=1, b=2)

    def changes():
        yield from slots.changes({"a": 10})
        raise KeyboardInterrupt  # arrives while the next change is being built

    with pytest.raises(KeyboardInterrupt):
        apply_all(changes())
    assert slots.values == {"a": 1, "b": 2}


def test_an_undo_that_fails_is_reported_and_the_others_still_go_back():
    slots = Slots(a=1, b=2, c=3)
    original = slots.set

    def set_once_for_b(name, value):
        original(name, value)
        if name == "b":
            slots.refuse.add("b")  # b takes one write, then refuses the undo

    slots.set = set_once_for_b
    slots.refuse.add("c")
    with pytest.raises(UndoIncomplete) as caught:
        apply_all(slots.changes({"a": 10, "b": 20, "c": 30}))
    error = caught.value
    assert isinstance(error.cause, PermissionError) and "c is read-only" in str(error.cause)
    assert error.stuck == ["slot b: PermissionError: b is read-only"]
    assert "1 object(s) are not as they were: slot b" in str(error)
    assert slots.values == {"a": 1, "b": 20, "c": 3}  # a went back; b could not


def test_a_change_that_cannot_undo_itself_is_merged_into_one_report():
    slots = Slots(a=1)

    def half_done():
        raise UndoIncomplete(ValueError("refused"), ["slot b: half re-pointed"])

    def changes():
        yield from slots.changes({"a": 10})
        slots.refuse.add("a")  # a applied; its undo will be refused
        yield Change(half_done, lambda: None, "slot b")

    with pytest.raises(UndoIncomplete) as caught:
        apply_all(changes())
    assert isinstance(caught.value.cause, ValueError)
    assert caught.value.stuck == [
        "slot b: half re-pointed",
        "slot a: PermissionError: a is read-only",
    ]


def test_skipped_is_bounded_and_counts_what_it_leaves_out():
    report = OffloadReport("test")
    for i in range(MAX_SKIPPED + 1234):
        report.skip(f"x[{i}]: left alone")
    assert len(report.skipped) == MAX_SKIPPED + 1
    assert report.skipped[MAX_SKIPPED - 1] == f"x[{MAX_SKIPPED - 1}]: left alone"
    assert report.skipped[-1] == "... and 1234 more left alone"
    assert report.left_out == 1234

    long_path = "x" + "['key']" * 200
    report = OffloadReport("test")
    report.skip(f"{long_path}: held by tuple (cannot rebind); left on the device")
    (entry,) = report.skipped
    assert len(entry) <= MAX_SKIPPED_CHARS
    assert entry.startswith("x['key']") and entry.endswith("left on the device")  # why survives
