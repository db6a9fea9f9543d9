"""The hub service's core: discover servers, read them, keep one view, make room across users.

- **Poll** (every ``poll_interval``): the Hub lists the ready servers; each server's status is
  read through the proxy; one :class:`~.view.NodeView` is built; time-integrated figures
  (GPU-hours reclaimed, history) advance; restores seen waiting get room made for them (the
  fallback when a push did not arrive).
- **Push** (a server says a restore waits): that server and every server with kernels on
  the GPUs it needs are read again at once, then room is made. About a second, not a poll.
- **Make room**: :func:`jupyter_gpushare.policy.crossuser.make_room` decides (the policy's rules
  across users, plus shares); each victim is released through its own server's REST with
  ``if_idle_for``, so its server checks again, with live data, that nobody working is taken.
  One decision at a time per GPU. The victims' releases run side by side; one that fails is
  logged and the others go on.
- **Out of memory** (a server says a cell failed to allocate and its own idle kernels cannot
  make room for the next try): the same, by
  :func:`~jupyter_gpushare.policy.crossuser.room_after_oom`, for the bytes the cell asked for
  (the server's word, at most the GPU's memory; once per ``OOM_ROOM_EVERY`` s per kernel; not
  while the user's claims are paused; room made and not used within ``claim_grace`` pauses
  them, as for a restore).

**Trust.** A server runs as its user, who may change it: its status is a claim. Where the
service runs on the node it measures the GPUs and the kernels' processes itself
(:mod:`.measure`) and checks every status against that (:mod:`.claims`): its own free memory
and per-person usage win, a waiting restore counts only when its state is in that user's
processes, and room made for a restore that then does not use it within
``claim_grace`` pauses that user's claims (``claim_penalty``, doubling while it repeats): an
unused claim costs its user, never others. Answers to a server name no other user or kernel.
Where it does not run on the node (a hub pod), it asks that node's daemon (:mod:`.daemons`) and
checks the same way; a daemon that does not answer leaves its GPUs in the weaker mode (the
servers' word, bounded by shares), said on the admin page and in the metrics.

**Slow servers.** Every server is read in a task of its own, one at a time per server. Room
for someone waits for other users' servers at most ``read_deadline``, and not at all for a
server that was slow the last time: its last status stands in, its kernels are released only
when no prompt server's can make the room, and its own release, if needed, is its own wait.

One server's failure (stopped, restarting, answering garbage) is logged once and shown; it
never stops the loop or the others. Time goes through :func:`now` (tests move the clock).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from .. import clock, policy
from ..core.ahead import AHEAD_TEXT
from ..node.measure import Measured, Meter
from ..policy import crossuser
from ..policy import placement as rule
from ..policy.fairshare import Share, cap_of, shares_of
from ..states import RESIDENT
from ..units import format_bytes
from . import claims
from .daemons import Ask, NodeDaemons
from .hubapi import HubAPI, HubAPIError
from .metrics import HubMetrics
from .snapshot import Snapshot, parse_status
from .view import GpuIds, NodeView, Placed, ServerRef

log = logging.getLogger(__name__)

HISTORY = 720  # samples kept per GPU for the admin page's chart
RECENT = 200  # actions kept for the admin page
#: s: room is made at most this often for the cells of one kernel that ran out of memory (a
#: person reruns a cell after reading the error; a loop that retries at once gets no more)
OOM_ROOM_EVERY = 10.0
STRIKES_FORGOTTEN = 3600.0  # s without an unused claim before a user's pauses start short again
MAX_PAUSE = 3600.0  # s: the longest pause of a user's claims
ANOTHER = "another user's idle kernel"  # all a server is told of whose kernel made its room


def _ahead(placed: Placed) -> bool:
    """Its restore runs ahead of a cell (the person is back in the notebook; no cell waits)."""
    return (placed.kernel.waiting or "").startswith(AHEAD_TEXT)


def now() -> float:
    """The service's one clock (replaceable: tests advance ``jupyter_gpushare.clock``)."""
    return clock.now()


@dataclass
class ServerEntry:
    ref: ServerRef
    snap: Snapshot | None = None
    error: str | None = None
    since: float = 0.0  # when it was first seen
    restores_seen: dict[str, int] = field(default_factory=dict)  # kernel -> restores counted
    refused: dict[str, str] = field(default_factory=dict)  # kernel -> why its wait is not believed
    task: asyncio.Task[None] | None = None  # the read in flight
    slow: bool = False  # its last read took longer than the read deadline


@dataclass
class Settings:
    shares: dict[str, Share]
    policy: crossuser.HubPolicy
    admin_url: str = "/services/gpushare/"
    read_deadline: float = 1.0  # s room for someone waits for other users' servers' statuses
    claim_grace: float = 120.0  # s a restore given room has to land
    claim_penalty: float = 600.0  # s a user's claims pause after an unused one (0: never)
    load_window: float = 120.0  # s of SM history a GPU's load is the mean of (0: the last reading)
    server_memory: int = 1 << 30  # bytes a new server is expected to need on a GPU of its node
    caps: dict[str, int] = field(default_factory=dict)  # the admin's caps per kernel (fairshare)


@dataclass
class Wait:
    since: float
    why: str | None = None
    pushed: bool = False
    polls: int = 0  # polls that saw it
    last_try: float | None = None


@dataclass
class Served:
    """Room made for one restore (or for a cell's next try after it ran out of memory): it must
    land (be allocated) within the grace, or it costs its user."""

    at: float
    uuids: dict[str, int]  # GPU uuid -> bytes it needed
    pids: list[int]  # its processes (checked ones where measured)
    measured: bool  # every GPU it needs is measured
    released: int  # bytes released for it


@dataclass
class Strikes:
    count: int = 0
    last: float = 0.0
    until: float = 0.0  # its claims are not served before this


class Coordinator:
    def __init__(self, api: HubAPI, settings: Settings, metrics: HubMetrics | None = None,
                 poll_interval: float = 10.0, meter: Meter | None = None, measuring: str = "",
                 daemons: NodeDaemons | None = None):
        self.api = api
        self.meter = meter
        self.daemons = daemons
        self.remote: dict[tuple[str, str], Measured] = {}  # a server's reading by its node's daemon
        self.remote_gpus: dict[str, Measured] = {}  # GPU uuid -> its node daemon's reading
        self.measuring = measuring  # what measures the node, or why nothing does
        self.measured: Measured | None = None
        self.measure_error: str | None = None
        self._measure_lock = asyncio.Lock()
        self.served: dict[tuple[str, str, str], Served] = {}
        #: (user, server, kernel) -> when room was last made for a cell of it that ran out of memory
        self.oom_served: dict[tuple[str, str, str], float] = {}
        self.strikes: dict[str, Strikes] = {}
        self.poll_interval = poll_interval
        self.settings = settings
        self.metrics = metrics or HubMetrics()
        self.entries: dict[tuple[str, str], ServerEntry] = {}
        self.groups: dict[str, list[str]] = {}
        self.ids = GpuIds()
        self.view = NodeView([], self.ids, now())
        self.history: dict[str, deque[tuple[float, int | None, int, float | None]]] = {}
        self.reclaimed_hours: dict[str, float] = {}
        self.waits: dict[tuple[str, str, str], Wait] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.discovery_error: str | None = None
        self._gpu_locks: dict[int, asyncio.Lock] = {}
        self._poll_lock = asyncio.Lock()
        self._push_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._last_poll: float | None = None
        self._last_discovery = -1e9  # clock.monotonic() of the last unscheduled discovery
        self.released_for_others = 0
        self.spawns: deque[dict[str, Any]] = deque(maxlen=RECENT)  # servers' nodes as ranked

    # -- reading the servers -------------------------------------------------------------------
    async def poll_once(self) -> None:
        """Discover, read every server, rebuild the view, then serve waiting restores."""
        async with self._poll_lock:
            started = clock.monotonic()
            await self._discover()
            # a slow server is not waited for: its read lands for a later round
            await self._refresh(list(self.entries.values()), self._read_timeout(), wait_slow=False)
            await self._measure()
            self._rebuild(integrate=True)
            self.metrics.poll_seconds.observe(clock.monotonic() - started)
        # the fallback for waits no push served: seen by an earlier poll too (a push, about a
        # second, always comes first), and not tried in the last poll interval
        t = now()
        for placed in self.view.waiting():
            wait = self.waits.get((placed.ref.user, placed.ref.name, placed.kernel.id))
            if wait is None or wait.polls < 2:
                continue
            if wait.last_try is None or t - wait.last_try >= self.poll_interval:
                await self._serve(placed, "poll")

    async def _discover(self) -> None:
        try:
            refs = await self.api.ready_servers()
        except Exception as e:  # the Hub restarting: keep what we knew, try again next time
            if self.discovery_error != str(e):
                log.warning("gpushare hub: cannot list servers: %s", e)
            self.discovery_error = str(e)
            return
        self.discovery_error = None
        seen = {r.key: r for r in refs}
        for key in set(self.entries) - set(seen):
            log.info("gpushare hub: server %s stopped", _name(key))
            del self.entries[key]
        for key, ref in seen.items():
            entry = self.entries.get(key)
            if entry is None or entry.ref.url != ref.url:
                self.entries[key] = ServerEntry(ref, since=now())
            else:
                entry.ref = ref
            self.groups[ref.user] = ref.groups

    def _read_timeout(self) -> float:
        return float(getattr(self.api, "timeout", 10.0)) + 1.0

    def _start_read(self, entry: ServerEntry) -> asyncio.Task[None]:
        """The server's read in flight, or a new one: never two at once for one server."""
        if entry.task is None or entry.task.done():
            entry.task = asyncio.ensure_future(self._read(entry))
        return entry.task

    async def _refresh(self, entries: list[ServerEntry], within: float, wait_slow: bool = True) -> None:
        """Read ``entries``, each in its own task; wait for them at most ``within`` seconds,
        and not at all for a server that was slow last time (unless ``wait_slow``)."""
        tasks = [(e, self._start_read(e)) for e in entries]
        waited = [t for e, t in tasks if wait_slow or not e.slow]
        if waited:
            await asyncio.wait(waited, timeout=within)

    async def _read(self, entry: ServerEntry) -> None:
        """Read one server; its failure is its own (logged once, shown, never acted on)."""
        started = clock.monotonic()
        try:
            raw = await self.api.status(entry.ref)
            snap = parse_status(raw, now())
        except (HubAPIError, ValueError) as e:
            entry.slow = clock.monotonic() - started > self.settings.read_deadline
            self._failed(entry, str(e))
            return
        except Exception as e:  # anything else a server can do to us
            entry.slow = clock.monotonic() - started > self.settings.read_deadline
            self._failed(entry, f"{type(e).__name__}: {e}")
            return
        entry.slow = clock.monotonic() - started > self.settings.read_deadline
        if entry.error is not None:
            log.info("gpushare hub: server %s answers again", _name(entry.ref.key))
        entry.snap, entry.error = snap, None
        self._count_restores(entry, snap)

    def _failed(self, entry: ServerEntry, why: str) -> None:
        if entry.error != why:
            log.warning("gpushare hub: server %s: %s", _name(entry.ref.key), why[:300])
        entry.snap, entry.error = None, why[:300]

    def _count_restores(self, entry: ServerEntry, snap: Snapshot) -> None:
        seen = {}
        for k in snap.kernels:
            before = entry.restores_seen.get(k.id)
            seen[k.id] = k.restores
            if before is not None and k.restores > before:
                self.metrics.restores.inc(k.restores - before)
                if k.last_restore_seconds is not None:
                    self.metrics.restore_seconds.observe(k.last_restore_seconds)
        entry.restores_seen = seen

    async def _measure(self) -> None:
        """The service's own reading of the node (in a thread: NVML and SQLite block), and the
        node daemons' of the GPUs it does not measure."""
        async with self._measure_lock:
            await self._measure_here()
            await self._ask_daemons()

    async def _measure_here(self) -> None:
        if self.meter is None:
            return
        pids = {p for e in self.entries.values() if e.snap is not None for k in e.snap.kernels
                for p in k.pids}
        users = set(self.groups) | {key[0] for key in self.entries}
        try:
            self.measured = await asyncio.to_thread(self.meter.read, pids, users)
        except Exception as e:  # keep going on the servers' word, bounded by shares
            if self.measure_error != str(e):
                log.warning("gpushare hub: cannot measure the node: %s", e)
            self.measure_error, self.measured = str(e)[:300], None
            return
        if self.measure_error is not None:
            log.info("gpushare hub: measuring the node again")
        self.measure_error = None

    async def _ask_daemons(self) -> None:
        """Every server whose GPUs this service does not measure, checked at its node's daemon."""
        if self.daemons is None:
            return
        here = set(self.measured.gpus) if self.measured is not None else set()
        asks = []
        for key, e in self.entries.items():
            if e.snap is None:
                continue
            uuids = {g.uuid for g in e.snap.gpus if g.uuid}
            if uuids and not uuids & here:
                asks.append(Ask(key, e.snap.node, uuids,
                                list(dict.fromkeys(p for k in e.snap.kernels for p in k.pids))))
        users = sorted(set(self.groups) | {key[0] for key in self.entries})
        self.remote, self.remote_gpus = await self.daemons.read(asks, users)

    def measured_for(self, key: tuple[str, str]) -> Measured | None:
        """What a server's claims are checked against: its node's daemon's reading, or the
        service's own."""
        return self.remote.get(key, self.measured)

    def _measured_gpus(self) -> Measured | None:
        """One reading of every GPU measured, by the service or by a node daemon (the view's)."""
        if not self.remote_gpus:
            return self.measured
        here = self.measured
        gpus = dict(here.gpus) if here is not None else {}
        owners = {u: here.owned(u) for u in gpus} if here is not None else {}
        for uuid, m in self.remote_gpus.items():
            if uuid not in gpus:
                gpus[uuid] = m.gpus[uuid]
                owners[uuid] = m.owned(uuid)
        return Measured(now(), "merged", gpus, {}, {}, owners=owners)

    def check_of(self, uuid: str, node: str) -> tuple[str | None, str | None]:
        """(who measures GPU ``uuid``, or None; why nobody does): the admin page's and the
        metric's word on whether servers' claims there are checked."""
        if self.measured is not None and uuid in self.measured.gpus:
            return "the service", None
        if uuid in self.remote_gpus:
            return f"the node daemon of {self.remote_gpus[uuid].node}", None
        if self.daemons is not None and not self.daemons.off:
            return None, self.daemons.why_not(uuid, node)
        why = self.measuring if self.meter is None else "the service does not measure this GPU"
        if self.daemons is not None:
            why = f"{why}; {self.daemons.off}"
        return None, why

    def _rebuild(self, integrate: bool = False) -> None:
        t = now()
        snaps = []
        taken: dict[str, set[tuple[str, int]]] = {}
        for e in self.entries.values():
            if e.snap is None:
                e.refused = {}
                continue
            snap, refused = claims.check(e.ref.user, e.snap, self.measured_for(e.ref.key),
                                         taken.setdefault(e.ref.user, set()))
            for kid in set(refused) - set(e.refused):  # each refused wait once, logged and counted
                self.metrics.claims.labels("refused").inc()
                log.warning("gpushare hub: %s's server claims a waiting restore of kernel %s; not "
                            "believed: %s", _name(e.ref.key), kid, refused[kid])
            e.refused = refused
            snaps.append((e.ref, snap))
        self.view = NodeView(snaps, self.ids, t, self._measured_gpus())
        if integrate:
            self._integrate(t)
        self._note_waits(t, integrate)
        self._settle(t)
        self._export(integrate)

    # -- claims served, and what an unused one costs ------------------------------------------------
    def _settle(self, t: float) -> None:
        """Room made for a restore that has landed is done with; one that has not after
        ``claim_grace`` costs its user."""
        for key, served in list(self.served.items()):
            if self._used(key, served) or self._ended(key, served):
                del self.served[key]
            elif t - served.at >= self.settings.claim_grace:
                del self.served[key]
                self._strike(key, served, t)

    def _ended(self, key: tuple[str, str, str], served: Served) -> bool:
        """The kernel is gone: its server no longer lists it and none of its processes runs.
        A restore that landed and whose kernel was then shut down between two readings (a
        second) must not count as unused: that struck honest people who ran one cell and
        closed the notebook. What a kernel that ends unused cost others stays bounded by the
        checks on its claim (real host memory of that user's own processes)."""
        if self.view.find(*key) is not None:
            return False
        return not any(psutil.pid_exists(pid) for pid in served.pids)

    def _used(self, key: tuple[str, str, str], served: Served) -> bool:
        measured = self.measured_for(key[:2])
        if served.measured and measured is not None:  # measured: the bytes are back on a GPU
            # (any GPU: a restore may land on another one than the room was made on)
            back = sum(sum(measured.pids.get(p, {}).values()) for p in served.pids)
            return 2 * back >= max(served.uuids.values(), default=0)
        placed = self.view.find(*key)
        return placed is not None and placed.kernel.state in RESIDENT

    def _strike(self, key: tuple[str, str, str], served: Served, t: float) -> None:
        user = key[0]
        st = self.strikes.get(user)
        if st is None or t - st.last > STRIKES_FORGOTTEN:
            st = self.strikes[user] = Strikes()
        st.count += 1
        st.last = t
        pause = min(MAX_PAUSE, self.settings.claim_penalty * 2 ** (st.count - 1))
        st.until = t + pause
        why = (f"room made {t - served.at:.0f} s ago ({format_bytes(served.released)} released) "
               f"was not used")
        self.metrics.claims.labels("unused").inc()
        log.warning("gpushare hub: %s's kernel %s: %s; no room is made for %s's kernels "
                    "for %.0f s", user, key[2], why, user, pause)
        self.recent.appendleft({"t": round(t, 3), "action": "claim unused", "user": user,
                                "server": key[1], "kernel": key[2], "bytes": served.released,
                                "reason": f"{why}; claims paused for {pause:.0f} s"})

    def paused(self, user: str) -> float:
        """Seconds left before room is made again for ``user``'s restores (0: now)."""
        st = self.strikes.get(user)
        return max(0.0, st.until - now()) if st is not None else 0.0

    def _integrate(self, t: float) -> None:
        """History and GPU-hours reclaimed (released bytes / GPU memory, over time)."""
        dt = 0.0 if self._last_poll is None else max(0.0, t - self._last_poll)
        self._last_poll = t
        for gpu in self.view.gpus.values():
            hist = self.history.setdefault(gpu.uuid, deque(maxlen=HISTORY))
            hist.append((t, gpu.used, gpu.held, gpu.utilization))
            if gpu.total and gpu.released_bytes and dt:
                hours = min(1.0, gpu.released_bytes / gpu.total) * dt / 3600
                self.reclaimed_hours[gpu.uuid] = self.reclaimed_hours.get(gpu.uuid, 0.0) + hours
                self.metrics.reclaimed.labels(gpu.uuid, gpu.node).inc(hours)

    def _note_waits(self, t: float, poll: bool) -> None:
        current = {(p.ref.user, p.ref.name, p.kernel.id) for p in self.view.waiting()}
        for key in set(self.waits) - current:
            del self.waits[key]
        for key in current - set(self.waits):
            self.waits[key] = Wait(t)
            self.metrics.waits.inc()
        if poll:
            for key in current:
                self.waits[key].polls += 1
        self.metrics.waiting.set(len(current))

    def _export(self, full: bool) -> None:
        m = self.metrics
        for gpu in self.view.gpus.values():
            labels = (gpu.uuid, gpu.node)
            if gpu.total is not None:
                m.memory_total.labels(*labels).set(gpu.total)
            if gpu.used is not None:
                m.memory_used.labels(*labels).set(gpu.used)
            if gpu.utilization is not None:
                m.utilization.labels(*labels).set(gpu.utilization)
            m.held.labels(*labels).set(gpu.held)
            m.released.labels(*labels).set(gpu.released_bytes)
            m.checked.labels(*labels).set(int(self.check_of(gpu.uuid, gpu.node)[0] is not None))
        if full:
            ledger = self.view.ledger(self.settings.shares, self.groups)
            m.user_memory.clear()
            m.user_over.clear()
            m.user_over_cap.clear()
            for user, per in ledger.usage.items():
                m.user_memory.labels(user).set(sum(per.values()))
                m.user_over.labels(user).set(int(any(ledger.over(user, g) for g in per)))
            over_cap: dict[str, int] = {}
            for p in self.view.placed:
                over_cap[p.ref.user] = over_cap.get(p.ref.user, 0) + bool(p.kernel.over_cap)
            for user, n in over_cap.items():
                m.user_over_cap.labels(user).set(n)
            ok = sum(1 for e in self.entries.values() if e.error is None)
            m.servers.labels("ok").set(ok)
            m.servers.labels("error").set(len(self.entries) - ok)

    # -- a push from a server ----------------------------------------------------------------
    async def on_push(self, user: str, server: str, kernel_ids: Iterable[str]) -> dict[str, Any]:
        """A server of ``user`` says restores of ``kernel_ids`` wait. Only that server's own
        kernels are considered (a push cannot name someone else's), and only what its status,
        read now, says is waiting."""
        lock = self._push_locks.setdefault((user, server), asyncio.Lock())
        async with lock:  # one at a time per server: a flood of pushes queues, it does not fan out
            return await self._on_push(user, server, kernel_ids)

    async def _caller(self, user: str, server: str) -> ServerEntry | None:
        """The calling server's entry; the Hub asked again (at most once a second) for one
        not known yet: a server started since the last poll."""
        entry = self.entries.get((user, server))
        if entry is None and clock.monotonic() - self._last_discovery > 1.0:
            self._last_discovery = clock.monotonic()
            await self._discover()
            entry = self.entries.get((user, server))
        return entry

    async def _on_push(self, user: str, server: str, kernel_ids: Iterable[str]) -> dict[str, Any]:
        entry = await self._caller(user, server)
        if entry is None:
            return {"released": [], "waits": {}, "me": self.me(user, server=server)}
        await self._read(entry)  # its own server, read now: its own time
        await self._measure()
        self._rebuild()
        released: list[dict[str, Any]] = []
        waits: dict[str, str] = {}
        for kid in dict.fromkeys(kernel_ids):
            if kid in entry.refused:
                waits[kid] = f"no room is made for it from other people's kernels: {entry.refused[kid]}"
                continue
            placed = self.view.find(user, server, kid)
            if placed is None or not placed.need:
                continue
            wait = self.waits.get((user, server, kid))
            if wait is not None:
                wait.pushed = True
            done, why = await self._serve(placed, "push")
            released += done
            if why:
                waits[kid] = why
        return {"released": released, "waits": waits, "me": self.me(user, server=server)}

    async def on_placed(self, user: str, server: str) -> None:
        """A server of ``user`` placed a kernel that has not used its GPUs yet: that server is
        read now, not at the next poll, so that a kernel placed next on its node, by any
        server, counts it (room and pending). Only the caller's own server is read, and
        nothing is released: what it says is what its status says, as at a poll."""
        await self.on_push(user, server, ())

    async def on_out_of_memory(self, user: str, server: str, kernel_id: str, uuid: str,
                               nbytes: int) -> dict[str, Any]:
        """A cell of ``kernel_id``, a kernel of ``user``'s ``server``, failed to allocate
        ``nbytes`` on GPU ``uuid``, and its server's own idle kernels could not make room for
        its next try: room is made from other people's idle kernels there
        (:func:`crossuser.room_after_oom`). Only the caller's own kernel, on a GPU its server
        has, and at most once per :data:`OOM_ROOM_EVERY` s per kernel; the bytes are the
        server's word (at most the GPU's memory), as a waiting restore's need is.
        {"released": [...], "why_not": text or None}."""
        lock = self._push_locks.setdefault((user, server), asyncio.Lock())
        async with lock:  # one at a time per server, as pushes are
            released, why = await self._on_out_of_memory(user, server, kernel_id, uuid, nbytes)
        return {"released": released, "why_not": why}

    async def _on_out_of_memory(self, user: str, server: str, kernel_id: str, uuid: str,
                                nbytes: int) -> tuple[list[dict[str, Any]], str | None]:
        entry = await self._caller(user, server)
        if entry is None:
            return [], "the service does not know this server yet"
        key = (user, server, kernel_id)
        last = self.oom_served.get(key)
        if last is not None and now() - last < OOM_ROOM_EVERY:
            return [], f"room was made for this kernel less than {OOM_ROOM_EVERY:.0f} s ago"
        pause = self.paused(user)
        if pause:
            return [], (f"room made for an earlier restore of yours was not used: no room is made "
                        f"for you from other people's kernels for another {pause:.0f} s")
        await self._read(entry)  # its own server, read now: a kernel started since is listed
        self._rebuild()
        gpu = next((g for g in self.view.gpus.values() if g.uuid == uuid), None)
        placed = self.view.find(user, server, kernel_id)
        if placed is None:
            return [], "the service does not know this kernel"
        if gpu is None or entry.ref.key not in gpu.index:
            return [], "the service does not know that GPU on this server's node"
        need = {gpu.gid: min(nbytes, gpu.total) if gpu.total else nbytes}
        lock = self._gpu_locks.setdefault(gpu.gid, asyncio.Lock())
        async with lock:
            late = await self._read_around(set(need), entry.ref.key)
            gpu = self.view.gpus.get(gpu.gid, gpu)
            if gpu.free is None:
                return [], "the GPU's free memory is not known to the service"
            holdings = self._prompt(self.view.holdings(), late)
            plan = crossuser.room_after_oom(
                user, need, {gpu.gid: gpu.free}, {gpu.gid: gpu.total or 0}, holdings,
                self.view.ledger(self.settings.shares, self.groups), self.settings.policy,
                {gpu.gid: f"GPU {gpu.index.get(entry.ref.key, gpu.gid)}"},
                self._landing_on(need))
            if not plan.enough:
                return [], plan.why_not or None
            if not plan.victims:
                return [], "the GPU has room for it now"
            t = now()
            self.oom_served = {k: at for k, at in self.oom_served.items() if t - at < OOM_ROOM_EVERY}
            self.oom_served[key] = t
            released = await self._release_victims(plan, user, "oom", None)
            if released:  # room made for a claim: it must be used, as a restore's must land
                self.served[key] = Served(t, {gpu.uuid: need[gpu.gid]}, list(placed.kernel.pids),
                                          gpu.measured, sum(d["bytes"] for d in released))
                self._rebuild()
            return released, None if released else "the releases to make room failed"

    # -- placing new kernels and servers --------------------------------------------------------------
    def load(self, uuid: str) -> float:
        """A GPU's SM load (%): the mean of its history over ``load_window``."""
        hist = self.history.get(uuid)
        gpu = next((g for g in self.view.gpus.values() if g.uuid == uuid), None)
        last = float(gpu.utilization or 0.0) if gpu is not None else 0.0
        if not hist or self.settings.load_window <= 0:
            return last
        t = now()
        since = max(t - self.settings.load_window, hist[0][0])  # a history younger than the window
        return rule.window_mean(((h[0], h[3]) for h in hist), since, t)

    def gpu_views(self, user: str) -> dict[int, rule.GpuView]:
        """Every GPU as the placement rule sees it for a new kernel of ``user``: room (free
        memory less what every server's kernels will still bring there, each kernel once: a
        released kernel's held state, or a waiting restore's need; a restoring kernel's bytes
        not landed yet; and what kernels placed there and not using it yet are expected to
        allocate, each server's claim at most the GPU's memory), load over the window, kernels
        placed there by any server and not yet computing (their expected load), kernels there,
        kernels computing, and the user's share; and the room now, without the released states
        (what a kernel starting now may allocate). A placed kernel that allocated since its
        server was last read counts twice until the next read: placement then looks elsewhere a
        little early, which the asking server's own, fresher room does not repeat."""
        ledger = self.view.ledger(self.settings.shares, self.groups)
        ledger.shares[user] = shares_of(user, self.groups.get(user, []), self.settings.shares)
        out = {}
        for gid, gpu in self.view.gpus.items():
            free = gpu.free
            room = None if free is None else free - gpu.returning - gpu.placed_claims()
            out[gid] = rule.GpuView(gid, room, self.load(gpu.uuid), gpu.pending * rule.PENDING_LOAD,
                                    gpu.kernels, gpu.busy, not ledger.over(user, gid),
                                    room_now=None if free is None else free - gpu.placed_claims())
        return out

    async def rank_nodes(self, user: str, gpus: int = 1, memory: int | None = None,
                         spawner: str = "", steerable: bool = False) -> list[dict[str, Any]]:
        """The nodes this service knows, best first for a new server of ``user`` whose kernels
        take ``gpus`` GPUs of ``memory`` bytes each (else ``server_memory``), by the rule
        kernels are placed by (room, load, the user's share). Numbers only: nobody is named.
        Remembers who asked and whether their spawner can be steered (the admin page)."""
        await self._measure()
        self._rebuild()
        views = self.gpu_views(user)
        need = rule.Need(self.settings.server_memory if memory is None else memory)
        groups = {node: [views[g.gid] for g in members]
                  for node, members in self.view.nodes().items()}
        out = []
        for node in rule.rank_groups(groups, need, gpus):
            best = rule.rank(groups[node], need)[:gpus]
            out.append({
                "node": node,
                "fits": len(best) == gpus and all(rule.fits(v, need) for v in best),
                "within_share": all(v.within_share for v in best),
                "contended": any(rule.contended(v) for v in best),
                "load": round(max((v.expected for v in best), default=0.0), 1),
                "room": min((v.room for v in best if v.room is not None), default=None),
                "gpus": len(groups[node]),
            })
        self.spawns.appendleft({"t": round(now(), 3), "user": user, "spawner": spawner[:100],
                                "steerable": steerable, "node": out[0]["node"] if out else None})
        return out

    async def rooms(self, user: str, uuids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Room for a new kernel of ``user`` on each GPU of ``uuids`` the service knows, as it
        sees the node: free memory (its own reading where it measures) less what every
        server's kernels will still bring there, each kernel once, placed ones included
        (:meth:`gpu_views`); the same without the released states that will come back
        (``room_now``: what a kernel starting now may allocate); and whether ``user`` is within
        their share there. Numbers only: nothing names anyone.

        Those bytes are the servers' claims; a false one can only steer placement away from a
        GPU (never release or refuse anything), and placement reads free memory too."""
        await self._measure()
        self._rebuild()
        views = self.gpu_views(user)
        by_uuid = {gpu.uuid: gpu for gpu in self.view.gpus.values()}
        out: dict[str, dict[str, Any]] = {}
        for uuid in dict.fromkeys(uuids):
            gpu = by_uuid.get(uuid)
            if gpu is None:
                continue
            v = views[gpu.gid]
            out[uuid] = {"room": v.room, "within_share": v.within_share, "load": round(v.load, 1),
                         "pending": gpu.pending, "kernels": v.kernels, "busy": v.busy,
                         "room_now": v.room_now}
        return out

    # -- making room ------------------------------------------------------------------------------
    async def _serve(self, placed: Placed, trigger: str) -> tuple[list[dict[str, Any]], str | None]:
        """Make room for one waiting restore; (what was released, why not)."""
        gids = sorted(placed.need)
        locks = [self._gpu_locks.setdefault(g, asyncio.Lock()) for g in gids]
        for lock in locks:
            await lock.acquire()
        try:
            return await self._serve_locked(placed, trigger)
        finally:
            for lock in reversed(locks):
                lock.release()

    async def _serve_locked(self, placed: Placed, trigger: str) -> tuple[list[dict[str, Any]], str | None]:
        user, server, kid = placed.ref.user, placed.ref.name, placed.kernel.id
        wait = self.waits.get((user, server, kid))
        pause = self.paused(user)
        if pause:
            said = (f"room made for an earlier restore of yours was not used: no room is made for "
                    f"your restores from other people's kernels for another {pause:.0f} s")
            if wait is not None:
                wait.why, wait.last_try = said, now()
            return [], said
        # fresh numbers from everyone on those GPUs: decisions on live data, not a poll's; the
        # others' servers are waited for at most read_deadline, a slow one not at all
        own = self.entries.get(placed.ref.key)
        late = await self._read_around(set(placed.need), placed.ref.key, own)
        fresh = self.view.find(user, server, kid)
        if fresh is None or not fresh.need or not fresh.kernel.waiting:
            return [], None  # it got its room meanwhile (or is gone, or is not believed)
        if _ahead(fresh):  # a restore ahead of a cell ranks below every cell's restore
            cells = {g for p in self.view.waiting() if p is not fresh and not _ahead(p)
                     for g in p.need if g in fresh.need}
            if cells:
                first = ("a cell's restore waits for room on "
                       + ", ".join(f"GPU {self.view.gpus[g].index.get(fresh.ref.key, g)}"
                                   for g in sorted(cells) if g in self.view.gpus)
                       + " first; a restore ahead of your next cell comes after it")
                if wait is not None:
                    wait.why, wait.last_try = first, now()
                return [], first
        free = {g: self.view.gpus[g].free for g in fresh.need if g in self.view.gpus}
        known = {g: f for g, f in free.items() if f is not None}
        names = {g: f"GPU {self.view.gpus[g].index.get(fresh.ref.key, g)}" for g in fresh.need
                 if g in self.view.gpus}
        ledger = self.view.ledger(self.settings.shares, self.groups)
        holdings = self.view.holdings()
        prompt = self._prompt(holdings, late)
        landing = self._landing(fresh)
        plan = crossuser.make_room(user, fresh.need, known, prompt, ledger, self.settings.policy, names,
                                   landing)
        if not plan.enough and late:  # only then a slow server's kernels, and its wait
            plan = crossuser.make_room(user, fresh.need, known, holdings, ledger, self.settings.policy,
                                       names, landing)
        if wait is not None:
            wait.last_try = now()
        released: list[dict[str, Any]] = []
        if not plan.enough or not plan.victims:  # no room to make, or room there already
            why = plan.why_not or None
        else:
            released = await self._release_victims(plan, user, trigger, wait)
            if released:
                self._served(fresh, sum(d["bytes"] for d in released))
                self._rebuild()
            why = None if released else "the releases to make room failed; retrying"
        if wait is not None:
            wait.why = why
        return released, why

    async def _read_around(self, gids: set[int], key: tuple[str, str],
                           own: ServerEntry | None = None) -> set[tuple[str, str]]:
        """Fresh numbers from every other server with kernels on ``gids`` (and ``own``, the
        asking server, at the same time), then the node measured and the view rebuilt:
        decisions on live data, not a poll's. The others are waited for at most
        ``read_deadline``, a slow one not at all; returns those still late."""
        others = [self.entries[k] for k in self.view.servers_on(gids) if k in self.entries and k != key]
        await asyncio.gather(self._read(own) if own is not None else asyncio.sleep(0),
                             self._refresh(others, self.settings.read_deadline, wait_slow=False))
        await self._measure()
        self._rebuild()
        return {e.ref.key for e in others if e.slow or (e.task is not None and not e.task.done())}

    def _prompt(self, holdings: list[crossuser.Holding], late: set[tuple[str, str]]
                ) -> list[crossuser.Holding]:
        """``holdings`` (in the view's order) but those of servers still ``late``."""
        return [h for h, p in zip(holdings, self.view.placed, strict=True) if p.ref.key not in late]

    async def _release_victims(self, plan: crossuser.Plan, requester: str, trigger: str,
                               wait: Wait | None) -> list[dict[str, Any]]:
        """Release ``plan``'s victims side by side, each through its own server; what was
        released (a victim gone from the view, or whose release was refused, is left out)."""
        jobs = [(owner, victim) for victim in plan.victims
                if (owner := self.view.owner(victim.kernel_id)) is not None]
        done = await asyncio.gather(*(self._release_victim(owner, victim, requester, trigger, wait)
                                      for owner, victim in jobs))
        return [d for d in done if d is not None]

    def _landing(self, placed: Placed) -> dict[int, int]:
        """Per GPU ``placed`` needs, what other restores will still take there that its free
        memory does not show (:meth:`_landing_on`)."""
        return self._landing_on(placed.need, placed)

    def _landing_on(self, gids: Iterable[int], placed: Placed | None = None) -> dict[int, int]:
        """Per GPU of ``gids``, what restores other than ``placed`` will still take there that
        its free memory does not show: every server's restores in flight (their reserved bytes
        not landed yet, as each server says; an older server says nothing), and the needs of
        other restores this service made room for that still wait (their room is theirs:
        counted free, it would be promised twice). Each restore once: a served one that has
        started is in its server's reserved bytes, no longer waiting."""
        out = {g: self.view.gpus[g].restoring for g in gids if g in self.view.gpus}
        for other in self.view.waiting():
            key = (other.ref.user, other.ref.name, other.kernel.id)
            if other is placed or key not in self.served:
                continue
            for g, n in other.need.items():
                if g in out:
                    out[g] += n
        return out

    def _served(self, placed: Placed, nbytes: int) -> None:
        key = (placed.ref.user, placed.ref.name, placed.kernel.id)
        uuids = {self.view.gpus[g].uuid: n for g, n in placed.need.items() if g in self.view.gpus}
        measured = bool(uuids) and all(self.view.gpus[g].measured for g in placed.need if g in self.view.gpus)
        before = self.served.get(key)
        self.served[key] = Served(before.at if before else now(), uuids, list(placed.kernel.pids),
                                  measured, nbytes + (before.released if before else 0))

    async def _release_victim(self, owner: Placed, victim: crossuser.Victim, requester: str,
                              trigger: str, wait: Wait | None) -> dict[str, Any] | None:
        try:
            code, body = await self.api.release(owner.ref, victim.kernel_id, victim.idle_for)
        except HubAPIError as e:
            code, body = 0, {"message": str(e)}
        nbytes = sum(victim.bytes.values())
        entry: dict[str, Any] = {"t": round(now(), 3), "action": "release", "user": owner.ref.user,
                 "server": owner.ref.name, "kernel": victim.kernel_id, "for": requester,
                 "bytes": nbytes, "reason": victim.reason, "trigger": trigger}
        if code != 200:
            why = str(body.get("message") or code)[:300]
            log.info("gpushare hub: could not release %s of %s for %s: %s", victim.kernel_id,
                     owner.ref.user, requester, why)
            self.metrics.releases.labels("refused" if code == 409 else "failed").inc()
            self.recent.appendleft({**entry, "action": "release refused", "reason": why})
            return None
        seconds = None if wait is None else max(0.0, now() - wait.since)
        self.metrics.releases.labels("ok").inc()
        self.metrics.released_bytes.inc(nbytes)
        self.released_for_others += 1
        if seconds is not None:
            self.metrics.room_seconds.labels(trigger).observe(seconds)
        log.info("gpushare hub: released %s of %s's kernel %s for %s (%s)",
                 format_bytes(nbytes), owner.ref.user, victim.kernel_id, requester,
                 victim.reason)
        self.recent.appendleft({**entry, "seconds": None if seconds is None else round(seconds, 3)})
        return {"what": ANOTHER, "bytes": nbytes}  # the requester learns no name, no kernel id

    # -- admin actions -----------------------------------------------------------------------------
    async def admin_action(self, user: str, server: str, kernel_id: str, action: str,
                           pinned: bool = False) -> tuple[int, dict]:
        entry = self.entries.get((user, server))
        if entry is None:
            return 404, {"message": f"no server {_name((user, server))} is running"}
        try:
            if action == "release":
                code, body = await self.api.release(entry.ref, kernel_id, None)
            else:
                code, body = await self.api.pin(entry.ref, kernel_id, pinned)
        except HubAPIError as e:
            return 502, {"message": f"the server did not answer: {e}"}
        self.recent.appendleft({"t": round(now(), 3), "action": f"admin {action}", "user": user,
                                "server": server, "kernel": kernel_id, "code": code,
                                "reason": body.get("message") if code != 200 else None})
        await self._read(entry)
        await self._measure()
        self._rebuild()
        return code, body

    # -- what people see -------------------------------------------------------------------------
    def me(self, user: str, admin: bool = False, server: str | None = None) -> dict[str, Any]:
        """One person's share and usage, by GPU UUID; asked by one of their servers (``server``,
        its name), also what the other servers' kernels placed on its node's GPUs and not
        using them yet are expected to take there (``placed_elsewhere``: numbers only; the
        servers' claims, see :meth:`NodeView.placed_elsewhere`)."""
        ledger = self.view.ledger(self.settings.shares, self.groups)
        shares = shares_of(user, self.groups.get(user, []), self.settings.shares)
        ledger.shares[user] = shares  # someone with no server or kernel yet
        usage, guaranteed = {}, {}
        over = False
        for gid, gpu in self.view.gpus.items():
            usage[gpu.uuid] = ledger.used(user, gid)
            pair = ledger.guaranteed(user, gid) if ledger.enabled else None
            if pair is not None:
                guaranteed[gpu.uuid] = pair[0]
            over |= ledger.over(user, gid)
        share = None
        if ledger.enabled and shares:
            share = " or ".join(f"{s.describe()} ({s.source})" for s in shares)
        cap = cap_of(user, self.groups.get(user, []), self.settings.caps)
        out = {"user": user, "admin": admin, "admin_url": self.settings.admin_url if admin else None,
               "share": share, "usage": usage, "guaranteed": guaranteed, "over_share": over,
               "cap": cap}
        if server is not None:
            out["placed_elsewhere"] = self.view.placed_elsewhere((user, server))
        return out

    def admin_view(self) -> dict[str, Any]:
        """Everything the admin page shows."""
        t = now()
        ledger = self.view.ledger(self.settings.shares, self.groups)
        nodes: dict[str, list[dict[str, Any]]] = {}
        # by node, then as people number them: GPU 0, GPU 1, ...
        for gpu in sorted(self.view.gpus.values(),
                          key=lambda g: (g.node, -1 if g.local_index is None else g.local_index, g.uuid)):
            hist = list(self.history.get(gpu.uuid, ()))
            load = self.load(gpu.uuid)
            checked_by, unchecked = self.check_of(gpu.uuid, gpu.node)
            nodes.setdefault(gpu.node, []).append({
                "checked_by": checked_by, "unchecked": unchecked,
                "load": round(load, 1), "kernels": gpu.kernels, "computing": gpu.busy,
                "contended": rule.contended(rule.GpuView(gpu.gid, None, load, busy=gpu.busy)),
                "uuid": gpu.uuid, "index": gpu.local_index, "name": gpu.name, "memory_total": gpu.total,
                "memory_used": gpu.used, "held": gpu.held, "utilization": gpu.utilization,
                "released_bytes": gpu.released_bytes, "by_user": dict(sorted(gpu.by_user.items())),
                "reclaimed_gpu_hours": round(self.reclaimed_hours.get(gpu.uuid, 0.0), 4),
                "history": {"t": [round(h[0] - t, 1) for h in hist], "used": [h[1] for h in hist],
                            "held": [h[2] for h in hist], "utilization": [h[3] for h in hist]},
            })
        users: dict[str, dict[str, Any]] = {}
        for key, entry in sorted(self.entries.items()):
            u = users.setdefault(key[0], {"name": key[0], "servers": [], "kernels": []})
            u["servers"].append({"name": key[1], "url": entry.ref.url, "error": entry.error,
                                 "slow": entry.slow,
                                 "age_seconds": None if entry.snap is None else round(t - entry.snap.at, 1)})
        for p in self.view.placed:
            k = p.kernel
            users[p.ref.user]["kernels"].append({
                "server": p.ref.name, "id": k.id, "path": k.path, "state": k.state,
                "pinned": k.pinned, "busy": k.busy, "utilization": k.utilization,
                "idle_seconds": round(k.idle_seconds + (0 if k.busy else p.age), 1),
                "gpus": [{"uuid": self.view.gpus[g].uuid, "bytes": n} for g, n in p.gpu_bytes.items()],
                "released_bytes": k.released_bytes, "waiting": k.waiting, "error": k.error,
                "memory_cap": k.memory_cap, "over_cap": k.over_cap,
                "claim_refused": self.entries[p.ref.key].refused.get(k.id) if p.ref.key in self.entries else None,
            })
        for name, u in users.items():
            me = self.me(name)
            u.update(share=me["share"], over_share=me["over_share"], cap=me["cap"],
                     usage_bytes=sum(me["usage"].values()),
                     claims_paused_seconds=round(self.paused(name), 1))
        waits = [{"user": u, "server": s, "kernel": k, "seconds": round(t - w.since, 1),
                  "why": w.why, "pushed": w.pushed} for (u, s, k), w in self.waits.items()]
        return {
            "now": round(t, 3),
            "discovery_error": self.discovery_error,
            "measured": {"by": self.measuring if self.meter is not None else None,
                         "why_not": None if self.meter is not None else self.measuring,
                         "error": self.measure_error,
                         "daemons": None if self.daemons is None else {
                             "off": self.daemons.off or None,
                             "nodes": [{"node": d.node, "address": d.address, "error": d.error,
                                        "seconds": None if d.seconds is None else round(d.seconds, 4),
                                        "gpus": len(d.uuids)}
                                       for d in sorted(self.daemons.nodes.values(), key=lambda d: d.node)]}},
            "shares": bool(ledger.enabled),
            "nodes": [{"name": n, "gpus": g} for n, g in nodes.items()],
            "spawns": list(self.spawns)[:20],
            "users": list(users.values()),
            "waits": waits,
            "recent": list(self.recent)[:50],
            "totals": {
                "reclaimed_gpu_hours": round(sum(self.reclaimed_hours.values()), 4),
                "released_for_others": self.released_for_others,
                "waiting": len(waits),
            },
        }


def _name(key: tuple[str, str]) -> str:
    return f"{key[0]}/{key[1]}" if key[1] else key[0]


def hub_policy(pressure_idle_timeout: float, over_share_idle_timeout: float, idle_utilization: float,
               min_release_bytes: int) -> crossuser.HubPolicy:
    return crossuser.HubPolicy(
        policy.PolicyConfig(idle_utilization=idle_utilization, min_release_bytes=min_release_bytes,
                            pressure_idle_timeout=pressure_idle_timeout),
        over_share_idle_timeout=over_share_idle_timeout)
