"""All or nothing: apply a list of changes to live objects; if one fails, undo the others.

The adapters move a kernel's state in two phases: first copy every byte (nothing has
changed if that fails), then re-point or rebind every object at its copy. The second phase
is a list of :class:`Change` applied with :func:`apply_all`: when one change refuses, every
change already applied is undone, in reverse order, and the error is raised, so every object
is exactly as it was. If an undo fails too, the objects are *not* as they were, and
:class:`UndoIncomplete` says which ones: a caller must never report that state as intact.

Pure Python, no framework: the same bookkeeping serves PyTorch, CuPy and JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

_MAX_STUCK_SHOWN = 10  # an error message names at most this many objects


@dataclass(frozen=True, slots=True)
class Change:
    """One reversible change. ``do`` either succeeds or leaves its object as it was (it
    puts back its own half-done work before raising); ``undo`` reverses a ``do`` that
    succeeded. ``what`` names the object in error messages."""

    do: Callable[[], object]
    undo: Callable[[], object]
    what: str


class UndoIncomplete(RuntimeError):
    """A change failed and undoing the earlier ones failed too: ``stuck`` names the objects
    left changed (with why). ``cause`` is the error of the change that failed."""

    def __init__(self, cause: BaseException, stuck: list[str]):
        self.cause = cause
        self.stuck = stuck
        shown = "; ".join(stuck[:_MAX_STUCK_SHOWN])
        more = f" and {len(stuck) - _MAX_STUCK_SHOWN} more" if len(stuck) > _MAX_STUCK_SHOWN else ""
        super().__init__(
            f"{_describe(cause)}; undoing the move failed, so {len(stuck)} object(s) are not "
            f"as they were: {shown}{more}"
        )


def apply_all(changes: Iterable[Change]) -> int:
    """Apply every change in order, or none: returns how many were applied.

    ``changes`` may be a generator: each change is built just before it is applied (so it
    can capture the object's state of that moment). On failure (an interrupt included) the
    applied changes are undone last first and the error is raised again; if an undo fails,
    the others are still undone and :class:`UndoIncomplete` is raised instead."""
    done: list[Change] = []
    try:
        for change in changes:
            change.do()
            done.append(change)
    except BaseException as exc:
        stuck = undo_all(done)
        if stuck:
            if isinstance(exc, UndoIncomplete):  # the failed change could not undo itself
                stuck, exc = exc.stuck + stuck, exc.cause
            raise UndoIncomplete(exc, stuck) from exc
        raise
    return len(done)


def undo_all(done: list[Change]) -> list[str]:
    """Undo ``done`` last first, each one whatever happened to the others; returns
    ``"what: error"`` for every undo that failed."""
    stuck = []
    for change in reversed(done):
        try:
            change.undo()
        except BaseException as exc:  # keep going: every other object still goes back
            stuck.append(f"{change.what}: {_describe(exc)}")
    return stuck


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
