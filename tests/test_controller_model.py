"""A model-based test of the controller: hypothesis drives a real ``Controller`` through
releases, restores, failures, stalls, closed tabs, interrupts, restarts and shutdown, and
checks the product's promise after every step against a fake GPU node that owns the truth
of where each kernel's bytes are.

The fakes sit where the hardware does: the GPU node (memory per GPU, other processes, host
memory), the tracker's records of it (re-read on every poll, as NVML would be), each
kernel's agent, and a reclaim method that moves the node's bytes and can, per call as the
state machine scripts it, succeed, fail before moving anything, fail after moving some bytes
with or without a confirmed undo, time out, lose its channel, or stall until a rule lets it
go. Everything else (operations, waiting, reservations, policy, make-room, shutdown) is the
real controller on a real event loop whose clock the test moves.

``GPUSHARE_HYPOTHESIS_EXAMPLES`` raises the number of examples for a long run.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jupyter_gpushare import clock, policy
from jupyter_gpushare.controller import Controller, ControllerError
from jupyter_gpushare.hostmem import HostRoom
from jupyter_gpushare.protocol import RemoteError
from jupyter_gpushare.reclaim import KernelTarget, ReclaimError, ReclaimMethod, ReclaimResult, Support
from jupyter_gpushare.states import FAILED, RELEASED, RELEASING, RESIDENT, RESTORING
from jupyter_gpushare.telemetry import GPUInfo
from jupyter_gpushare.tracker import GPURecord, KernelRecord

MiB = 1 << 20
GiB = 1 << 30
CAPACITY = {0: 4 * GiB, 1: 4 * GiB}
#: each kernel's GPU state, per GPU; together they fit on the node with room to spare
FOOTPRINTS = {
    "k0": {0: 1536 * MiB},
    "k1": {0: 1 * GiB, 1: 1 * GiB},
    "k2": {1: 2 * GiB},
}
KERNELS = sorted(FOOTPRINTS)
NO_AGENT = {"k2"}  # a kernel without the agent (an R kernel): the live execution state says "busy"
HOST_TOTAL = 6 * GiB
HOST_RESERVE = 256 * MiB
CONFIG = policy.PolicyConfig(idle_timeout=60, idle_utilization=5, min_release_bytes=0,
                             pressure_free_fraction=0.1, pressure_idle_timeout=30)
RELEASE_OUTCOMES = ("ok", "refused", "undone", "unconfirmed", "timeout", "lost")
RESTORE_OUTCOMES = ("ok", "fail")

EXAMPLES = int(os.environ.get("GPUSHARE_HYPOTHESIS_EXAMPLES", "120"))
STEPS = int(os.environ.get("GPUSHARE_HYPOTHESIS_STEPS", "40"))


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time moves only when the test says: the controller's backoffs
    and shutdown's time limits fire when a rule lets time pass, never by the wall clock."""

    def __init__(self) -> None:
        super().__init__()
        self.virtual = 0.0

    def time(self) -> float:
        return self.virtual


# -- the fake GPU node: the truth -------------------------------------------------------------
@dataclass
class Proc:
    """A kernel's process and where its GPU state is."""

    pid: int
    footprint: dict[int, int]  # GPU -> bytes of its GPU state
    on_gpu: dict[int, int]  # GPU -> bytes of it on the GPU now
    host: dict[int, int] = field(default_factory=dict)  # GPU -> bytes of it copied to host memory
    running: bool = True  # False: locked / checkpointed by a method (its GPU calls block)
    busy: bool = False  # a cell executes
    wedged: bool = False  # a restore ran out of GPU memory: the process is stuck for good

    def off(self, gpu: int) -> int:
        """Bytes a restore must bring back to ``gpu``."""
        return self.footprint.get(gpu, 0) - self.on_gpu.get(gpu, 0)

    @property
    def intact(self) -> bool:
        """Every byte of the state is on the GPU or has its copy in host memory."""
        return all(self.host.get(g, 0) >= self.off(g) for g in self.footprint)

    @property
    def all_on_gpu(self) -> bool:
        return self.running and not self.wedged and all(self.off(g) == 0 for g in self.footprint)

    @property
    def all_off_gpu(self) -> bool:
        return not self.running and not any(self.on_gpu.get(g, 0) for g in self.footprint)


class FakeNode:
    def __init__(self) -> None:
        self.other = {g: 0 for g in CAPACITY}  # other processes' allocations per GPU
        self.host_other = 0  # other processes' host memory
        self.procs = {kid: Proc(1000 + i, dict(fp), dict(fp)) for i, (kid, fp) in enumerate(FOOTPRINTS.items())}
        self.next_pid = 2000

    def used(self, gpu: int) -> int:
        return self.other[gpu] + sum(p.on_gpu.get(gpu, 0) for p in self.procs.values())

    def free(self, gpu: int) -> int:
        return CAPACITY[gpu] - self.used(gpu)

    def host_used(self) -> int:
        return self.host_other + sum(sum(p.host.values()) for p in self.procs.values())

    def restart(self, kid: str) -> None:
        """A new process; the old one's GPU state (on the GPU or held in host memory) is gone."""
        self.procs[kid] = Proc(self.next_pid, {}, {})
        self.next_pid += 1


class FakeTracker:
    """What the controller reads of the tracker; ``poll`` re-reads the node, as NVML would."""

    def __init__(self, node: FakeNode) -> None:
        self.node = node
        now = clock.now()
        self.kernels = {kid: KernelRecord(id=kid, first_seen=now, last_activity=now,
                                          history=deque(maxlen=50)) for kid in KERNELS}
        self.km = set(KERNELS)
        self.gpus: dict[int, GPURecord] = {}

    def poll(self) -> None:
        now = clock.now()
        for kid, rec in self.kernels.items():
            proc = self.node.procs[kid]
            rec.pids = [proc.pid]
            rec.gpu_bytes = {g: b for g, b in proc.on_gpu.items() if b}
            rec.pid_gpu_bytes = {proc.pid: dict(rec.gpu_bytes)} if rec.gpu_bytes else {}
            rec.execution_state = "busy" if proc.busy else "idle"
            rec.sm_utilization = 0.0 if rec.gpu_bytes else None
            if proc.busy:
                rec.last_activity = now
            rec.history.append((now, rec.gpu_memory_bytes, rec.sm_utilization, dict(rec.gpu_bytes)))
        for g, total in CAPACITY.items():
            info = GPUInfo(index=g, uuid=f"GPU-fake-{g}", name="fake", memory_total=total,
                           memory_used=self.node.used(g), utilization=0.0)
            self.gpus[g] = GPURecord(info)

    def touch(self, kid: str) -> None:
        self.kernels[kid].last_activity = clock.now()


class FakeAgent:
    """A kernel's agent: it arbitrates "busy" and shows progress lines."""

    def __init__(self, node: FakeNode, kid: str) -> None:
        self.node, self.kid = node, kid

    async def request(self, op: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        await asyncio.sleep(0)  # a round trip over the socket
        if op == "begin_release":
            if self.node.procs[self.kid].busy and not args.get("by_kernel"):
                raise RemoteError("a cell is running; release it when idle", kind="Busy")
            return {}
        if op == "show":
            return {}
        raise AssertionError(f"unexpected agent request {op}")

    def notify(self, op: str, **args: Any) -> None:
        pass


# -- the scripted method ----------------------------------------------------------------------
@dataclass
class Plan:
    outcome: str = "ok"
    stall: bool = False


class ScriptedMethod(ReclaimMethod):
    """Moves the node's bytes as the state machine scripts, keeping the reclaim contract:
    a failed release says whether the kernel runs as before (resident=True only when it
    does); a restore brings the kernel back from wherever it is, or changes nothing."""

    name = "fake"
    needs_agent = False
    supports_lazy = True

    def __init__(self, model: ControllerModel) -> None:
        self.model = model
        self.node = model.node
        self.in_call: dict[str, int] = {}
        self.calls = {"release": 0, "restore": 0}

    def support(self) -> Support:
        return Support(True, "scripted by the test")

    @contextmanager
    def _alone(self, kid: str, kind: str) -> Iterator[None]:
        self.calls[kind] += 1
        self.in_call[kid] = self.in_call.get(kid, 0) + 1
        if self.in_call[kid] > 1:
            self.model.violation(f"two operations at once on {kid} (a {kind} started while another ran)")
        try:
            yield
        finally:
            self.in_call[kid] -= 1

    async def _stall(self, kid: str) -> None:
        gate = asyncio.Event()
        self.model.stalls[kid] = gate
        try:
            await gate.wait()
        finally:
            if self.model.stalls.get(kid) is gate:
                del self.model.stalls[kid]

    def _move_off(self, proc: Proc, half: bool = False) -> None:
        """Copy bytes to host memory, then free them on the GPU (half of them, or all)."""
        for g, b in proc.footprint.items():
            keep = min(proc.on_gpu.get(g, 0), b // 2 if half else 0)
            proc.host[g] = proc.host.get(g, 0) + proc.on_gpu.get(g, 0) - keep
            proc.on_gpu[g] = keep
        if self.node.host_used() > HOST_TOTAL:
            self.model.violation(f"pid {proc.pid} moved its GPU state into host memory that was not "
                                 f"there ({self.node.host_used()} > {HOST_TOTAL}): OOM-killed")

    def _move_back(self, proc: Proc, half: bool = False) -> bool:
        """Copy the off-GPU bytes back (half of them; the host copy stays until the caller
        frees it); False, with nothing changed, when a GPU has no room."""
        want = {g: (proc.off(g) + 1) // 2 if half else proc.off(g) for g in proc.footprint}
        if any(n > self.node.free(g) for g, n in want.items()):
            return False
        for g, n in want.items():
            proc.on_gpu[g] = proc.on_gpu.get(g, 0) + n
        return True

    @staticmethod
    def _free_host_copy(proc: Proc) -> None:
        proc.host = {g: n for g, n in proc.host.items() if proc.off(g) and n}

    async def release(self, target: KernelTarget, progress: Any = None) -> ReclaimResult:
        kid = target.kernel_id
        with self._alone(kid, "release"):
            plan = self.model.next_plan(kid, "release")
            proc = self.node.procs[kid]
            if proc.pid not in target.pids:
                raise ConnectionError("the kernel's process is gone")
            if plan.outcome == "refused":
                raise ReclaimError("lock timed out: GPU work still running", resident=True)
            proc.running = False  # locked: from here its GPU calls block
            self._move_off(proc, half=True)
            if plan.stall:
                await self._stall(kid)
            if self.node.procs[kid] is not proc:
                raise ConnectionError("the kernel's process exited during the release")
            if plan.outcome == "ok":
                self._move_off(proc)
                return ReclaimResult(sum(proc.footprint.values()), 0.0)
            if plan.outcome == "undone":
                if self._move_back(proc):
                    self._free_host_copy(proc)
                    proc.running = True
                    raise ReclaimError("checkpoint failed; the kernel runs as before", resident=True)
                raise ReclaimError("checkpoint failed; the undo found its GPU memory taken")
            if plan.outcome == "unconfirmed":
                raise ReclaimError("checkpoint failed; undo not confirmed")
            if plan.outcome == "timeout":
                raise TimeoutError()
            raise ConnectionError("the agent channel closed")

    async def restore(self, target: KernelTarget, progress: Any = None) -> ReclaimResult:
        kid = target.kernel_id
        with self._alone(kid, "restore"):
            proc = self.node.procs[kid]
            self.model.check_room_for_restore(kid, proc)
            plan = self.model.next_plan(kid, "restore")
            if proc.pid not in target.pids:
                raise ReclaimError("the process that held the state is gone", retryable=False)
            if proc.wedged:
                raise ReclaimError("the process is wedged", retryable=False)
            before = dict(proc.on_gpu)
            if plan.stall:
                if not self._move_back(proc, half=True):
                    proc.wedged = True
                    raise ReclaimError("out of memory during the restore", retryable=False)
                await self._stall(kid)
                if self.node.procs[kid] is not proc:
                    raise ReclaimError("the process exited during the restore", retryable=False)
            if plan.outcome == "fail":
                proc.on_gpu = before  # all or nothing: the host copy stays, nothing else changed
                raise ReclaimError("restore failed: the driver said no")
            moved = sum(proc.off(g) for g in proc.footprint)
            if not self._move_back(proc):
                proc.wedged = True  # what a real restore without room does (cuda-checkpoint#44)
                raise ReclaimError("out of memory during the restore", retryable=False)
            self._free_host_copy(proc)
            proc.running = True
            return ReclaimResult(moved, 0.0)


# -- the state machine ------------------------------------------------------------------------
@dataclass
class Waiter:
    """A caller waiting on the controller: a REST request, a gate's drain, an agent."""

    what: str
    kid: str
    task: asyncio.Task[Any] = field(repr=False)
    cancelled_by_us: bool = False


class _Bugs(logging.Handler):
    """Log records with a traceback are the controller's "this is a bug" path."""

    def __init__(self, model: ControllerModel) -> None:
        super().__init__(logging.ERROR)
        self.model = model

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.model.violation(f"logged a bug: {record.getMessage()}: {record.exc_info[1]!r}")


kernel_ids = st.sampled_from(KERNELS)
spins = st.integers(0, 8)


class ControllerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        clock.reset()
        self.loop = VirtualTimeLoop()
        self.node = FakeNode()
        self.plans: dict[tuple[str, str], deque[Plan]] = {}
        self.stalls: dict[str, asyncio.Event] = {}
        self.violations: list[str] = []
        self.waiters: list[Waiter] = []
        self.steps = 0
        self.shutdown_task: asyncio.Task[None] | None = None
        self.bugs = _Bugs(self)
        logging.getLogger("jupyter_gpushare").addHandler(self.bugs)
        self.loop.run_until_complete(self._build())

    async def _build(self) -> None:
        self.tracker = FakeTracker(self.node)
        self.method = ScriptedMethod(self)
        self.agents = {kid: FakeAgent(self.node, kid) for kid in KERNELS if kid not in NO_AGENT}
        self.poll_lock = asyncio.Lock()
        self.controller = Controller(
            self.tracker,  # type: ignore[arg-type]
            {"fake": self.method},
            choose_method=lambda kid: "fake",
            config=CONFIG,
            read_free=self._read_free,
            total_bytes=lambda: dict(CAPACITY),
            agent=self.agents.get,
            emit=lambda payload: None,
            refresh=self._poll,
            host_room=self._host_room,
            host_memory_reserve=HOST_RESERVE,
            live_state=lambda kid: "busy" if self.node.procs[kid].busy else "idle",
        )
        await self._poll()

    # -- the fakes' plumbing ---------------------------------------------------------------
    async def _read_free(self, gpus: list[int]) -> dict[int, int | None]:
        await asyncio.sleep(0)  # read on the sampling thread
        return {g: self.node.free(g) for g in gpus}

    async def _host_room(self, pid: int | None) -> HostRoom:
        await asyncio.sleep(0)
        available = HOST_TOTAL - self.node.host_used()
        return HostRoom(available, "machine", f"the machine has {available} bytes available")

    async def _poll(self) -> None:
        """The app's poll_once: one sample, then the controller's tick; polls never overlap."""
        async with self.poll_lock:
            await asyncio.sleep(0)
            self.tracker.poll()
            await self.controller.tick()

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def next_plan(self, kid: str, kind: str) -> Plan:
        queue = self.plans.get((kid, kind))
        return queue.popleft() if queue else Plan()

    def check_room_for_restore(self, kid: str, proc: Proc) -> None:
        """At the moment a restore is called: room reserved for every byte it brings back,
        and that much free on the node."""
        ledger = self.controller.reservations
        for g in proc.footprint:
            off = proc.off(g)
            if off <= 0:
                continue
            if ledger.reserved(g) < off:
                self.violation(f"restore of {kid} called with {ledger.reserved(g)} bytes reserved on "
                               f"GPU {g}; it brings back {off}")
            if self.node.free(g) < ledger.reserved(g):
                self.violation(f"restore of {kid} called with {self.node.free(g)} bytes free on GPU {g}, "
                               f"less than the {ledger.reserved(g)} reserved")

    # -- driving the loop ----------------------------------------------------------------------
    def spin(self, n: int) -> None:
        async def steps() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.loop.run_until_complete(steps())

    def now(self, fn: Callable[[], Any]) -> Any:
        """Call a synchronous controller API from inside the loop, as the server does."""
        async def call() -> Any:
            return fn()

        return self.loop.run_until_complete(call())

    def wait(self, what: str, kid: str, aw: Callable[[], Awaitable[Any]], n: int) -> None:
        self.waiters.append(Waiter(what, kid, self.loop.create_task(aw())))
        self.spin(n)

    def pending(self) -> list[Waiter]:
        return [w for w in self.waiters if not w.task.done()]

    def in_flight(self) -> list[str]:
        return [k for k, s in self.controller.states.items() if s.op is not None]

    # -- callers ----------------------------------------------------------------------------------
    async def _ensure(self, kid: str, trigger: str, parent: dict[str, Any] | None) -> None:
        drops = self.controller.get(kid).drops
        await self.controller.ensure_resident(kid, trigger=trigger, parent=parent)
        self.expect_resident(kid, f"ensure_resident({kid}) returned", drops)

    async def _release(self, kid: str, by_kernel: bool) -> None:
        st_ = self.controller.get(kid)
        drops = st_.drops
        await self.controller.release(kid, reason="requested", by_kernel=by_kernel)
        if st_.drops == drops and (st_.held is None or not self.node.procs[kid].all_off_gpu):
            self.violation(f"release({kid}) returned but the state is {st_.state} and the node has "
                           f"{self.node.procs[kid].on_gpu} on the GPU")

    async def _restore_202(self, kid: str) -> None:
        """REST restore's background path: start (or join) the restore, then wait for it."""
        op = self.controller.start_restore(kid, trigger="rest")
        await asyncio.shield(op.task)

    def expect_resident(self, kid: str, when: str, drops: int) -> None:
        st_ = self.controller.states[kid]
        proc = self.node.procs[kid]
        if st_.drops == drops and (st_.held is not None or not proc.all_on_gpu):
            self.violation(f"{when}, but the node has {proc.on_gpu} of {proc.footprint} on the GPU "
                           f"(running={proc.running}): the cell would run without its state")

    @rule(k=kernel_ids, n=spins)
    def rest_release(self, k: str, n: int) -> None:
        self.wait("release", k, lambda: self._release(k, by_kernel=False), n)

    @rule(k=kernel_ids, n=spins)
    def magic_release(self, k: str, n: int) -> None:
        """%gpushare release: asked by the cell that runs now."""
        self.wait("release", k, lambda: self._release(k, by_kernel=True), n)

    @rule(k=kernel_ids, cells=st.integers(1, 3), progress=st.booleans(), n=spins)
    def cells_wait(self, k: str, cells: int, progress: bool, n: int) -> None:
        """The gate (or the agent) waits for a restore before cells run."""
        parent = {"msg_id": "m", "msg_type": "execute_request"} if progress else None
        for _ in range(cells):
            self.wait("ensure", k, lambda: self._ensure(k, "gate", parent), 0)
        self.spin(n)

    @rule(k=kernel_ids, n=spins)
    def rest_restore(self, k: str, n: int) -> None:
        self.wait("restore", k, lambda: self.controller.restore(k, trigger="rest"), n)

    @rule(k=kernel_ids, n=spins)
    def rest_restore_background(self, k: str, n: int) -> None:
        self.wait("restore", k, lambda: self._restore_202(k), n)

    @rule(k=kernel_ids, n=spins)
    def lazy_gate_settles(self, k: str, n: int) -> None:
        self.wait("settle", k, lambda: self.controller.settle(k), n)

    @precondition(lambda self: self.pending())
    @rule(i=st.integers(0, 50), n=spins)
    def close_tab(self, i: int, n: int) -> None:
        """A websocket closes, a request is dropped: the caller's waiting is cancelled."""
        pending = self.pending()
        w = pending[i % len(pending)]
        w.cancelled_by_us = True
        w.task.cancel()
        self.spin(n)

    @rule(k=kernel_ids, n=spins)
    def interrupt(self, k: str, n: int) -> None:
        self.now(lambda: self.controller.stop_waiting(k, "interrupted while waiting"))
        self.spin(n)

    @rule(k=kernel_ids, outcome=st.sampled_from(RELEASE_OUTCOMES), stall=st.booleans())
    def script_release(self, k: str, outcome: str, stall: bool) -> None:
        self.plans.setdefault((k, "release"), deque()).append(Plan(outcome, stall))

    @rule(k=kernel_ids, outcome=st.sampled_from(RESTORE_OUTCOMES), stall=st.booleans())
    def script_restore(self, k: str, outcome: str, stall: bool) -> None:
        self.plans.setdefault((k, "restore"), deque()).append(Plan(outcome, stall))

    @precondition(lambda self: self.stalls)
    @rule(i=st.integers(0, 10), n=spins)
    def let_go(self, i: int, n: int) -> None:
        kid = sorted(self.stalls)[i % len(self.stalls)]
        self.stalls[kid].set()
        self.spin(n)

    @rule(g=st.sampled_from(sorted(CAPACITY)), share=st.sampled_from([0.5, 1.0]))
    def another_process_allocates(self, g: int, share: float) -> None:
        """Another process takes GPU memory that no restore has reserved (it cannot take
        memory a restore is about to use: that race belongs to the hardware, not to us)."""
        room = self.node.free(g) - self.controller.reservations.reserved(g)
        self.node.other[g] += max(0, int(room * share))

    @rule(g=st.sampled_from(sorted(CAPACITY)))
    def another_process_frees(self, g: int) -> None:
        self.node.other[g] = 0

    @precondition(lambda self: not any(s.op is not None and s.op.kind == "release"
                                       for s in self.controller.states.values()))
    @rule(share=st.sampled_from([0.0, 0.5, 1.0]))
    def host_memory_use(self, share: float) -> None:
        """Another process on the host uses memory (never during a release: that race is the
        OS's, the controller cannot see it coming)."""
        self.node.host_other = 0
        self.node.host_other = int((HOST_TOTAL - self.node.host_used()) * share)

    @rule(k=kernel_ids, busy=st.booleans())
    def cell_runs(self, k: str, busy: bool) -> None:
        self.node.procs[k].busy = busy
        if not busy:
            self.tracker.touch(k)

    @rule(k=kernel_ids, n=spins)
    def restart(self, k: str, n: int) -> None:
        """The kernel restarts: the old process and its state are gone (the agent reconnects
        with a new pid, which drops the held state)."""
        def restart() -> None:  # the agent reconnects with the new pid at once
            self.node.restart(k)
            self.controller.drop_held(k, "the kernel restarted")

        self.now(restart)
        self.spin(n)

    @precondition(lambda self: any(not self.node.procs[k].footprint for k in KERNELS))
    @rule(i=st.integers(0, 10))
    def restarted_kernel_allocates(self, i: int) -> None:
        """A cell in a restarted kernel allocates its GPU state again, where there is room."""
        empty = [k for k in KERNELS if not self.node.procs[k].footprint]
        kid = empty[i % len(empty)]
        st_ = self.controller.states.get(kid)
        if st_ is not None and st_.is_held:
            return  # its cells wait for a restore
        fp = FOOTPRINTS[kid]
        if all(self.node.free(g) - self.controller.reservations.reserved(g) >= b for g, b in fp.items()):
            proc = self.node.procs[kid]
            proc.footprint, proc.on_gpu = dict(fp), dict(fp)
            self.tracker.touch(kid)

    @rule(seconds=st.sampled_from([1.0, 31.0, 61.0]), n=spins)
    def time_passes(self, seconds: float, n: int) -> None:
        clock.advance(seconds)
        self.loop.virtual += seconds
        self.spin(n)

    @rule(n=spins)
    def poll(self, n: int) -> None:
        """The poll loop: one sample, then tick (automatic releases, watchdog, wake-ups)."""
        self.loop.run_until_complete(self._poll())
        self.spin(n)

    @rule(n=st.integers(1, 30))
    def run_loop(self, n: int) -> None:
        self.spin(n)

    @precondition(lambda self: self.steps >= 10 and self.shutdown_task is None)
    @rule(n=spins)
    def shutdown(self, n: int) -> None:
        self.shutdown_task = self.loop.create_task(self.controller.shutdown(timeout=30))
        self.spin(n)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @invariant()
    def nothing_went_wrong_inside(self) -> None:
        """No two operations at once on a kernel, no restore without room, no OOM, no bug."""
        assert not self.violations, "\n".join(self.violations)

    @invariant()
    def callers_get_answers_not_errors(self) -> None:
        """A caller gets a result or a ControllerError (4xx); never another exception (500),
        and never a cancellation it did not ask for."""
        for w in self.waiters:
            if not w.task.done():
                continue
            if w.task.cancelled():
                assert w.cancelled_by_us, f"{w.what} of {w.kid} was cancelled by the controller"
                continue
            e = w.task.exception()
            assert e is None or isinstance(e, ControllerError), f"{w.what} of {w.kid} raised {e!r}"
        self.waiters = self.pending()

    @invariant()
    def every_state_is_true(self) -> None:
        for kid in KERNELS:
            st_ = self.controller.states.get(kid)
            proc = self.node.procs[kid]
            if st_ is None:
                assert proc.all_on_gpu
                continue
            state, op, held = st_.state, st_.op, st_.held
            where = f"{kid} is {state} (op {op}, held {held}); node: {proc}"
            assert proc.intact, f"part of the state is neither on the GPU nor in host memory: {where}"
            assert op is None or not op.task.done(), f"an ended operation is still in flight: {where}"
            if st_.waiting is not None:
                assert op is not None and op.kind == "restore" and op.phase == "waiting", \
                    f"says it waits ({st_.waiting}) with no restore waiting: {where}"
            if held is None:
                assert proc.all_on_gpu, f"nothing held, yet its state is not all on the GPU: {where}"
            if state in RESIDENT:
                assert proc.all_on_gpu, f"shown resident while its state is off the GPU: {where}"
            elif state == RELEASED:
                assert held is not None and held.complete and proc.all_off_gpu, where
                assert held.gpus == {g: b for g, b in proc.footprint.items() if b}, \
                    f"released, but held bytes are not the bytes off the GPU: {where}"
            elif state == FAILED:
                assert held is not None and st_.error, f"failed without a reason: {where}"
            else:
                assert state in (RELEASING, RESTORING) and op is not None, where
            if held is not None:
                for g in proc.footprint:
                    assert proc.off(g) <= held.gpus.get(g, 0), \
                        f"{proc.off(g)} bytes off GPU {g} but only {held.gpus.get(g, 0)} held: {where}"

    @invariant()
    def bytes_accounted_per_gpu(self) -> None:
        states = self.controller.states
        for g, total in CAPACITY.items():
            on = sum(p.on_gpu.get(g, 0) for p in self.node.procs.values())
            assert self.node.used(g) == self.node.other[g] + on <= total
            off = sum(self.node.procs[k].off(g) for k in KERNELS)
            held = sum(s.held.gpus.get(g, 0) for s in states.values() if s.held is not None)
            assert off <= held, f"GPU {g}: {off} bytes off the GPU, only {held} held by the controller"
        assert self.node.host_used() <= HOST_TOTAL

    @invariant()
    def reservations_belong_to_restores(self) -> None:
        ledger = self.controller.reservations
        restores = [s for s in self.controller.states.values()
                    if s.op is not None and s.op.kind == "restore" and s.held is not None]
        for g in CAPACITY:
            needs = [self.controller._need(s.held)  # type: ignore[arg-type]
                     for s in restores if s.op is not None and s.op.phase == "moving"]
            reserved = ledger.reserved(g)
            assert reserved <= sum(n.get(g, 0) for n in needs), \
                f"GPU {g}: {reserved} bytes reserved, no restore moving there"
            if ledger.busy(g):
                assert any(g in self.controller._need(s.held) for s in restores  # type: ignore[arg-type]
                           ), f"GPU {g} is locked with no restore on it: {ledger.snapshot()}"

    # -- the end ------------------------------------------------------------------------------------
    def _drain(self, why: str) -> None:
        """Let every stall go and run until no operation is in flight and nobody waits."""
        for _ in range(200):
            for gate in list(self.stalls.values()):
                gate.set()
            self.plans.clear()
            self.loop.virtual += 5.0  # backoffs and time limits fire
            self.spin(20)
            self.loop.run_until_complete(self._poll())
            shutting = self.shutdown_task is not None and not self.shutdown_task.done()
            if not self.in_flight() and not self.pending() and not shutting:
                return
        raise AssertionError(f"{why}: still in flight after every stall was let go: "
                             f"{self.in_flight()}, waiting: {self.pending()}")

    def teardown(self) -> None:
        try:
            if self.violations:
                return  # the invariant has said it; the loop may be wedged
            self.node.other = {g: 0 for g in CAPACITY}
            self.node.host_other = 0
            self._drain("wedged")
            self.callers_get_answers_not_errors()
            closing = self.controller.closing
            for _ in range(5):  # restores make kernels active; nothing releases them again
                held = [k for k in KERNELS if self.controller.needs_restore(k)]
                if not held or closing:
                    break
                for kid in held:
                    self.wait("ensure", kid, lambda kid=kid: self._ensure(kid, "rest", None), 0)
                self._drain("restoring every held kernel")
                for w in self.waiters:
                    assert w.task.done() and w.task.exception() is None, \
                        f"{w.what} of {w.kid} with plenty of room: {w.task.exception()!r}"
                self.waiters = []
            self.every_state_is_true()
            self.nothing_went_wrong_inside()
            for kid in KERNELS:
                st_ = self.controller.states.get(kid)
                proc = self.node.procs[kid]
                assert not proc.wedged, f"{kid} is wedged"
                if st_ is not None and st_.is_held:
                    assert closing, f"{kid} is still {st_.state} after a restore with plenty of room"
                    continue  # shutdown left it held in host memory, and says so
                assert proc.all_on_gpu, f"{kid} ended without its state on the GPU: {proc}"
            assert not self.controller.reservations.snapshot()
            assert not any(self.controller.reservations.busy(g) for g in CAPACITY)
            assert not self.controller.host_inflight
        finally:
            logging.getLogger("jupyter_gpushare").removeHandler(self.bugs)
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.spin(5)
            self.loop.close()
            clock.reset()


ControllerModel.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestControllerModel = ControllerModel.TestCase
