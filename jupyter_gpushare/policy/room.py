"""How much a restore needs on each GPU, and which GPUs lack it: one rule for the controller
(which reserves the room before a restore starts) and the driver method (which checks it
again just before it moves bytes).

Pure functions on byte counts; nothing here reads a GPU.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

UNKNOWN_GPU = -1  # a held state's GPU index when the server could not tell which GPU


def of_processes(gpu_bytes: dict[int, int], pid_bytes: dict[int, dict[int, int]],
                 pids: list[int] | None = None) -> dict[int, int]:
    """Bytes per GPU that ``pids`` bring back (``None``: all of the kernel's processes).

    Exact when every pid's bytes were measured (``pid_bytes``); else the kernel's whole count
    (``gpu_bytes``), since which pid holds what is not known."""
    if pids is None:
        return dict(gpu_bytes)
    if pids and all(p in pid_bytes for p in pids):
        need: dict[int, int] = {}
        for p in pids:
            for gpu, b in pid_bytes[p].items():
                need[gpu] = need.get(gpu, 0) + int(b)
        return need
    return dict(gpu_bytes) if pids else {}


def to_reserve(gpu_bytes: dict[int, int], total: int, attributed: bool, context_bytes: int,
               every_gpu: list[int]) -> dict[int, int]:
    """Bytes to reserve per GPU before a restore: what the kernel held, on every GPU of the
    node when we could not tell which (``UNKNOWN_GPU``, or no GPU at all), plus a CUDA
    context (``context_bytes``) where the bytes were the kernel's own count rather than
    measured per process (``attributed``)."""
    known = {g: b for g, b in gpu_bytes.items() if g >= 0}
    unknown = gpu_bytes.get(UNKNOWN_GPU, 0)
    margin = 0 if attributed else context_bytes
    if unknown or (not known and total):
        return {g: known.get(g, 0) + (unknown or total) + margin for g in (every_gpu or [0])}
    return {g: b + margin for g, b in known.items()}


def lacking(want: dict[int, int], free: dict[int, int | None], margin: int = 0,
          strict: set[int] | frozenset[int] = frozenset()) -> dict[int, int]:
    """The GPUs of ``want`` without room for it (free memory unknown counts as no room).

    ``margin``: free bytes to keep on top of ``want`` on each GPU. ``strict``: GPUs where
    restores of other servers take no turn with ours: room for twice the state there, so
    that two such restores started at the same moment both fit."""
    out = {}
    for g, n in want.items():
        f = free.get(g)
        if f is None or f < n * (2 if g in strict else 1) + margin:
            out[g] = n
    return out


def move_plan(want: dict[int, int], short: dict[int, int], free: dict[int, int | None],
              strict: set[int] | frozenset[int] = frozenset()) -> dict[int, int] | None:
    """Where a restore without room on some of its GPUs could go instead: each GPU of
    ``short`` -> another GPU with room for its bytes (as :func:`lacking` counts room), the
    one with the most free memory first. A target is none of ``want``'s GPUs (the kernel
    keeps those) and takes one GPU's state. None when a GPU of ``short`` has nowhere to go
    (the state comes back whole or not at all) or a GPU is unknown (``UNKNOWN_GPU``)."""
    if UNKNOWN_GPU in want or not short:
        return None
    taken = set(want)
    plan: dict[int, int] = {}
    for g in sorted(short, key=lambda g: -short[g]):  # the largest state picks first
        fits = [t for t, f in free.items() if t not in taken and f is not None
                and not lacking({t: short[g]}, free, strict=strict)]
        if not fits:
            return None
        best = max(fits, key=lambda t: (free[t] or 0, -t))
        plan[g] = best
        taken.add(best)
    return plan


def narrow(room: dict[int, int | None], seen: Mapping[int, tuple[int | None, bool]] | None,
           keep: Container[int] = ()) -> dict[int, bool]:
    """Fold a node-wide view (the hub service's: {gpu: (room or None, within the person's
    share)}) into ``room``, in place: where both know a GPU's room, the smaller counts (what
    another person's released kernel will take back is no room). GPUs in ``keep`` are left as
    they are. Returns, per GPU the view gave, whether the person is within their share."""
    within: dict[int, bool] = {}
    for g, (theirs, ok) in (seen or {}).items():
        if g in keep or g not in room:
            continue
        within[g] = ok
        ours = room[g]
        if theirs is not None:
            room[g] = theirs if ours is None else min(ours, theirs)
    return within
