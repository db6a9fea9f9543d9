"""One view of every GPU of every node, keyed by GPU UUID, built from the servers' snapshots.

A GPU UUID is unique across machines, so one service covers a whole cluster: servers on
the same machine report the same UUIDs, and what each user holds on a GPU is summed over
all their servers. A *node* is a set of GPUs that some server sees together (a machine, as
far as the servers can tell); per-node shares count a person's memory on all of them.

A GPU the service measures itself (:mod:`.measure`) takes its memory figures and what each
person holds there from that reading, never from a server. On any other GPU the servers'
readings are combined by their median (of an even number, the higher middle one), so one
server's late or false reading cannot outvote the others'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .. import policy
from ..node.measure import Measured
from ..policy.crossuser import Holding
from ..policy.fairshare import Ledger, Share, shares_of
from ..states import RESIDENT
from .snapshot import KernelSnap, Snapshot

#: the windows are the servers' own: what they report is already judged over them
_WINDOWS_JUDGED = policy.PolicyConfig()
BUSY_SM = 5.0  # % SM above which a kernel counts as computing on its GPUs (idle_utilization's default)


def _constant(used: float) -> Callable[[float], float]:
    """A utilization the server judged already: the same over any window."""
    return lambda _since: used


class GpuIds:
    """A small int per GPU UUID, stable for the service's life (the policy's GPU keys)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def __call__(self, uuid: str) -> int:
        if uuid not in self._ids:
            self._ids[uuid] = len(self._ids)
        return self._ids[uuid]


@dataclass
class ServerRef:
    """A ready server as the Hub lists it."""

    user: str
    name: str  # "" for the default server
    url: str  # its path on the proxy, e.g. /user/alice/
    groups: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.user, self.name)


@dataclass
class Placed:
    """One kernel of one server, with its GPUs as node-wide ids."""

    ref: ServerRef
    kernel: KernelSnap
    gpu_bytes: dict[int, int]  # gid -> bytes resident now
    need: dict[int, int]  # gid -> bytes a waiting restore needs
    age: float  # seconds since its server's snapshot


@dataclass
class GPUState:
    gid: int
    uuid: str
    name: str
    node: str
    index: dict[tuple[str, str], int]  # server key -> its index for this GPU
    total: int | None = None
    used: int | None = None
    utilization: float | None = None
    released_bytes: int = 0  # held in host memory by released kernels, all servers
    #: bytes every server's kernels will still bring onto it, each kernel once (room = free
    #: less this): a restoring kernel's landed bytes are in used, not counted again
    returning: int = 0
    #: of those, what every server's restores in flight reserved there and has not landed yet
    #: (not in used yet); a server before restoring_bytes adds nothing
    restoring: int = 0
    at: float = 0.0  # time of the snapshot the numbers come from
    by_user: dict[str, int] = field(default_factory=dict)  # resident bytes per person
    measured: bool = False  # the numbers are the service's own reading
    kernels: int = 0  # kernels of every server there: resident, or placed and not yet using it
    pending: int = 0  # of those, placed there and not yet using it (placement counts their load)
    busy: int = 0  # kernels computing there at their servers' last reading
    #: per server, the bytes its kernels counted in ``pending`` are expected to allocate
    #: there (its ``placed_bytes``, at most the GPU's memory): a server that placed none there
    #: claims nothing
    placed_bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def held(self) -> int:
        return sum(self.by_user.values())

    @property
    def local_index(self) -> int | None:
        """The index its servers give it (nvidia-smi's, as people name GPUs): the one most of
        them use (of a tie, the lowest); None before any server reported it."""
        seen = list(self.index.values())
        return min(seen, key=lambda i: (-seen.count(i), i)) if seen else None

    @property
    def free(self) -> int | None:
        if self.total is None or self.used is None:
            return None
        return self.total - self.used

    def placed_claims(self, but: tuple[str, str] | None = None) -> int:
        """The bytes servers' placed kernels are expected to allocate here, each server's
        claim at most the GPU's memory; ``but``: a server left out."""
        return sum(b if self.total is None else min(b, self.total)
                   for k, b in self.placed_bytes.items() if k != but)


class NodeView:
    def __init__(self, snaps: list[tuple[ServerRef, Snapshot]], ids: GpuIds, now: float,
                 measured: Measured | None = None):
        self.now = now
        self.gpus: dict[int, GPUState] = {}
        self.placed: list[Placed] = []
        parent: dict[int, int] = {}
        readings: dict[int, list[tuple[int | None, int | None]]] = {}
        names: dict[int, list[str]] = {}  # a GPU of each server -> the node names servers said

        def root(g: int) -> int:
            while parent.setdefault(g, g) != g:
                g = parent[g]
            return g

        for ref, snap in snaps:
            local = {g.index: ids(g.uuid) for g in snap.gpus if g.uuid}
            for g in snap.gpus:
                if not g.uuid:
                    continue
                gid = local[g.index]
                gpu = self.gpus.setdefault(gid, GPUState(gid, g.uuid, g.name, "", {}))
                gpu.index[ref.key] = g.index
                gpu.released_bytes += g.released_bytes
                # a server before returning_bytes: its released bytes (restoring kernels'
                # whole held state among them) and, below, its waiting restores' needs
                gpu.returning += g.released_bytes if g.returning_bytes is None else g.returning_bytes
                gpu.restoring += g.restoring_bytes or 0
                readings.setdefault(gid, []).append((g.total, g.used))
                if snap.at >= gpu.at:  # the freshest utilization (shown, never acted on)
                    gpu.utilization, gpu.at = g.utilization, snap.at
            gids = sorted(local.values())
            for gid in gids[1:]:
                parent[root(gid)] = root(gids[0])
            names.setdefault(gids[0] if gids else -1, []).append(snap.node)
            older = {local[g.index] for g in snap.gpus if g.uuid and g.returning_bytes is None}
            placed_on: set[int] = set()  # GPUs where this server has kernels placed, not using them
            for k in snap.kernels:
                on = {local[i]: n for i, n in k.gpu_bytes.items() if i in local and n}
                need = {local[i]: n for i, n in k.restore_need.items() if i in local and n}
                self.placed.append(Placed(ref, k, on, need, max(0.0, now - snap.at)))
                for gid, n in need.items() if k.waiting else ():
                    if gid in older:
                        self.gpus[gid].returning += n
                if k.state in RESIDENT or k.state == "untracked":
                    for gid, n in on.items():
                        by_user = self.gpus[gid].by_user
                        by_user[ref.user] = by_user.get(ref.user, 0) + n
                placed_on |= self._count(k, on, [local[i] for i in k.released_gpus if i in local])
            for g in snap.gpus:
                if g.uuid and g.placed_bytes and local[g.index] in placed_on:
                    self.gpus[local[g.index]].placed_bytes[ref.key] = g.placed_bytes
        said: dict[int, list[str]] = {}
        for first_gid, node_said in names.items():
            if first_gid >= 0:
                said.setdefault(root(first_gid), []).extend(node_said)
        node_names = _node_names({g: root(g) for g in self.gpus}, self.gpus, said)
        for gid, gpu in self.gpus.items():
            gpu.node = node_names[root(gid)]
            if measured is not None and gpu.uuid in measured.gpus:
                gpu.total, gpu.used = measured.gpus[gpu.uuid]
                gpu.by_user = measured.owned(gpu.uuid)
                gpu.measured = True
            else:
                gpu.total = _median([t for t, _ in readings.get(gid, [])])
                gpu.used = _median([u for _, u in readings.get(gid, [])])

    def _count(self, k: KernelSnap, on: dict[int, int], listed: list[int]) -> set[int]:
        """A kernel's part in its GPUs' counts: where it holds memory, or where it was placed
        and has not allocated yet (an untracked kernel whose GPUs its server lists); returns
        the GPUs it is placed on and not using yet."""
        placed_only = k.state == "untracked" and not on
        for gid in (listed if placed_only else on):
            gpu = self.gpus.get(gid)
            if gpu is None:
                continue
            gpu.kernels += 1
            gpu.pending += placed_only
            gpu.busy += bool(on) and k.state in RESIDENT and (k.busy or k.utilization > BUSY_SM)
        return {g for g in listed if g in self.gpus} if placed_only else set()

    def nodes(self) -> dict[str, list[GPUState]]:
        """The GPUs of each node, by node name."""
        out: dict[str, list[GPUState]] = {}
        for gpu in self.gpus.values():
            out.setdefault(gpu.node, []).append(gpu)
        return out

    def placed_elsewhere(self, key: tuple[str, str]) -> dict[str, int]:
        """Per GPU UUID of server ``key``'s node, the bytes the *other* servers' kernels placed
        there and not using it yet are expected to allocate (their claims, each at most the
        GPU's memory; numbers only, nobody named). The server counts them as wanted memory: a
        false claim can only have it release its idle kernels a little earlier, under its own
        rules (pressure_idle_timeout, never a kernel at work)."""
        mine = [g for g in self.gpus.values() if key in g.index]
        node = {g.node for g in mine}
        out: dict[str, int] = {}
        for gpu in self.gpus.values():
            if gpu.node not in node:
                continue
            n = gpu.placed_claims(but=key)
            if n > 0:
                out[gpu.uuid] = n
        return out

    # -- people --------------------------------------------------------------------------------
    def usage(self) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for gid, gpu in self.gpus.items():
            for user, n in gpu.by_user.items():
                out.setdefault(user, {})[gid] = n
        return out

    def ledger(self, table: dict[str, Share], groups: dict[str, list[str]]) -> Ledger:
        users = set(groups) | {p.ref.user for p in self.placed}
        return Ledger(
            gpu_total={g: s.total or 0 for g, s in self.gpus.items()},
            node_of={g: s.node for g, s in self.gpus.items()},
            usage=self.usage(),
            shares={u: shares_of(u, groups.get(u, []), table) for u in users},
            enabled=bool(table),
        )

    # -- the policy's input ---------------------------------------------------------------------
    def holdings(self) -> list[Holding]:
        """Every kernel as the cross-user policy sees it, idle time counted to now."""
        out = []
        for p in self.placed:
            k = p.kernel
            out.append(Holding(p.ref.user, policy.observed(
                k.id, _WINDOWS_JUDGED, 0.0,
                resident=k.state in RESIDENT,
                busy=k.busy,
                pinned=k.pinned,
                idle_seconds=k.idle_seconds + (0.0 if k.busy else p.age),
                utilization_since=_constant(k.utilization),
                gpu_bytes=dict(p.gpu_bytes),
                idle_timeout=k.idle_timeout,
                releasable=k.releasable,
                over_cap=k.over_cap is not None,  # as its server judged: released first
            )))
        return out

    def find(self, user: str, server: str, kernel_id: str) -> Placed | None:
        for p in self.placed:
            if p.ref.key == (user, server) and p.kernel.id == kernel_id:
                return p
        return None

    def owner(self, kernel_id: str) -> Placed | None:
        for p in self.placed:
            if p.kernel.id == kernel_id:
                return p
        return None

    def waiting(self) -> list[Placed]:
        return [p for p in self.placed if p.need and p.kernel.waiting]

    def servers_on(self, gids: set[int]) -> set[tuple[str, str]]:
        return {key for gid in gids if gid in self.gpus for key in self.gpus[gid].index}


def _node_names(root_of: dict[int, int], gpus: dict[int, GPUState],
                said: dict[int, list[str]]) -> dict[int, str]:
    """A name per node (a root GPU id): what most of its servers call their machine, else
    one made from its first GPU's UUID; two nodes that would share a name (simulated nodes
    on one host) are told apart by that UUID."""
    out: dict[int, str] = {}
    for gid in sorted(gpus):
        r = root_of[gid]
        if r in out:
            continue
        names = [n for n in said.get(r, []) if n]
        first = min(g for g in gpus if root_of[g] == r)
        fallback = f"node-{gpus[first].uuid[:12]}"
        out[r] = max(sorted(set(names)), key=names.count) if names else fallback
    taken: dict[str, int] = {}
    for r in sorted(out):
        taken[out[r]] = taken.get(out[r], 0) + 1
    for r in sorted(out):
        if taken[out[r]] > 1:
            first = min(g for g in gpus if root_of[g] == r)
            out[r] = f"{out[r]}/{gpus[first].uuid[:12]}"
    return out


def _median(values: list[int | None]) -> int | None:
    """The median of the known values; of an even number, the higher middle one."""
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None
