"""Room after a cell ran out of GPU memory: this server's idle kernels on that GPU released,
so that the cell's next try fits.

A fresh kernel's first allocation, or a cell that grows, is neither memory pressure nor a
waiting restore, so under ``release_policy = "needs"`` nothing made room for it: the person
got the framework's error while others' kernels sat idle on the GPU. The kernel's agent asks
after such an error (``out_of_memory``); the answer is the line said under the error.

The rule (:func:`..policy.oom.plan`): make-room's (the policy's ``make_room``: kernels idle at least
``pressure_idle_timeout``, not pinned, not busy, quiet on the GPU; the failing kernel left
out), for the bytes the failed allocation asked for plus the pressure threshold's share of the
GPU (so the retry fits and leaves the GPU out of pressure), else for the bytes alone; when the
error does not say how much, every idle kernel there that make-room may take. Nothing is
released when even that would not fit, or when the allocation would pass the kernel's own
memory cap (the cap is the cause). Each release is an ordinary automatic release (its event,
its reason); the cell itself is never run again.

Where this server's idle kernels cannot make the room, what the cell asked for stays wanted on
its GPUs until the kernel holds it (:meth:`..node.gpu_load.GpuLoad.owe`, for at most
``OWED_GRACE``): the release policy counts it as taken, and the node daemon, where there is
one, tells the node's other servers at once, whose memory pressure rules count it too, so that
other people's idle kernels make way for the next try without the hub service.

Where this server's idle kernels cannot make the room and the server is linked to the hub
service (``across``: :meth:`..node.hub_link.HubLink.out_of_memory`), the service is asked to
make it from other people's idle kernels on that GPU, by the same rules across users
(:func:`..policy.crossuser.room_after_oom`); its answer is said instead: on a GPU shared by
many people, the memory is mostly theirs.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import clock, policy
from ..node.placement import placed_gpus
from ..policy.oom import plan
from ..units import format_bytes
from .errors import ControllerError

if TYPE_CHECKING:
    from .controller import Controller
    from .lifecycle import Lifecycle

SETTLE = 1.5  # s the answer waits for the releases it started (the person reruns after it)
#: s the answer waits for the hub service, whose answer comes once its releases are done (the
#: kernel's agent waits 5 s for the answer; the service's releases go on after it)
ACROSS_WAIT = 3.0
#: memory outside this server's kernels is said only above this fraction (1/N) of the GPU
OTHERS_SAID = 16
_asked: set[asyncio.Task[Any]] = set()  # the service's answers still coming, kept referenced

#: asks the hub service for room on the node's GPU: (kernel, gpu, bytes) -> its answer
#: ({"released": kernels, "bytes": ..., "why_not": ...}) or None (no answer)
Across = Callable[[str, int, int], Awaitable["dict[str, Any] | None"]]


async def after_oom(c: Controller, kernel_id: str, gpu: int | None, nbytes: int | None,
                    across: Across | None = None) -> dict[str, Any]:
    """Make room for the next try of ``kernel_id``'s cell, which failed to allocate ``nbytes``
    (None: not said) on the node's ``gpu`` (None: not said). What was done, and the line to
    say under the error (``text``; "" when the kernel's own cap is the cause). A GPU the node
    does not have is a ValueError, before anything changes."""
    total = c.node_room.total_bytes()
    if gpu is not None and gpu not in total:
        raise ValueError(f"gpu must be one of the node's GPUs {sorted(total)}, got {gpu}")
    st = c.get(kernel_id)
    gpus = _gpus_of(c, kernel_id, gpu)
    out: dict[str, Any] = {"gpus": gpus, "released": [], "bytes": 0}
    if not gpus:
        return {**out, "cause": "unknown_gpu",
                "text": "gpushare: which GPU ran out of memory is not known here: nothing released"}
    if _over_own_cap(c, st, gpus, nbytes):
        return {**out, "cause": "cap", "text": ""}
    await c.refresh_quietly()  # the free memory after the failure, not a poll's old reading
    now = clock.now()
    free = c.room.known_free(await c.node_room.read_free(gpus))
    for g in free:  # releases in flight free their bytes: count them as done
        free[g] += c.room.releases_may_take_back(g)
    cands = c.room.room_candidates(kernel_id, now)
    decisions = plan(c.rules, gpus, nbytes, free, total, cands, kernel_id)
    on = _on(gpus)
    if decisions is None:
        if nbytes is not None:  # wanted until the next try holds it: the node's servers weigh it
            c.room.load.owe(kernel_id, gpus, nbytes)
            if c.tell_wanted is not None:
                c.tell_wanted()
        text = _none_text(c, kernel_id, gpus, nbytes, cands, free)
        if across is not None and nbytes is not None:
            return await _ask_across(across, kernel_id, gpus, nbytes, out, text)
        others = _others_text(c, gpus, nbytes, free, total)
        return {**out, "cause": "none", "text": "\n".join(t for t in (text, others) if t)}
    if not decisions:
        asked = f" for the {format_bytes(nbytes)} the cell asked for" if nbytes is not None else ""
        return {**out, "cause": "room",
                "text": f"gpushare: {on} has room now{asked}: run the cell again"}
    by_id = {x.kernel_id: x for x in cands}
    who = _label(c, kernel_id)
    ops, freed = [], 0
    for d in decisions:
        taken = by_id[d.kernel_id]
        reason = (f"making room: kernel {who} ran out of memory on {on}: "
                  f"idle for {taken.idle_seconds:.0f} s")
        try:
            ops.append(c.release_automatically(d.kernel_id, reason))
        except ControllerError:
            continue  # taken meanwhile (an operation started, pinned): the rest still go
        out["released"].append(d.kernel_id)
        freed += sum(taken.gpu_bytes.get(g, 0) for g in gpus)
    out["bytes"] = freed
    if not ops:
        return {**out, "cause": "none", "text": _none_text(c, kernel_id, gpus, nbytes, cands, free)}
    done, _ = await asyncio.wait({op.task for op in ops}, timeout=SETTLE)
    failed = [why for t in done if (why := _failure(t)) is not None]
    n = len(ops)
    kernels = f"{n} idle kernel{'s' if n != 1 else ''} ({format_bytes(freed)})"
    if len(failed) == n:
        return {**out, "cause": "failed",
                "text": f"gpushare: {on} was short of memory: releasing {kernels} failed "
                        f"({failed[0][:200]}): nothing freed"}
    verb = "released" if len(done) == n and not failed else "releasing"
    return {**out, "cause": "released",
            "text": f"gpushare: {on} was short of memory: {verb} {kernels}: run the cell again"}


async def _ask_across(across: Across, kernel_id: str, gpus: list[int], nbytes: int,
                      out: dict[str, Any], own: str) -> dict[str, Any]:
    """This server could not make the room: the hub service is asked, GPU by GPU; what it
    released is said, else why not after this server's own reason."""
    released, freed, why, going = 0, 0, [], []
    for g in gpus:
        task = asyncio.ensure_future(across(kernel_id, g, nbytes))
        _asked.add(task)
        task.add_done_callback(_asked.discard)
        try:
            answer = await asyncio.wait_for(asyncio.shield(task), ACROSS_WAIT)
        except asyncio.TimeoutError:
            going.append(g)  # its releases go on: the next try finds the room
            continue
        if answer is None:
            why.append(f"gpushare: the hub service did not answer for GPU {g}")
            continue
        released += answer["released"]
        freed += answer["bytes"]
        if not answer["released"] and answer["why_not"]:
            why.append(f"gpushare: the hub service made no room on GPU {g}: {answer['why_not']}")
    out = {**out, "across": {"released": released, "bytes": freed}}
    if going:
        return {**out, "cause": "releasing",
                "text": f"gpushare: {_on(gpus)} was short of memory: the hub service is releasing "
                        "idle kernels of other people: run the cell again in a moment"}
    if released:
        kernels = f"{released} idle kernel{'s' if released != 1 else ''} of other people"
        return {**out, "cause": "released",
                "text": f"gpushare: {_on(gpus)} was short of memory: the hub service released "
                        f"{kernels} ({format_bytes(freed)}): run the cell again"}
    return {**out, "cause": "none", "text": "\n".join([own, *why])}


def _others_text(c: Controller, gpus: list[int], nbytes: int | None, free: dict[int, int],
                 total: dict[int, int]) -> str:
    """Without the hub service: where memory this server's kernels do not hold would have made
    the room (other people's kernels, programs outside this server), say so, and who could
    release it: a person alone on a shared GPU otherwise reads that nothing could be done.
    With the node daemon, the node's other servers were told what the cell asked for
    (:meth:`..node.gpu_load.GpuLoad.owe`): each releases its own idle kernels for it by its
    memory pressure rule at its next poll."""
    if c.tell_wanted is not None and nbytes is not None:
        who = (f"the node's other gpushare servers were told that this kernel wants "
               f"{format_bytes(nbytes)} more there; each releases its own kernels idle for "
               f"{c.config.pressure_idle_timeout:.0f} s or more to make it, within seconds: "
               "run the cell again in a moment")
    else:
        who = ("this server releases only its own kernels; under JupyterHub, the gpushare hub "
               "service also releases other people's idle ones")
    lines = []
    for g in gpus:
        rec = c.tracker.gpus.get(g)
        if rec is None or not rec.history or g not in free or g not in total:
            continue
        used = total[g] - free[g]
        mine = sum(k.gpu_bytes.get(g, 0) for k in c.tracker.kernels.values())
        others = used - mine
        # not what the driver keeps for itself (a few hundred MiB a GPU), nor memory that
        # would not have made the room anyway
        if others <= total[g] // OTHERS_SAID or (nbytes is not None and free[g] + others < nbytes):
            continue
        lines.append(f"gpushare: other processes hold {format_bytes(others)} of GPU {g} (other "
                     f"people's kernels, or programs outside this server): {who}")
    return "\n".join(lines)


def _failure(task: asyncio.Future[Any]) -> str | None:
    """Why a finished release failed (None: it released); a task that was cancelled (the
    server stopping) or raised counts as failed, so the answer is still given."""
    if task.cancelled():
        return "stopped"
    if task.exception() is not None:
        return str(task.exception()) or type(task.exception()).__name__
    outcome = task.result()
    return None if outcome.ok else outcome.message


def _gpus_of(c: Controller, kernel_id: str, gpu: int | None) -> list[int]:
    """The GPUs to make room on: the one the error named when it is the kernel's (or the
    kernel's GPUs are not known), else every GPU the kernel was placed on or holds memory on."""
    rec = c.tracker.kernels.get(kernel_id)
    mine = set(placed_gpus(c.tracker.km, kernel_id))
    mine |= {g for g, n in (rec.gpu_bytes if rec is not None else {}).items() if g >= 0 and n}
    if gpu is not None and (not mine or gpu in mine):
        return [gpu]
    return sorted(mine)


def _over_own_cap(c: Controller, st: Lifecycle, gpus: list[int], nbytes: int | None) -> bool:
    """The allocation would pass the kernel's own memory cap (unknown bytes under a cap: the
    cap may be why, so nobody else is released for it)."""
    cap = c.memory_cap(st)
    if cap is None:
        return False
    if nbytes is None:
        return True
    rec = c.tracker.kernels.get(st.kernel_id)
    held = rec.gpu_bytes if rec is not None else {}
    return any(held.get(g, 0) + nbytes > cap for g in gpus)


def _none_text(c: Controller, kernel_id: str, gpus: list[int], nbytes: int | None,
               cands: list[policy.Candidate], free: dict[int, int]) -> str:
    """Why nothing is released, per GPU: idle kernels that hold too little, or none idle
    (and what the others there are doing)."""
    cfg = c.config
    lines = []
    for g in gpus:
        pool = [x for x in cands if x.gpu_bytes.get(g) and policy.may_take_for_room(x, cfg)]
        if pool and nbytes is not None:
            held = sum(x.gpu_bytes[g] for x in pool)
            lines.append(f"gpushare: GPU {g} is short of memory: {format_bytes(free.get(g, 0))} "
                         f"free and {format_bytes(held)} in idle kernels would not hold the "
                         f"{format_bytes(nbytes)} the cell asked for: nothing released")
            continue
        why = Counter(_kept_why(c, k, cfg, cands) for k, rec in c.tracker.kernels.items()
                      if k != kernel_id and rec.gpu_bytes.get(g))
        if not why:
            lines.append(f"gpushare: GPU {g} is short of memory and no other kernel of this "
                         "server holds memory there")
            continue
        n = sum(why.values())
        counts = ", ".join(f"{v} {k}" for k, v in why.most_common())
        lines.append(f"gpushare: GPU {g} is short of memory and no idle kernel there can be "
                     f"released ({n} kernel{'s' if n != 1 else ''}: {counts})")
    return "\n".join(lines)


def _kept_why(c: Controller, kernel_id: str, cfg: Any, cands: list[policy.Candidate]) -> str:
    """One word on why make-room keeps a kernel: "active", "pinned", ..."""
    cand = next((x for x in cands if x.kernel_id == kernel_id), None)
    if cand is None:
        st = c.states.get(kernel_id)
        return "being moved" if st is not None and st.op is not None else "refused lately"
    if cand.pinned:
        return "pinned"
    if not cand.resident:
        return "being moved"
    used = cand.max_utilization if cand.pressure_utilization is None else cand.pressure_utilization
    if cand.busy or cand.idle_seconds < cfg.pressure_idle_timeout or used > cfg.idle_utilization:
        return "active"
    if policy.effective_idle_timeout(cand.idle_timeout, cfg.idle_timeout) == 0:
        return "never released"
    if not cand.releasable:
        return "without a release method"
    return "too small" if cand.bytes < cfg.min_release_bytes else "kept"


def _label(c: Controller, kernel_id: str) -> str:
    """The kernel as a person knows it: its notebook's name, else its id's start."""
    rec = c.tracker.kernels.get(kernel_id)
    path = rec.path if rec is not None else ""
    return os.path.basename(path) if path else kernel_id[:8]


def _on(gpus: list[int]) -> str:
    return ("GPU " if len(gpus) == 1 else "GPUs ") + ", ".join(map(str, gpus))
