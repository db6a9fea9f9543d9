"""``gpushare-hub``: every user's gpushare server, plus the JupyterHub service across them.

One more subclass of :class:`~jupyter_gpushare.simulate.policies.GPUShare`. A restore that
cannot get room from its own server's kernels is pushed to the service at once, which makes
room from other people's kernels on that GPU by calling
:func:`jupyter_gpushare.policy.crossuser.make_room` unchanged (the policy's rules across users,
plus fair shares from :mod:`jupyter_gpushare.policy.fairshare`), with candidates built as
``GPUShare.candidate`` builds them. The releases then run in turn, as the service's do.

A cell that ran out of memory where its own server's idle kernels cannot make room for its
next try is pushed too: the service makes room from other people's idle kernels on that GPU by
:func:`jupyter_gpushare.policy.crossuser.room_after_oom`, unchanged, and the releases start
at once (:meth:`GPUShareHub.oom_across_users`).

A restore ahead of a cell is not pushed: it takes room only from its own server's
kernels, below every cell's restore. Each server's release policy counts the expected need of
every user's placed, not-yet-allocated kernels on its machine as wanted memory (the service
tells each server what the others placed at its refresh after the service read the placing
server: :meth:`GPUShareHub.knows_placed`), not only its own. Placement and restore views
count another server's placed kernel from when the service has read that server (the
service's room and pending, asked at each placement: :meth:`GPUShareHub.sees_placed`): the
placing server tells it at its first poll after the placement (``POST api/placed``).
Registered in ``settings.POLICIES`` as ``gpushare-hub``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from ..policy import crossuser
from ..policy.fairshare import Ledger, parse_table, shares_of
from .engine import RELEASED, RESIDENT, Kernel, Simulation
from .policies import GPUShare


class GPUShareHub(GPUShare):
    name = "gpushare-hub"

    def __init__(self, config: Any, poll_interval: float = 2.0, seed: int = 0,
                 over_share_idle_timeout: float = 30.0, shares: dict[str, object] | None = None,
                 service_poll: float = 10.0, hub_refresh: float = 30.0, **release: Any):
        """``release``: :class:`GPUShare`'s ``release_policy``, ``long_idle``, ``ahead_grace``,
        ``move_after`` (its own server moves a restore that has waited that long, before the
        service is asked)."""
        super().__init__(config, poll_interval, seed, **release)
        self.hub = crossuser.HubPolicy(config, over_share_idle_timeout)
        self.shares = parse_table(shares or {})  # keys "u0", "u1", ... (users by index)
        self.service_poll = service_poll  # the service's poll_interval (its default: 10 s)
        self.hub_refresh = hub_refresh  # a server's refresh of the service's answer (default 30 s)
        self.read: dict[int, float] = {}  # kernel index -> when the service has read its server since

    def on_idle(self, sim: Simulation, k: Kernel) -> None:
        """Besides its own server's checks: the service's poll serves waiting restores on
        ``k``'s GPU once ``k`` may be taken for them (pushes were served when they came)."""
        super().on_idle(sim, k)
        for wait in {self.config.pressure_idle_timeout, self.hub.over_share_idle_timeout}:
            due = k.last_activity + wait
            tick = math.ceil(due / self.service_poll - 1e-9) * self.service_poll
            for g in k.gpus:
                sim.schedule(max(tick, sim.now), partial(self._service_poll, sim, g))

    def knows_placed(self, sim: Simulation, user: int, other: Kernel) -> bool:
        """Its own, and other users' once the service has told this server (its answer's
        ``placed_elsewhere``, the service's room and pending count)."""
        return (super().knows_placed(sim, user, other)
                or self.read.get(other.index, math.inf) + self.hub_refresh <= sim.now)

    def sees_placed(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """What ``k``'s server knows, and other users' placed kernels once the service has read
        their server: a placement asks the service's room and pending, which count them."""
        return (super().sees_placed(sim, k, other)
                or self.read.get(other.index, math.inf) <= sim.now)

    def sees_returning(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """Every server's: the service's room, asked at each placement, counts every released
        kernel's state on the node."""
        return True

    def place_at_start(self, sim: Simulation, k: Kernel) -> list[int]:
        """Besides its own server's check: the placing server's status lists ``k`` from its
        next poll (a kernel takes a moment to start), when it tells the service, which reads
        it at once (the service's own polls see it no sooner); every other server on the
        machine hears of ``k``'s expected need at its next refresh after that
        (``GPUShareHubLink.refresh_interval``), and checks then."""
        gpus = super().place_at_start(sim, k)
        read = self.next_poll(k.user_index, sim.now + 1e-6)
        self.read[k.index] = read
        for user in self.neighbours(sim, k.user_index, sim.node_gpus(gpus[0]) if gpus else range(0)):
            self.schedule_check(sim, user, read + self.hub_refresh)
        return gpus

    def _service_poll(self, sim: Simulation, gpu: int) -> None:
        for waiting in list(self.waiting.get(gpu, ())):
            self._try_restore(sim, waiting)

    def _try_restore(self, sim: Simulation, k: Kernel) -> None:
        if k.pending is None:  # a restore ahead of a cell: its own server's room only
            super()._try_restore(sim, k)
            return
        if k.index in self.making_room or k.state != RELEASED:
            return
        super()._try_restore(sim, k)  # its own server first: restore, or make room among its own
        if k.index in self.making_room or k.state != RELEASED or k not in self.waiting.get(k.gpu, ()):
            return
        plan = self._across_users(sim, k)  # it waits: its server pushes, the service decides
        if not plan.enough or not plan.victims:
            # nothing to release for it (too little across users, or the free memory it
            # lacks is a release's in flight): it waits; its server re-checks at every
            # poll, and so does this
            return
        self._stop_waiting(k)
        by_id = {o.id: o for o in sim.kernels}
        self.making_room.add(k.index)
        self._release_in_turn(sim, [(by_id[v.kernel_id], v.reason) for v in plan.victims], k)

    def oom_across_users(self, sim: Simulation, k: Kernel, nbytes: int, free: dict[int, int],
                         total: dict[int, int]) -> None:
        """Its server asks the service (``POST api/oom``), which releases other people's idle
        kernels for the next try of ``k``'s cell by the rule, unchanged; free memory as the
        server counted it (releases in flight as done: the service's own reading does not
        count them, and its landing counts restores in flight, which this leaves out)."""
        ledger, holdings = self._ledger(sim, k)
        plan = crossuser.room_after_oom(f"u{k.user_index}", {g: nbytes for g in k.gpus}, free,
                                        total, holdings, ledger, self.hub)
        by_id = {o.id: o for o in sim.kernels}
        for v in plan.victims if plan.enough else []:
            if by_id[v.kernel_id].state == RESIDENT:
                sim.release(by_id[v.kernel_id], v.reason)

    def _ledger(self, sim: Simulation, k: Kernel) -> tuple[Ledger, list[crossuser.Holding]]:
        """Fair shares on ``k``'s machine and every kernel on ``k``'s GPUs, as the service's
        view gives them."""
        on_gpu = [o for o in sim.kernels if o.alive and set(o.gpus) & set(k.gpus)]
        holdings = [crossuser.Holding(f"u{o.user_index}", self.candidate(sim, o)) for o in on_gpu]
        usage: dict[str, dict[int, int]] = {}
        for o in on_gpu:
            if o.state == RESIDENT:
                per = usage.setdefault(f"u{o.user_index}", {})
                for g in o.gpus:
                    per[g] = per.get(g, 0) + o.nbytes
        gpus = sim.node_gpus(k.gpu)
        ledger = Ledger(
            gpu_total={g: sim.node.gpus[g].capacity for g in gpus},
            node_of={g: str(gpus.start) for g in gpus},
            usage=usage,
            shares={u: shares_of(u, [], self.shares) for u in {*usage, f"u{k.user_index}"}},
            enabled=bool(self.shares),
        )
        return ledger, holdings

    def _across_users(self, sim: Simulation, k: Kernel) -> crossuser.Plan:
        ledger, holdings = self._ledger(sim, k)
        # what other restores will still put there: room the service already made for
        # restores that have not started (a restore in flight here holds its bytes already)
        landing: dict[int, int] = {}
        for o in (sim.kernels[i] for i in self.making_room):
            if o is not k and o.state == RELEASED:
                for g in o.gpus:
                    landing[g] = landing.get(g, 0) + o.nbytes
        return crossuser.make_room(f"u{k.user_index}", {g: k.nbytes for g in k.gpus},
                                   {g: sim.node.free(g) for g in k.gpus}, holdings, ledger, self.hub,
                                   landing=landing)

    def describe(self) -> str:
        shares = f", shares {len(self.shares)}" if self.shares else ""
        return (super().describe().replace("gpushare:", "gpushare-hub:", 1)
                + f", make-room across users after {self.config.pressure_idle_timeout:.0f} s idle{shares}")
