"""A kernel's gpushare lifecycle: its record, and every change of its state, in one table.

The state is derived, never stored: from the operation in flight, the held GPU state and the
last poll (:attr:`Lifecycle.state`). What changes those is a step, a named method of
:class:`Lifecycle` that refuses to run from a state :data:`STEPS` does not list
(:class:`IllegalTransition`): a bug shows up as a refused change, logged, with the kernel's
state intact, never as a state nobody planned. The controller decides *when* a step happens;
this module says *which* steps exist and what each one changes.

``docs/how-it-works.md``'s table of transitions is :func:`transition_table`'s output (a test
checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..states import ACTIVE, ALL, FAILED, HELD, IDLE, RELEASED, RELEASING, RESTORING, UNTRACKED

if TYPE_CHECKING:
    from .operations import Operation

#: What a person may ask for in each state (REST, the panel, ``%gpushare``): the server
#: answers 409 outside these, and the lab extension's buttons follow the same table (its
#: types are generated from it). A restore asked while a release is in flight waits for the
#: release, then restores; one asked while a restore runs joins it.
ACTIONS: dict[str, tuple[str, ...]] = {
    "release": (ACTIVE, IDLE),
    "restore": HELD,
    "pin": ALL,
}

PREVIOUS = "previous state"  # a step's target: the state the kernel had before it began
UNCHANGED = "unchanged"  # a step that changes what the kernel holds, not its state


@dataclass(frozen=True)
class Step:
    """One legal change: the method that makes it, the states it may start from, the state
    it leads to (once the operation in flight, if any, has ended), and when it happens."""

    name: str
    sources: tuple[str, ...]
    target: str
    when: str


STEPS: tuple[Step, ...] = (
    Step("observe", (UNTRACKED, ACTIVE, IDLE), ACTIVE,
         "The kernel's processes hold GPU memory, and were used within the last "
         "min(60 s, `idle_timeout`) (each poll)."),
    Step("observe", (ACTIVE,), IDLE,
         "No activity for min(60 s, `idle_timeout`). Any activity goes back to `active`."),
    Step("observe", (ACTIVE, IDLE), UNTRACKED, "The kernel's processes hold no GPU memory."),
    Step("begin_release", (ACTIVE, IDLE), RELEASING,
         "The policy picks it, or someone asks (REST, panel, magic)."),
    Step("release_refused", (RELEASING,), PREVIOUS,
         "Before any byte moved: a cell runs, the state would not fit in host memory, the agent did "
         "not answer; the reason is returned."),
    Step("hold", (RELEASING,), UNCHANGED,
         "Nothing refused it: the method is about to move bytes; from here cells wait, and the held state is kept "
         "until a method confirms it is back."),
    Step("release_done", (RELEASING,), RELEASED,
         "The method has moved the state to host memory."),
    Step("release_undone", (RELEASING,), PREVIOUS,
         "The release failed and the method confirmed the kernel runs as before (nothing "
         "moved, or the undo completed); `error` is set."),
    Step("release_unconfirmed", (RELEASING,), FAILED,
         "The release failed and the kernel could not be confirmed running (a timeout, a lost "
         "agent channel, a rollback that found its memory taken): the state stays held."),
    Step("begin_restore", (RELEASED, FAILED), UNCHANGED,
         "A trigger fires; the restore takes its turn and waits for room (`waiting` says why)."),
    Step("restore_moving", (RELEASED, FAILED), RESTORING,
         "The GPUs have room, reserved for this restore: bytes move."),
    Step("restore_room_taken", (RESTORING,), RELEASED,
         "Right before its first call the method found the room taken (another process "
         "allocated since the room was granted); nothing moved: the restore waits for room "
         "again, as before it moved (`failed` stays `failed`), `waiting` says why; after 3 "
         "such returns, the next refusal fails it."),
    Step("restore_done", (RESTORING,), ACTIVE,
         "The state is back; activity counts from now."),
    Step("restore_failed", (RESTORING,), FAILED,
         "The restore failed; the state is still held (a restore *ahead* of a cell that fails "
         "leaves it `released`, the reason shown)."),
    Step("note_error", (RELEASED, FAILED), UNCHANGED,
         "An operation that moved nothing says why (a restore ahead of the person that found "
         "no room in time)."),
    Step("drop", (RELEASING, RELEASED, RESTORING, FAILED), UNTRACKED,
         "The kernel restarted or died: the process that held the state is gone, so is the "
         "state (`error`: `the kernel restarted: its released GPU state is gone`)."),
)


class IllegalTransition(RuntimeError):
    """A step asked from a state that does not allow it (a bug: nothing was changed)."""


@dataclass
class Held:
    """A kernel's GPU state while it is (or may be) off the GPU."""

    method: str
    bytes: int  # bytes that left (or may have left) the GPU
    gpus: dict[int, int]  # GPU index -> bytes to bring back; -1 = a GPU we could not tell
    pids: list[int]  # the processes the method acts on
    pid_bytes: dict[int, dict[int, int]]  # pid -> GPU -> bytes, when known per pid
    kernel_pid: int | None  # the kernel's process when released (a new one = a restart)
    attributed: bool  # bytes measured per process (NVML, simulated) rather than self-reported
    since: float  # clock.now() when the release began
    complete: bool = False  # the release finished: everything is off the GPU
    detail: str = ""  # what the method said about the release ("3 objects left on the GPU")


def _sources(name: str) -> frozenset[str]:
    return frozenset(s for step in STEPS if step.name == name for s in step.sources)


_FROM = {step.name: _sources(step.name) for step in STEPS}


@dataclass
class Lifecycle:
    """One kernel's gpushare record. Read its fields freely; change them through its steps."""

    kernel_id: str
    pinned: bool = False
    held: Held | None = None
    op: Operation | None = None
    failed: bool = False  # the last operation went wrong and the state is held
    resident: str = UNTRACKED  # active / idle / untracked, from the last poll
    method: str | None = None
    releases: int = 0
    restores: int = 0
    last_restore_seconds: float | None = None
    last_release_seconds: float | None = None
    #: where the last restore went when it moved ("onto GPU 1: GPU 0 had no room"), else None
    restored_onto: str | None = None
    error: str | None = None
    retryable: bool = True
    waiting: str | None = None  # why a restore waits, None when it does not
    waiting_note: str | None = None  # what the node-wide service says about that wait
    release_failed_at: float | None = None
    idle_timeout: float | None = None  # per-kernel override (kernelspec metadata, magic)
    #: memory caps, bytes per GPU (policy/caps.py): the kernel's own (magic, REST) and the
    #: ceiling it may not exceed (kernelspec memory_limit, the admin's default)
    own_cap: int | None = None
    cap_ceiling: int | None = None
    background: str | None = None  # the agent saw threads use the GPU outside cells (sticky)
    idle_gpu_work_at: float | None = None  # last sample with GPU work while no cell ran
    allow_background: bool = False  # the user accepts releases despite background work
    host_refusal: str | None = None  # why the state would not fit in host memory now
    drops: int = 0  # times a held state was dropped (restarts): waiters compare it
    drop_after_op: str | None = None  # a restart seen while bytes were moving
    #: when the restore in flight first lacked room on its own GPUs (None: not yet); one
    #: whose room was taken right before the method's call keeps it as it waits again
    short_since: float | None = None

    # -- reading ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        op = self.op
        if op is not None and (op.kind == "release" or op.phase == "moving"):
            return RELEASING if op.kind == "release" else RESTORING
        if self.held is not None:
            return FAILED if self.failed else RELEASED
        return self.resident

    @property
    def is_held(self) -> bool:
        """Cells must wait: the GPU state is (or may soon be) off the GPU."""
        return self.held is not None or (self.op is not None and self.op.kind == "release")

    @property
    def released_bytes(self) -> int:
        return self.held.bytes if self.held is not None else 0

    @property
    def released_gpus(self) -> dict[int, int]:
        return dict(self.held.gpus) if self.held is not None else {}

    @property
    def release_blocked(self) -> str | None:
        """Why an idle kernel is not released automatically (None: nothing stops it)."""
        if self.background and not self.allow_background:
            return self.background
        if self.idle_gpu_work_at is not None and not self.allow_background:
            return ("the GPU computed while no cell ran (a background thread?): a release would "
                    "make that work wait; release by hand or allow it with "
                    "%gpushare allow-background")
        return self.host_refusal

    def allows(self, action: str) -> bool:
        """Whether a person may ask for ``action`` (see :data:`ACTIONS`) now."""
        return self.state in ACTIONS[action]

    # -- steps -------------------------------------------------------------------------------
    def _check(self, step: str, also: bool = True) -> None:
        """Refuse ``step`` outside its states (``also``: a finer condition of the step)."""
        if self.state not in _FROM[step] or not also:
            raise IllegalTransition(f"kernel {self.kernel_id}: {step} is not allowed while "
                                    f"{self.state}" + ("" if also else " (bytes held already)"))

    def observe(self, resident: str) -> None:
        """The last poll's reading (shown whenever nothing is held and nothing runs)."""
        self.resident = resident

    def begin_release(self, op: Operation) -> None:
        self._check("begin_release")
        self.op = op

    def release_refused(self) -> None:
        """Nothing moved: the kernel stays as it was once the operation ends."""
        self._check("release_refused", also=self.held is None)

    def hold(self, held: Held) -> None:
        """Bytes may leave the GPU from now: cells wait until a method confirms they are back."""
        self._check("hold", also=self.held is None)
        self.held, self.method, self.failed, self.error = held, held.method, False, None

    def release_done(self, held: Held, moved: int, seconds: float, detail: str = "") -> None:
        self._check("release_done")
        held.complete, held.bytes, held.detail = True, moved, detail
        self.release_failed_at = None
        self.releases += 1
        self.last_release_seconds = seconds

    def release_undone(self, held: Held, why: str, now: float) -> None:
        """The method confirmed the kernel runs as before: back to the previous state."""
        self._check("release_undone")
        self.release_failed_at = now
        if self.held is held:
            self.held, self.error = None, f"release failed: {why}"

    def release_unconfirmed(self, held: Held, why: str, retryable: bool, now: float) -> None:
        self._check("release_unconfirmed")
        self.release_failed_at = now
        if self.held is held:
            self.failed, self.retryable = True, retryable
            self.error = f"release failed and the kernel could not be confirmed running: {why}"

    def begin_restore(self, op: Operation) -> None:
        self._check("begin_restore")
        self.op = op

    def restore_moving(self) -> None:
        op = self.op
        self._check("restore_moving", also=op is not None and op.kind == "restore")
        assert op is not None
        op.phase = "moving"
        self.error = None

    def restore_room_taken(self, why: str = "the room was taken right before the restore") -> None:
        """The method refused for room alone before anything moved: back to waiting (the
        operation goes on, stoppable again), ``why`` shown in ``waiting``."""
        op = self.op
        self._check("restore_room_taken", also=op is not None and op.kind == "restore")
        assert op is not None
        op.phase = "waiting"
        self.waiting = why

    def restore_done(self, held: Held, seconds: float, onto: str | None = None) -> None:
        """``onto``: where the state went when the restore moved it (None: where it was)."""
        self._check("restore_done")
        if self.held is held:
            self.held = None
        self.failed, self.error, self.retryable = False, None, True
        self.resident = ACTIVE  # just used: the next poll counts idle time from here
        self.restores += 1
        self.last_restore_seconds = seconds
        self.restored_onto = onto

    def restore_failed(self, error: str, retryable: bool, stays_released: bool) -> None:
        """``stays_released``: a restore ahead of a cell failed: ``released``, not ``failed``
        (unless it was failed already), the reason kept in ``error``."""
        self._check("restore_failed")
        self.failed = self.failed or not stays_released
        self.retryable, self.error = retryable, error

    def note_error(self, why: str) -> None:
        self._check("note_error")
        self.error = why

    def crashed(self, why: str) -> None:
        """An operation ended by a bug: a held state is kept and marked failed."""
        if self.held is not None:
            self.failed, self.error = True, why

    def drop(self, why: str) -> bool:
        """The process that held the state is gone. False when bytes are still moving: the
        method fails on its own, and the drop happens as the operation ends."""
        self._check("drop")
        if self.op is not None and self.op.phase == "moving":
            self.drop_after_op = why
            return False
        self.held, self.failed, self.waiting = None, False, None
        self.resident = UNTRACKED  # the process that held memory is gone; the next poll tells
        self.error, self.retryable = f"{why}: its released GPU state is gone", False
        self.drops += 1
        return True

    def operation_ended(self, op: Operation) -> str | None:
        """``op`` has ended, however: it is cleared, and a drop it held back is returned."""
        if self.op is op:
            self.op = None
        self.waiting = self.waiting_note = self.short_since = None
        why, self.drop_after_op = self.drop_after_op, None
        return why


def transition_table() -> str:
    """The Markdown table of :data:`STEPS` that change a state (docs/how-it-works.md)."""
    rows = ["| From | To | Step | When |", "|---|---|---|---|"]
    for step in STEPS:
        if step.target == UNCHANGED:
            continue
        sources = "any held state" if set(step.sources) == set(HELD) else "/".join(
            f"`{s}`" for s in step.sources)
        target = step.target if step.target == PREVIOUS else f"`{step.target}`"
        rows.append(f"| {sources} | {target} | `{step.name}` | {step.when} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(transition_table(), end="")
