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
  candidates built as :meth:`jupyter_gpushare.controller.Controller.candidate` builds them.

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

from .. import policy as product
from .engine import RELEASED, RESIDENT, Kernel, Simulation
from .workload import Workload


class Policy:
    name = "policy"

    def gpu_count(self, workload: Workload, gpus: int) -> int:
        """GPUs this policy runs ``workload`` on, given a node (or nodes) of ``gpus``."""
        return gpus

    def setup(self, sim: Simulation) -> None:
        pass

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
        """Where a kernel that starts (or restarts after a cull) now runs."""
        if sim.placement != "load-aware":
            return k.gpus
        machine = sim.node_gpus(self.place(sim, k)[0])  # its user's machine

        def load(g: int) -> tuple[int, float, int]:
            return (-(sim.node.free(g) - sim.reserved(g)), sim.node.gpus[g].demand(), g)

        return sorted(sorted(machine, key=load)[:k.work.gpus])

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

    def on_allocated(self, sim: Simulation, gpu: int) -> None:
        pass

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


class GPUShare(Policy):
    """What each user's jupyter-gpushare server does, one server per user."""

    name = "gpushare"

    def __init__(self, config: product.PolicyConfig, poll_interval: float = 2.0, seed: int = 0):
        self.config = config
        self.poll_interval = poll_interval
        self.seed = seed

    def setup(self, sim: Simulation) -> None:
        # servers poll on their own clocks, not in step: a phase per user
        self.phase = [random.Random(f"{self.seed}:poll:{u}").uniform(0, self.poll_interval)
                      for u in range(len(sim.workload.users))]
        self.checks: dict[int, set[float]] = {}
        self.waiting: dict[int, list[Kernel]] = {}  # GPU -> kernels whose restore waits for room
        self.making_room: set[int] = set()  # kernels whose restore waits for make-room releases

    # -- the server's view ----------------------------------------------------------------------
    def server_kernels(self, sim: Simulation, k: Kernel) -> list[Kernel]:
        """The kernels the server that owns ``k`` manages (its tracker's kernels)."""
        return [o for o in sim.by_user[k.user_index] if o.alive]

    def room_candidates(self, sim: Simulation, k: Kernel) -> list[Kernel]:
        """Whom ``policy.make_room`` may pick to make room for ``k``: its own server's kernels."""
        return self.server_kernels(sim, k)

    def candidate(self, sim: Simulation, k: Kernel) -> product.Candidate:
        """As Controller.candidate builds it; utilization is that of the kernel's last GPU
        cell when the cell ran inside the window (cells keep their SM % while they run)."""
        now = sim.now
        window = self.config.idle_timeout  # no per-kernel overrides in these workloads
        since = now - max(window, 1.0)
        # the GPU use leaves the window once it is a full window old: the check on_idle
        # schedules at that moment then sees the kernel quiet
        utilization = k.last_gpu_utilization if k.last_gpu_end > since else 0.0
        if k.busy:
            utilization = max(utilization, k.running_utilization)
        resident = k.state == RESIDENT
        return product.Candidate(
            kernel_id=k.id,
            resident=resident,
            busy=k.busy,
            pinned=False,
            idle_seconds=0.0 if k.busy else max(0.0, now - k.last_activity),
            max_utilization=utilization,
            gpu_bytes={g: k.nbytes for g in k.gpus} if resident else {},
            idle_timeout=None,
            releasable=True,
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
        free = {g: sim.node.free(g) for g in gpus}
        total = {g: sim.node.gpus[g].capacity for g in gpus}
        by_id = {o.id: o for o in kernels}
        cands = [self.candidate(sim, o) for o in kernels]
        for decision in product.decide(cands, free, total, self.config):
            sim.release(by_id[decision.kernel_id], decision.reason)
        for o in kernels:  # waiting restores re-check after every poll
            if o.state == RELEASED and o.pending is not None:
                self._try_restore(sim, o)

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

    def _try_restore(self, sim: Simulation, k: Kernel) -> None:
        if k.index in self.making_room or k.state != RELEASED or k.pending is None:
            return
        if sim.fits_now(k):  # on every one of its GPUs: a cell of several runs on all or none
            self._stop_waiting(k)
            sim.restore(k)
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
        if k not in self.waiting.get(k.gpu, ()):
            for g in k.gpus:  # any of its GPUs freeing memory may be what it waits for
                self.waiting.setdefault(g, []).append(k)
            sim.note(k, "restore_waiting", free=min(free.values()))

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
        for g in k.gpus:
            waiting = self.waiting.get(g)
            if waiting and k in waiting:
                waiting.remove(k)

    def on_memory_freed(self, sim: Simulation, gpu: int) -> None:
        for k in list(self.waiting.get(gpu, ())):
            self.schedule_check(sim, k.user_index, sim.now)  # its server notices at its next poll

    def describe(self) -> str:
        c = self.config
        return (f"gpushare: idle_timeout {c.idle_timeout:.0f} s, pressure below "
                f"{c.pressure_free_fraction:.0%} free after {c.pressure_idle_timeout:.0f} s idle, "
                f"poll {self.poll_interval:g} s")
