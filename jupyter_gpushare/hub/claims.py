"""A server's status checked against what the service measures itself. Pure.

What a server reports about its own kernels is a claim. On a GPU the service measures:

- a kernel's processes count only when they run and belong to the server's own user, and
  each process counts for one kernel only (a server cannot borrow another user's kernel, or
  one of its own twice);
- the GPU memory a kernel holds is what its processes hold, measured;
- a waiting restore is believed only when the state it would bring back is in that kernel's
  processes (their host memory, plus at most one CUDA context: a release frees the context
  and a restore builds it again) and fits the GPU. Anything else is refused with the reason,
  which only that user sees.

A GPU the service does not measure itself is checked the same way against that node's daemon
(:mod:`.daemons`); one nobody measures (no daemon, or one that does not answer) keeps the
server's numbers: there the claims are bounded only by the user's share and what unused
claims cost them.
"""

from __future__ import annotations

from dataclasses import replace

from ..node.measure import Measured
from ..sim.node import format_bytes
from .snapshot import KernelSnap, Snapshot


def check(user: str, snap: Snapshot, measured: Measured | None,
          taken: set[tuple[str, int]]) -> tuple[Snapshot, dict[str, str]]:
    """``snap`` with measured numbers in place of claimed ones, and the waiting restores it
    claims that are not believed (kernel id -> why). ``measured``: the node as the service
    measures it, or as the node daemon does (then keyed by this server's own pids).
    ``taken``: processes already counted for another kernel of this user (updated)."""
    if measured is None:
        return snap, {}
    uuids = {g.index: g.uuid for g in snap.gpus if g.uuid in measured.gpus}
    if not uuids:
        return snap, {}
    kernels, refused = [], {}
    for k in snap.kernels:
        owned = [p for p in dict.fromkeys(k.pids)
                 if (proc := measured.procs.get(p)) is not None and proc.owner == user]
        mine = [p for p in owned if measured.key(p) not in taken]
        taken.update(measured.key(p) for p in mine)
        on_gpu = dict(k.gpu_bytes)
        for index, uuid in uuids.items():
            n = sum(measured.pids.get(p, {}).get(uuid, 0) for p in mine)
            if n:
                on_gpu[index] = n
            else:
                on_gpu.pop(index, None)
        why = _doubt(user, k, owned, mine, measured, uuids) if k.restore_need and k.waiting else None
        if why:
            refused[k.id] = why
        kernels.append(replace(k, gpu_bytes=on_gpu, pids=mine,
                               restore_need={} if why else dict(k.restore_need)))
    return replace(snap, kernels=kernels), refused


def _doubt(user: str, k: KernelSnap, owned: list[int], mine: list[int], measured: Measured,
           uuids: dict[int, str]) -> str | None:
    """Why the waiting restore of ``k`` is not believed (None: it is)."""
    on_measured = {i: n for i, n in k.restore_need.items() if i in uuids}
    if not on_measured:
        return None  # it needs GPUs this service does not see
    if not mine:
        if not k.pids:
            return "its server names no process for it"
        if owned:
            return "its processes are counted for another of its server's kernels"
        if all(measured.procs.get(p) is None or measured.procs[p].owner is None for p in k.pids):
            return "none of the processes its server names runs on this node"
        return f"the processes its server names are not {user}'s"
    host = sum(measured.procs[p].host_bytes or 0 for p in mine)
    for index, n in sorted(on_measured.items()):
        total = measured.gpus[uuids[index]][0]
        if total is not None and n > total:
            return f"it needs {format_bytes(n)}, more than GPU {index} has"
        if n > host + measured.context_bytes:
            return (f"it needs {format_bytes(n)} on GPU {index}, but its processes hold only "
                    f"{format_bytes(host)} in host memory")
    return None
