"""Sharing policies, each a set of decisions the engine asks for.

- ``exclusive``: every user has GPUs of their own, as many as their widest kernel needs (the
  baseline every ratio is against).
- ``static``: each GPU split equally between the users placed on it; a user's kernels may
  hold at most their share.
- ``cull``: shared GPUs; a kernel idle for ``cull_after`` is killed (jupyter_server's
  ``cull_idle_timeout``, checked every ``cull_interval``), its memory freed; the next cell
  starts it again and the work it had run since it started is lost (to be re-run).
- ``gpushare``: shared GPUs; each user's server releases its own idle kernels and restores
  them before their next cell, by calling :mod:`jupyter_gpushare.policy` unchanged, with
  candidates built as :meth:`jupyter_gpushare.core.controller.Controller.candidate` builds them.
  Its release policy: ``proactive`` (release at idle timeout: a kernel idle for
  ``idle_timeout`` is released, its memory ready for whoever comes) or ``needs`` (an idle
  kernel is released only when its GPU needs memory: free below the pressure threshold or a
  restore waiting there, or after ``long_idle``). Restores ahead: when the person works in a
  released kernel's notebook (the engine's activity, ``ahead_lead`` s before their cell), it
  restores it with a cell's room rules (make-room takes only kernels idle past
  ``pressure_idle_timeout``, so never one whose person works), ranked below cells' restores:
  it never takes room a cell's restore waits for, and waits behind them. A kernel restored
  ahead that runs no cell for ``ahead_grace`` s is released again (0: never); a restore
  ahead that found no room within 5 s of the activity is stopped, as the server stops it
  (``core.ahead.ROOM_WAIT``). Migration
  (``move_after``, the product's ``restore_move_after``): a restore whose kernel's own GPUs
  have lacked room for ``move_after`` s goes onto other GPUs of its machine that have it, by
  :func:`jupyter_gpushare.policy.room.move_plan` unchanged (each GPU without room onto the
  one with the most free memory; all of them or none), and the kernel lives there from then
  on (0: never; a restore ahead never moves onto a GPU where a cell's restore waits).

Placement is the simulation's choice, for every sharing policy (``Simulation.placement``):
``round-robin`` (user ``i`` on GPU ``i mod G``, as a hub that gives each user one
``CUDA_VISIBLE_DEVICES`` does; a kernel of ``n`` GPUs takes the next ``n`` of that machine)
or ``load-aware`` (at a kernel's start, the GPUs of its user's machine with the most memory
free after held and reserved bytes, then the least SM load). A node-wide policy (``gpushare-hub``:
make-room across users, fair shares) is one more subclass of :class:`GPUShare` that widens
:meth:`GPUShare.room_candidates` and :meth:`GPUShare.server_kernels`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import cast

from .. import policy as product
from ..core.ahead import ROOM_WAIT as AHEAD_ROOM_WAIT
from ..node.gpu_load import coming_back
from ..policy import placement as rule
from ..policy.oom import plan as room_after_oom
from ..policy.room import lacking
from .defaults import (
    AHEAD_GRACE,
    IDLE_UTILIZATION,
    LONG_IDLE,
    MOVE_AFTER,
    REBALANCE,
    REBALANCE_BEFORE_CELL,
    REBALANCE_IDLE,
    REBALANCE_PER_HOUR,
    RELEASE_POLICY,
    window_of,
)
from .engine import RELEASED, RESIDENT, Kernel, Simulation, reason_kind
from .workload import Workload


class Policy:
    name = "policy"

    def gpu_count(self, workload: Workload, gpus: int) -> int:
        """GPUs this policy runs ``workload`` on, given a node (or nodes) of ``gpus``."""
        return gpus

    def setup(self, sim: Simulation) -> None:
        pass

    @property
    def idle_utilization(self) -> float:
        """SM % at or below which a cell does not count as computing on its GPUs (the
        product's ``idle_utilization``: its tracker's threshold)."""
        return IDLE_UTILIZATION

    def home(self, sim: Simulation, user_index: int) -> int:
        """Round-robin: users take GPUs in turn, each as many as their widest kernel needs
        (user ``i`` on GPU ``i mod G`` where every kernel has one GPU)."""
        return sim.user_offset[user_index] % len(sim.node.gpus)

    def place(self, sim: Simulation, k: Kernel) -> list[int]:
        """Round-robin from the user's turn (:meth:`home`); a kernel of several GPUs on the
        next GPUs of that machine (wrapping around within it)."""
        home = self.home(sim, k.user_index)
        machine = sim.node_gpus(home)
        size = len(machine)
        return [machine.start + (home - machine.start + j) % size for j in range(k.work.gpus)]

    def place_at_start(self, sim: Simulation, k: Kernel) -> list[int]:
        """Where a kernel that starts (or restarts after a cull) now runs: ``room``, the
        product's rule (:func:`jupyter_gpushare.policy.placement.choose`) over its server's
        machine, its device 0 first; ``round-robin``: its user's turn."""
        if sim.placement == "round-robin":
            return k.gpus
        assert k.need is not None
        machine = self.machine(sim, k)
        views = sim.views(machine, exclude=k, seen_by=k)
        return [cast(int, v.gpu) for v in rule.choose(views.values(), k.need, k.work.gpus)]

    def machine(self, sim: Simulation, k: Kernel) -> range:
        """The machine ``k``'s user's server runs on, chosen at its first kernel's start:
        ``servers`` ``rule``, the machine the product's rule ranks first
        (:func:`jupyter_gpushare.policy.placement.rank_groups`, for the user's widest kernel);
        ``round-robin``, the machine of their round-robin turn."""
        m = sim.machine_of.get(k.user_index)
        if m is None:
            if sim.servers == "round-robin":
                m = sim.node_gpus(self.home(sim, k.user_index))
            else:
                assert k.need is not None
                width = max(o.work.gpus for o in sim.by_user[k.user_index])
                groups = {f"{g.start:08d}": list(sim.views(g, exclude=k).values())
                          for g in sim.machines()}
                m = sim.node_gpus(int(rule.rank_groups(groups, k.need, width)[0]))
            sim.machine_of[k.user_index] = m
        return m

    def sees_owed(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """Whether ``k``'s server counts the room ``other``'s failed allocation wants."""
        return other.user_index == k.user_index

    def sees_placed(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """Whether ``k``'s server, placing or restoring ``k``, knows that ``other`` is placed
        and has not allocated yet (its expected bytes and load count in its view)."""
        return True

    def sees_returning(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """Whether ``k``'s server, placing ``k``, counts ``other``'s released state as coming
        back to its GPUs (out of their room)."""
        return True

    def history_seconds(self, load_window: float) -> float:
        """Seconds of SM history the policy judges GPUs over, at most (placement's
        ``load_window``; a rebalancing policy's window may be longer)."""
        return load_window

    def fits(self, sim: Simulation, k: Kernel) -> bool:
        """Whether a kernel starting now gets its memory (else: out of memory)."""
        return sim.fits_now(k)

    def on_idle(self, sim: Simulation, k: Kernel) -> None:
        """A kernel has just finished a cell (or a restore)."""

    def on_needs_gpu(self, sim: Simulation, k: Kernel) -> None:
        """A cell waits for a kernel whose state is not on the GPU."""
        raise AssertionError(f"{self.name} never takes a kernel's state off the GPU")

    def on_memory_freed(self, sim: Simulation, gpu: int) -> None:
        pass

    def on_out_of_memory(self, sim: Simulation, k: Kernel, nbytes: int) -> None:
        """A cell of ``k`` failed to allocate ``nbytes`` more per GPU (the person tries the
        next cell)."""

    def on_activity(self, sim: Simulation, k: Kernel) -> None:
        """The person works in the notebook of ``k``, released: a restore may start ahead."""

    def on_ahead_restored(self, sim: Simulation, k: Kernel) -> None:
        """``k`` was restored ahead of its cell, which has not come yet."""

    def on_allocated(self, sim: Simulation, gpu: int) -> None:
        pass

    def on_compute(self, sim: Simulation, gpus: list[int]) -> None:
        """A cell starts computing on ``gpus``."""

    def before_cell(self, sim: Simulation, k: Kernel) -> bool:
        """A cell arrives for resident ``k``: True when the kernel moves first (the cell
        waits for the move, then starts as after any restore)."""
        return False

    def describe(self) -> str:
        return self.name


class Exclusive(Policy):
    name = "exclusive"

    def gpu_count(self, workload: Workload, gpus: int) -> int:
        return sum(workload.user_gpus().values())  # a user's own, however many that takes

    def place(self, sim: Simulation, k: Kernel) -> list[int]:
        first = sim.user_offset[k.user_index]
        return list(range(first, first + k.work.gpus))

    def place_at_start(self, sim: Simulation, k: Kernel) -> list[int]:
        return k.gpus  # its own GPUs: nothing to choose

    def describe(self) -> str:
        return "exclusive: one GPU per user"


class Static(Policy):
    """Each GPU split equally between the users placed on it."""

    name = "static"

    def setup(self, sim: Simulation) -> None:
        users, gpus = len(sim.workload.users), len(sim.node.gpus)
        self.share = sim.node.gpus[0].capacity // max(1, math.ceil(users / gpus))

    def fits(self, sim: Simulation, k: Kernel) -> bool:
        mine = sum(o.nbytes for o in sim.by_user[k.user_index]
                   if o.state == RESIDENT and set(o.gpus) & set(k.gpus))
        return mine + k.nbytes <= self.share and super().fits(sim, k)

    def describe(self) -> str:
        return "static: each GPU split equally between its users"


class Cull(Policy):
    name = "cull"

    def __init__(self, cull_after: float = 3600.0, cull_interval: float = 300.0):
        self.cull_after = cull_after
        self.cull_interval = cull_interval

    def on_idle(self, sim: Simulation, k: Kernel) -> None:
        due = k.last_activity + self.cull_after
        at = math.ceil(due / self.cull_interval) * self.cull_interval  # the culler's tick
        sim.schedule(at, lambda: self._check(sim, k))

    def _check(self, sim: Simulation, k: Kernel) -> None:
        if k.state == RESIDENT and not k.busy and sim.now - k.last_activity >= self.cull_after:
            sim.cull(k)

    def describe(self) -> str:
        return f"cull: kill kernels idle {self.cull_after:.0f} s (checked every {self.cull_interval:.0f} s)"


RELEASE_POLICIES = ("needs", "proactive")  # the product's default first


class GPUShare(Policy):
    """What each user's jupyter-gpushare server does, one server per user."""

    name = "gpushare"
    #: s a restore ahead may wait for room before the server stops it (a constant of the
    #: server's, not an option: the twin, whose product runs faster, sets it at its scale)
    ahead_room_wait: float = AHEAD_ROOM_WAIT

    def __init__(self, config: product.PolicyConfig, poll_interval: float = 2.0, seed: int = 0,
                 release_policy: str = RELEASE_POLICY, long_idle: float = LONG_IDLE,
                 ahead_grace: float = AHEAD_GRACE, move_after: float = MOVE_AFTER,
                 rebalance: bool = REBALANCE, rebalance_idle: float = REBALANCE_IDLE,
                 rebalance_per_hour: int = REBALANCE_PER_HOUR,
                 rebalance_before_cell: bool = REBALANCE_BEFORE_CELL, node_daemon: bool = False):
        """``node_daemon``: the machines run the node daemon, through which every server hears
        of the others' placed kernels at once (a server's next poll weighs them)."""
        if release_policy not in RELEASE_POLICIES:
            raise ValueError(f"release policy {release_policy!r}: one of "
                             f"{', '.join(RELEASE_POLICIES)}")
        self.config = config
        self.poll_interval = poll_interval
        self.seed = seed
        self.release_policy = release_policy
        self.long_idle = long_idle
        self.ahead_grace = ahead_grace
        if not move_after >= 0:  # NaN too
            raise ValueError(f"move_after {move_after!r}: seconds, 0 (never move) or more")
        self.move_after = move_after
        self.rebalance = rebalance
        self.rebalance_idle = rebalance_idle
        self.rebalance_per_hour = rebalance_per_hour
        self.rebalance_before_cell = rebalance_before_cell
        self.node_daemon = node_daemon

    @property
    def idle_utilization(self) -> float:
        return self.config.idle_utilization

    def setup(self, sim: Simulation) -> None:
        # servers poll on their own clocks, not in step: a phase per user
        self.phase = [random.Random(f"{self.seed}:poll:{u}").uniform(0, self.poll_interval)
                      for u in range(len(sim.workload.users))]
        self.checks: dict[int, set[float]] = {}
        self.waiting: dict[int, list[Kernel]] = {}  # GPU -> kernels whose restore waits for room
        self.waiting_ahead: dict[int, list[Kernel]] = {}  # the same for restores ahead of a cell
        self.making_room: set[int] = set()  # kernels whose restore waits for make-room releases
        self.short_since: dict[int, float] = {}  # kernel -> when its restore first lacked room
        self.rebalancing: set[int] = set()  # machines (first GPU) whose passes are scheduled
        #: s over which rebalance judges load and who computes (the product rebalancer's)
        self.rebalance_window = window_of(self.rebalance_idle, sim.load_window)

    # -- the server's view ----------------------------------------------------------------------
    def server_kernels(self, sim: Simulation, k: Kernel) -> list[Kernel]:
        """The kernels the server that owns ``k`` manages (its tracker's kernels)."""
        return [o for o in sim.by_user[k.user_index] if o.alive]

    def on_out_of_memory(self, sim: Simulation, k: Kernel, nbytes: int) -> None:
        """The kernel's agent asks its server to make room for the next try
        (``core.oom_room``): the product's rule (:func:`jupyter_gpushare.policy.oom.plan`,
        unchanged) over that server's own kernels, free memory counting releases in flight as
        done; where they cannot make the room, the server asks the hub service
        (:meth:`oom_across_users`: none here). Where they cannot, what the cell asked for
        stays wanted until the kernel holds it (``GpuLoad.owe``): this server's next poll
        weighs it, and with the node daemon (told at once) every server's on the machine."""
        flight = sim.releases_in_flight()
        free = {g: sim.node.free(g) + flight.get(g, 0) for g in k.gpus}
        total = {g: sim.node.gpus[g].capacity for g in k.gpus}
        mine = {o.id: o for o in self.server_kernels(sim, k) if o is not k}
        cands = {o.id: self.candidate(sim, o) for o in mine.values()}
        decisions = room_after_oom(product.Policy(self.config), list(k.gpus), nbytes, free,
                                   total, list(cands.values()), k.id)
        if decisions is None:
            sim.owe(k, nbytes)
            self.schedule_check(sim, k.user_index, sim.now)
            if self.node_daemon:
                for user in self.neighbours(sim, k.user_index, sim.node_gpus(k.gpu)):
                    self.schedule_check(sim, user, sim.now)
            self.oom_across_users(sim, k, nbytes, free, total)
            return
        on = "GPU " + ", ".join(map(str, k.gpus))
        for d in decisions:
            if mine[d.kernel_id].state == RESIDENT:  # the server's reason, as core.oom_room says it
                sim.release(mine[d.kernel_id], f"making room: kernel {k.id} ran out of memory on "
                                               f"{on}: idle for {cands[d.kernel_id].idle_seconds:.0f} s")

    def oom_across_users(self, sim: Simulation, k: Kernel, nbytes: int, free: dict[int, int],
                         total: dict[int, int]) -> None:
        """Its own server could not make room for the next try of ``k``'s cell: without the
        hub service, nobody else is asked."""

    def room_candidates(self, sim: Simulation, k: Kernel) -> list[Kernel]:
        """Whom ``policy.make_room`` may pick to make room for ``k``: its own server's kernels."""
        return self.server_kernels(sim, k)

    def candidate(self, sim: Simulation, k: Kernel) -> product.Candidate:
        """Built as the controller builds it (``policy.observed``); utilization is that of the
        kernel's last GPU cell when the cell ran inside a window (cells keep their SM % while
        they run). No per-kernel overrides or pins in these workloads."""
        now = sim.now

        # the GPU use leaves a window once it is a full window old: the check on_idle
        # schedules at that moment then sees the kernel quiet
        def utilization_since(since: float) -> float:
            used = k.last_gpu_utilization if k.last_gpu_end > since else 0.0
            return max(used, k.running_utilization) if k.busy else used

        resident = k.state == RESIDENT
        return product.observed(
            k.id, self.config, now,
            resident=resident,
            busy=k.busy,
            pinned=False,
            idle_seconds=0.0 if k.busy else max(0.0, now - k.last_activity),
            utilization_since=utilization_since,
            gpu_bytes={g: k.nbytes for g in k.gpus} if resident else {},
            # quietness for room-making judged over pressure_idle_timeout, as the controller
            # judges it (policy.observed's default)
        )

    def next_poll(self, user: int, t: float) -> float:
        phase = self.phase[user]
        return phase + math.ceil((t - phase) / self.poll_interval - 1e-9) * self.poll_interval

    def schedule_check(self, sim: Simulation, user: int, t: float) -> None:
        at = self.next_poll(user, max(t, sim.now))
        pending = self.checks.setdefault(user, set())
        if at in pending:
            return
        pending.add(at)
        sim.schedule(at, lambda: self._check(sim, user, at))

    # -- the poll: Controller.tick ---------------------------------------------------------------
    def _check(self, sim: Simulation, user: int, at: float) -> None:
        self.checks[user].discard(at)
        kernels = [o for o in sim.by_user[user] if o.alive]
        if not kernels:
            return
        gpus = sim.node_gpus(kernels[0].gpu)
        # the product's seen free memory less what this server's placed kernels that have
        # not allocated yet are expected to take (``GpuLoad.promised``): their room is wanted
        promised = self.promised(sim, user)
        free = {g: sim.node.free(g) - promised.get(g, 0) for g in gpus}
        total = {g: sim.node.gpus[g].capacity for g in gpus}
        by_id = {o.id: o for o in kernels}
        cands = [self.candidate(sim, o) for o in kernels]
        for kernel_id, reason in self.releases(sim, kernels, cands, free, total):
            sim.release(by_id[kernel_id], reason)
        for o in kernels:  # waiting restores re-check after every poll: cells' first
            if o.state == RELEASED and o.pending is not None:
                self._try_restore(sim, o)
        for o in kernels:
            if o.state == RELEASED and o.pending is None and o.ahead_since is not None:
                self._try_restore(sim, o)

    def promised(self, sim: Simulation, user: int) -> dict[int, int]:
        """Per GPU of ``user``'s machine, the bytes placed kernels that have not allocated yet
        are expected to allocate there, of those ``user``'s server knows
        (:meth:`knows_placed`): the product's ``Controller.wanted_free`` (its own
        ``GpuLoad.promised``, plus others' where it is told of them)."""
        kernels = [o for o in sim.by_user[user] if o.alive]
        out: dict[int, int] = {}
        if not kernels:
            return out
        for g in sim.node_gpus(kernels[0].gpu):
            for i in sim.placed[g]:
                o = sim.kernels[i]
                if o.need is not None and self.knows_placed(sim, user, o):
                    out[g] = out.get(g, 0) + o.need.bytes
        # what failed allocations' next tries want (GpuLoad.owe)
        owed = sim.owed_on(sim.node_gpus(kernels[0].gpu), lambda o: self.knows_owed(user, o))
        for g, more in owed.items():
            out[g] = out.get(g, 0) + more
        return out

    def knows_placed(self, sim: Simulation, user: int, other: Kernel) -> bool:
        """Whether ``user``'s server knows that ``other`` is placed and has not allocated yet:
        its own (``GpuLoad``: the node's ledger and NVML know allocations, not other servers'
        placements), and with the node daemon every server's on its machine (told at once)."""
        return other.user_index == user or self.node_daemon

    def sees_placed(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """What ``k``'s server knows (:meth:`knows_placed`), as its placement and restore views
        count it."""
        return self.knows_placed(sim, k.user_index, other)

    def knows_owed(self, user: int, other: Kernel) -> bool:
        """Whether ``user``'s server counts what ``other``'s failed allocation wants: its own,
        and with the node daemon every server's on its machine (the hub service is not told)."""
        return other.user_index == user or self.node_daemon

    def sees_owed(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        return self.knows_owed(k.user_index, other)

    def neighbours(self, sim: Simulation, user: int, machine: range) -> list[int]:
        """The other users whose servers run on ``machine`` with a kernel alive."""
        return [u for u, on in sim.machine_of.items()
                if u != user and on == machine and any(o.alive for o in sim.by_user[u])]

    def sees_returning(self, sim: Simulation, k: Kernel, other: Kernel) -> bool:
        """A server counts its own released kernels' states as coming back (``coming_back``
        of its lifecycles), and with the node daemon every server's on its machine (the
        daemon's claims carry them)."""
        return other.user_index == k.user_index or self.node_daemon

    def place_at_start(self, sim: Simulation, k: Kernel) -> list[int]:
        gpus = super().place_at_start(sim, k)
        self.schedule_check(sim, k.user_index, sim.now)  # its expected need may want room
        if self.node_daemon and gpus:  # told at once; the others weigh it at their next poll
            for user in self.neighbours(sim, k.user_index, sim.node_gpus(gpus[0])):
                self.schedule_check(sim, user, sim.now)
        return gpus

    def releases(self, sim: Simulation, kernels: list[Kernel], cands: list[product.Candidate],
                 free: dict[int, int], total: dict[int, int]) -> list[tuple[str, str]]:
        """(kernel id, reason) to release at this poll of the server of ``kernels``: the
        product's ``decide``; under the ``needs`` release policy, its idle releases only where
        the kernel's GPU needs memory, and a kernel idle past ``long_idle`` where its GPU has less
        than ``long_idle_free_fraction`` free (the product's ``long_idle_releases``)."""
        decisions = product.decide(cands, free, total, self.config)
        if self.release_policy == "proactive":
            return [(d.kernel_id, d.reason) for d in decisions]
        by_id = {o.id: o for o in kernels}
        out = []
        for d in decisions:
            if reason_kind(d.reason) != "idle":
                out.append((d.kernel_id, d.reason))
            elif (need := self.needs_memory(sim, by_id[d.kernel_id], free, total)) is not None:
                out.append((d.kernel_id, f"{d.reason}; {need}"))
        taken = {kernel_id for kernel_id, _ in out}
        long = replace(self.config, idle_timeout=self.long_idle)
        due = [(c, when) for c in cands if c.kernel_id not in taken
               and (when := product.idle_release(c, long)) is not None]
        # the server's rule: only where a GPU of the kernel is short of free memory
        for rel in product.long_idle_releases(due, free, total, self.config):
            out.append((rel.kernel_id, f"long idle: {rel.reason}".replace("idle_timeout",
                                                                          "long_idle")))
        return out

    def needs_memory(self, sim: Simulation, k: Kernel, free: dict[int, int],
                     total: dict[int, int]) -> str | None:
        """Why a GPU of ``k`` needs memory now (None: none does): free below the pressure
        threshold, or a restore waits for room there."""
        for g in k.gpus:
            if total.get(g) and free.get(g, 0) / total[g] < self.config.pressure_free_fraction:
                return f"GPU {g} below {self.config.pressure_free_fraction:.0%} free"
            if self.waiting.get(g) or any(o.ahead_since is not None
                                          for o in self.waiting_ahead.get(g, ())):
                return f"a restore waits for room on GPU {g}"
        return None

    def on_idle(self, sim: Simulation, k: Kernel) -> None:
        """Poll ticks at which a policy answer about ``k`` can change: its idle timeout, its
        pressure timeout, and the moment its last GPU use leaves the utilization window."""
        cfg = self.config
        if cfg.idle_timeout <= 0:
            return  # never released automatically: nothing to check
        self.schedule_check(sim, k.user_index, k.last_activity + cfg.idle_timeout)
        self.schedule_check(sim, k.user_index, k.last_activity + cfg.pressure_idle_timeout)
        if k.last_gpu_end > float("-inf"):
            self.schedule_check(sim, k.user_index, k.last_gpu_end + max(cfg.idle_timeout, 1.0))
        if self.release_policy == "needs":
            self.schedule_check(sim, k.user_index, k.last_activity + self.long_idle)

    def on_allocated(self, sim: Simulation, gpu: int) -> None:
        g = sim.node.gpus[gpu]
        if g.free() / g.capacity >= self.config.pressure_free_fraction:
            return
        for user in {k.user_index for k in sim.kernels if gpu in k.gpus and k.state == RESIDENT}:
            self.schedule_check(sim, user, sim.now)  # every server sees the pressure at its poll

    # -- restores: Controller._wait_for_room ----------------------------------------------------------
    def on_needs_gpu(self, sim: Simulation, k: Kernel) -> None:
        if k.state == RELEASED:
            self._try_restore(sim, k)
        # RELEASING: the release finishes first, then the engine asks again

    def on_activity(self, sim: Simulation, k: Kernel) -> None:
        since = k.ahead_since
        assert since is not None
        # the server stops a restore ahead that finds no room within ahead.ROOM_WAIT s
        sim.schedule(since + self.ahead_room_wait, partial(self._ahead_dropped, sim, k, since))
        self._try_restore(sim, k)

    def on_ahead_restored(self, sim: Simulation, k: Kernel) -> None:
        since = k.ahead_since
        if since is not None and self.ahead_grace > 0:  # None: a cell came meanwhile
            sim.schedule(sim.now + self.ahead_grace, partial(self._ahead_unused, sim, k, since))

    def _ahead_dropped(self, sim: Simulation, k: Kernel, since: float) -> None:
        """No room found within ``AHEAD_ROOM_WAIT`` s of the activity at ``since``, and no
        cell: the server stops the restore ahead (the cell, when it comes, restores as any
        cell)."""
        if k.ahead_since is None and k.pending is None:
            self._stop_waiting(k)  # a CPU-only cell came (lazy mode): nothing wants it now
        if k.ahead_since == since and k.state == RELEASED:
            k.ahead_since = None
            sim.counters.ahead_cancelled += 1
            self._stop_waiting(k)
            self.short_since.pop(k.index, None)

    def _ahead_unused(self, sim: Simulation, k: Kernel, since: float) -> None:
        """A kernel restored ahead for the activity at ``since`` ran no cell for
        ``ahead_grace`` s after its restore: released again, without waiting idle_timeout."""
        if k.ahead_since == since and k.state == RESIDENT and k.ahead_restore and not k.busy:
            if sim.release(k, f"ahead grace: no cell within {self.ahead_grace:.0f} s of the "
                              f"restore ahead"):
                k.ahead_since, k.ahead_restore = None, False
                sim.counters.ahead_released_again += 1

    def _cells_wait(self, sim: Simulation, k: Kernel) -> bool:
        """Whether a cell's restore waits for room on a GPU of ``k`` (or has releases under way
        for its room there): a restore ahead yields to it."""
        if any(o is not k for g in k.gpus for o in self.waiting.get(g, ())):
            return True
        return any(o.pending is not None and set(o.gpus) & set(k.gpus)
                   for o in (sim.kernels[i] for i in self.making_room) if o is not k)

    def _try_restore(self, sim: Simulation, k: Kernel) -> None:
        if k.index in self.making_room or k.state != RELEASED:
            return
        ahead = k.pending is None
        if ahead and k.ahead_since is None:
            self._stop_waiting(k)  # nothing wants it any more (a CPU cell ran, lazy mode)
            self.short_since.pop(k.index, None)
            return
        if ahead and self._cells_wait(sim, k):
            self._wait(sim, k, ahead)
            return
        want = {g: k.nbytes for g in k.gpus}
        # on every one of its GPUs (a cell of several runs on all or none), as the product's
        # restore checks: free memory less the releases in flight there
        if not lacking(want, sim.restore_room(k)):
            # home, unless its SMs are contended and a quieter GPU has room (the rule's)
            if not (self.move_after > 0 and self._move(sim, k, ahead, lacks=False)):
                self._stop_waiting(k)
                self.short_since.pop(k.index, None)
                sim.restore(k)
            return
        if k.pending is not None:
            k.pending.room = True  # its cell waits for room: releases elsewhere, or a move
        if self.move_after > 0:
            since = self.short_since.get(k.index)
            if since is None:  # its own GPUs lack room from now: look elsewhere move_after on
                self.short_since[k.index] = sim.now
                sim.schedule(sim.now + self.move_after, partial(self._move_due, sim, k, sim.now))
            elif sim.now - since >= self.move_after - 1e-9 and self._move(sim, k, ahead):
                return
        free = {g: sim.node.free(g) for g in k.gpus}
        cands = [self.candidate(sim, o) for o in self.room_candidates(sim, k)]
        plan = product.make_room({g: k.nbytes for g in k.gpus}, free, cands, self.config,
                                 exclude=k.id)
        if plan:
            by_id = {o.id: o for o in sim.kernels}
            self.making_room.add(k.index)
            self._release_in_turn(sim, [(by_id[d.kernel_id], d.reason) for d in plan], k)
            return
        self._wait(sim, k, ahead)

    def _move_due(self, sim: Simulation, k: Kernel, since: float) -> None:
        """``move_after`` s since ``k``'s restore first lacked room (at ``since``): the
        controller wakes then (not at its next poll) and looks for other GPUs."""
        if k.state == RELEASED and self.short_since.get(k.index) == since:
            self._try_restore(sim, k)

    def _move(self, sim: Simulation, k: Kernel, ahead: bool, lacks: bool = True) -> bool:
        """Restore ``k`` onto other GPUs of its machine where the product's rule says
        (:func:`jupyter_gpushare.policy.placement.restore_target`): each GPU of its own that
        lacks room (``lacks``) or whose SMs are contended onto the best-ranked GPU with room,
        all of them or none; False: it stays where it is (and, lacking room, waits). A restore
        ahead leaves alone the GPUs where a cell's restore waits for room."""
        want = {g: k.nbytes for g in k.gpus}
        views = self.restore_views(sim, k)
        free = sim.restore_room(k)
        for g in want:  # its own GPUs: the restore check's room (lacking says which lack it)
            views[g] = replace(views[g], room=free[g])
        if ahead:
            for g in views:
                if g not in want and self.waiting.get(g):
                    views[g] = replace(views[g], room=None)
        short = lacking(want, dict(free)) if lacks else []
        plan = rule.restore_target(want, views, lacking=short, keep=self.floor(sim, views))
        if not plan:
            return False
        self._stop_waiting(k)  # from the queues of the GPUs it leaves
        self.short_since.pop(k.index, None)
        sim.move(k, [plan.get(g, g) for g in k.gpus])
        sim.restore(k)
        return True

    def restore_views(self, sim: Simulation, k: Kernel) -> dict[int, rule.GpuView]:
        """The GPUs of ``k``'s machine as a restore of ``k`` judges them (the product's
        ``RestoreRoom.views``): room = free memory less the releases in flight, less the held
        states of this server's other released kernels (other servers' it does not know),
        less what placed kernels will allocate."""
        taken_back = sim.releases_in_flight()
        for g, n in coming_back(o for o in self.server_kernels(sim, k)
                                if o is not k and o.state == RELEASED).items():
            taken_back[g] = taken_back.get(g, 0) + n
        return sim.views(sim.node_gpus(k.gpu), exclude=k, taken_back=taken_back, seen_by=k)

    def floor(self, sim: Simulation, gpus: Iterable[int]) -> dict[int, int]:
        """Bytes a move leaves free on each of ``gpus``: the pressure threshold (the rule's
        ``keep``, as the product passes it)."""
        return rule.pressure_floor({g: sim.node.gpus[g].capacity for g in gpus},
                                   self.config.pressure_free_fraction)

    def _wait(self, sim: Simulation, k: Kernel, ahead: bool) -> None:
        """``k``'s restore waits for room: a cell's in ``waiting``, one ahead in
        ``waiting_ahead`` (served after cells'). Under the ``needs`` release policy the servers
        of the kernels on its GPUs see it at their next poll, and release what is idle."""
        queue, other = ((self.waiting_ahead, self.waiting) if ahead
                        else (self.waiting, self.waiting_ahead))
        if k in queue.get(k.gpu, ()):
            return
        for g in k.gpus:  # any of its GPUs freeing memory may be what it waits for
            if k in other.get(g, ()):
                other[g].remove(k)
            queue.setdefault(g, []).append(k)
        sim.note(k, "restore_waiting", free=min(sim.node.free(g) for g in k.gpus),
                 trigger="activity" if ahead else "cell")
        if self.release_policy == "needs":
            for user in {o.user_index for o in sim.kernels if o.state == RESIDENT
                         and set(o.gpus) & set(k.gpus)}:
                self.schedule_check(sim, user, sim.now)

    def _release_in_turn(self, sim: Simulation, plan: list[tuple[Kernel, str]], k: Kernel) -> None:
        """The controller awaits each make-room release in turn, then checks for room again."""
        if not plan:
            self.making_room.discard(k.index)
            self._try_restore(sim, k)
            return
        (victim, reason), rest = plan[0], plan[1:]
        if not sim.release(victim, reason, then=lambda: self._release_in_turn(sim, rest, k)):
            self._release_in_turn(sim, rest, k)  # it became busy meanwhile: skipped, as a 409

    def _stop_waiting(self, k: Kernel) -> None:
        for queue in (self.waiting, self.waiting_ahead):
            for g in k.gpus:
                waiting = queue.get(g)
                if waiting and k in waiting:
                    waiting.remove(k)

    def on_memory_freed(self, sim: Simulation, gpu: int) -> None:
        for k in [*self.waiting.get(gpu, ()), *self.waiting_ahead.get(gpu, ())]:
            self.schedule_check(sim, k.user_index, sim.now)  # its server notices at its next poll

    # -- rebalance: idle kernels off contended GPUs ----------------------------------------------
    def history_seconds(self, load_window: float) -> float:
        return max(load_window, window_of(self.rebalance_idle, load_window))

    def on_compute(self, sim: Simulation, gpus: list[int]) -> None:
        """A cell computes on ``gpus``: the rebalance passes over their machine run from now
        on, for as long as a GPU of it has computed within the load window (before and after
        that, nothing there can be contended)."""
        if not self.rebalance:
            return
        machine = sim.node_gpus(gpus[0])
        if machine.start not in self.rebalancing:
            self.rebalancing.add(machine.start)
            tick = self.poll_interval
            at = math.ceil(sim.now / tick + 1e-9) * tick
            sim.schedule(at, partial(self._rebalance_tick, sim, machine))

    def _rebalance_tick(self, sim: Simulation, machine: range) -> None:
        """A pass at each poll, as the product's rebalancer runs (a pass every 30 s missed
        moves: a GPU turns contended while the quiet GPUs a kernel would go to fill up, and
        the moment both hold may last less than 30 s), except the polls before one GPU of
        the machine can be contended while another is quiet: they could move nothing."""
        tick = self.poll_interval
        calm = self._rebalance(sim, machine)
        at = sim.now + tick * max(1, math.floor(calm / tick))  # on the poll's grid
        if at <= sim.duration and any(sim.busy(g, self.rebalance_window) for g in machine):
            sim.schedule(at, partial(self._rebalance_tick, sim, machine))
        else:
            self.rebalancing.discard(machine.start)

    def _rebalance(self, sim: Simulation, machine: range) -> float:
        """One pass of the product's rebalance over ``machine``
        (:func:`jupyter_gpushare.policy.placement.rebalance` unchanged), judged over the
        product rebalancer's window: a kernel may move when its person is away (no cell
        running or waiting, idle ``rebalance_idle`` s) and it has moved fewer than
        ``rebalance_per_hour`` times in the last hour. Returns the s before a pass could
        move anything (0: at the next poll)."""
        w = self.rebalance_window
        loads = {g: sim.node.load(g, sim.now, w) for g in machine}
        # a move needs a contended GPU (the rule's test, on the two inputs it reads) and a
        # quiet one; a mean over w s of SM % (0-100) moves at most 100 / w % per s
        hot = {g for g, v in loads.items() if v >= rule.CONTENDED_LOAD and sim.busy(g, w) >= 2}
        quiet = min(loads.values()) <= rule.QUIET_LOAD
        if not (hot and quiet):
            to_hot = max(0.0, rule.CONTENDED_LOAD - max(loads.values()))
            to_quiet = max(0.0, min(loads.values()) - rule.QUIET_LOAD)
            return max(to_hot, to_quiet) * w / 100.0
        residents = []
        for o in sim.kernels:
            if o.state != RESIDENT or not o.allocated or o.gpu not in machine:
                continue
            idle = 0.0 if o.busy else sim.now - o.last_activity
            movable = (not o.busy and o.pending is None and idle >= self.rebalance_idle
                       and _moves_this_hour(sim, o) < self.rebalance_per_hour)
            residents.append(rule.Resident(str(o.index), {g: o.held for g in o.gpus}, movable,
                                           idle))
        if not any(r.movable and hot.intersection(r.gpus) for r in residents):
            return 0.0  # nobody on a GPU that may be contended may move now
        views = sim.views(machine, window=w)
        for kernel, plan in rule.rebalance(residents, views, keep=self.floor(sim, views)):
            o = sim.kernels[int(kernel)]
            was = ", ".join(str(g) for g in plan)
            if sim.relocate(o, [plan.get(g, g) for g in o.gpus],
                            f"rebalance: GPU {was} contended"):
                o.moved_at.append(sim.now)
        return 0.0

    def before_cell(self, sim: Simulation, k: Kernel) -> bool:
        """The product's move before a cell (:func:`jupyter_gpushare.policy.placement.before_cell`
        unchanged, as ``core.rebalance.Rebalancer.before_cell`` calls it at the gate): how
        heavy its work was is the highest SM % its processes got in its last GPU cell (the
        tracker's peak of its last GPU work: a cell slowed all along reads less than it
        asked), each GPU's reading is the SM % its running
        cells ask (up to 100, as NVML reads it), targets are judged over the rebalancer's
        window; a move counts within ``rebalance_per_hour``. Every cell comes through the gate
        (the simulator's people use JupyterLab), GPU cells or not: the gate cannot tell."""
        if not (self.rebalance and self.rebalance_before_cell) or self.rebalance_per_hour <= 0:
            return False
        if not k.allocated or k.busy or k.last_gpu_share <= 0:
            return False
        if _moves_this_hour(sim, k) >= self.rebalance_per_hour:
            return False
        machine = sim.node_gpus(k.gpu)
        reading = {g: min(100.0, sim.node.gpus[g].demand()) for g in machine}
        resident = rule.Resident(str(k.index), {g: k.held for g in k.gpus}, True)
        views = sim.views(machine, exclude=k, window=self.rebalance_window)
        plan = rule.before_cell(resident, k.last_gpu_share, reading, views,
                                keep=self.floor(sim, machine))
        if not plan:
            return False
        was = ", ".join(str(g) for g in sorted(plan))
        if not sim.relocate(k, [plan.get(g, g) for g in k.gpus],
                            f"rebalance: GPU {was} busy with another kernel's cell"):
            return False
        k.moved_at.append(sim.now)
        return True

    def describe(self) -> str:
        c = self.config
        release = ("" if self.release_policy == "proactive" else
                   f", release only when needed or after {self.long_idle:.0f} s idle")
        return (f"gpushare: idle_timeout {c.idle_timeout:.0f} s, pressure below "
                f"{c.pressure_free_fraction:.0%} free after {c.pressure_idle_timeout:.0f} s idle, "
                f"poll {self.poll_interval:g} s{release}, ahead_grace {self.ahead_grace:.0f} s, "
                + (f"restores move after {self.move_after:g} s" if self.move_after > 0
                   else "restores never move")
                + (f", rebalance after {self.rebalance_idle:g} s idle" if self.rebalance
                   else ", no rebalance")
                + (", and before a heavy cell on a busy GPU"
                   if self.rebalance and self.rebalance_before_cell else ""))


def _moves_this_hour(sim: Simulation, k: Kernel) -> int:
    """Moves of ``k`` (rebalance, or before a cell) within the last hour: both count against
    ``rebalance_per_hour``, as the product's rebalancer counts them."""
    return sum(1 for t in k.moved_at if t > sim.now - 3600.0)
