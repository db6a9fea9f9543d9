"""A model-based test of the controller: hypothesis drives a real ``Controller`` through
releases, restores, failures, stalls, closed tabs, interrupts, restarts and shutdown, and
checks the product's promise after every step against a fake GPU node that owns the truth
of where each kernel's bytes are.

The fakes sit where the hardware does: the GPU node (memory per GPU, other processes, host
memory), the tracker's records of it (re-read on every poll, as NVML would be), each
kernel's agent, and a reclaim method that moves the node's bytes and can, per call as
hypothesis draws it (or a test scripts it), succeed, fail before moving anything, fail after
moving some bytes with or without a confirmed undo, time out, lose its channel, or stall
until a rule lets it go. Everything else (operations, waiting, reservations, policy,
make-room, shutdown) is the real controller on a real event loop whose clock the test moves.

After the state machine, the sequences it found (each a bug, fixed) are plain tests.
``GPUSHARE_HYPOTHESIS_EXAMPLES`` (default 400) and ``GPUSHARE_HYPOTHESIS_STEPS`` (50) raise
the search for a long run; ``--hypothesis-show-statistics`` says which paths it reached.
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

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jupyter_gpushare import clock, policy
from jupyter_gpushare.core.controller import (
    RETRY_AFTER_FAILED_RELEASE,
    Controller,
    ControllerError,
    Held,
    Lifecycle,
)
from jupyter_gpushare.core.hostmem import HostRoom
from jupyter_gpushare.core.tracker import GPURecord, KernelRecord
from jupyter_gpushare.protocol import RemoteError
from jupyter_gpushare.reclaim import (
    KernelTarget,
    ReclaimError,
    ReclaimMethod,
    ReclaimResult,
    Support,
)
from jupyter_gpushare.states import FAILED, NOT_HELD, RELEASED, RELEASING, RESTORING
from jupyter_gpushare.telemetry import GPUInfo

MiB = 1 << 20
GiB = 1 << 30
CAPACITY = {0: 3584 * MiB, 1: 3584 * MiB}
#: each kernel's GPU state, per GPU; together they fit on the node with room to spare, also
#: for k3's restore, which reserves its bytes and a context on every GPU (see UNATTRIBUTED)
FOOTPRINTS = {
    "k0": {0: 1536 * MiB},
    "k1": {0: 1 * GiB, 1: 1 * GiB},
    "k2": {1: 1536 * MiB},
    "k3": {0: 512 * MiB},
}
KERNELS = sorted(FOOTPRINTS)
NO_AGENT = {"k2"}  # a kernel without the agent (an R kernel): the live execution state says "busy"
#: in a container NVML cannot see this kernel's pid: its bytes are the agent's own count, on a
#: GPU the server cannot tell (-1), so a restore reserves them, plus a CUDA context, on every GPU
UNATTRIBUTED = {"k3"}
CONTEXT_BYTES = 128 * MiB
HOST_TOTAL = 6 * GiB
HOST_RESERVE = 256 * MiB
#: policies an example runs under: idle releases after 60 s and pressure releases; or only
#: make-room (kernels idle for 30 s are released when a restore needs their room)
CONFIGS = {
    "idle and pressure": policy.PolicyConfig(idle_timeout=60, idle_utilization=5, min_release_bytes=0,
                                             pressure_free_fraction=0.1, pressure_idle_timeout=30),
    "make-room only": policy.PolicyConfig(idle_timeout=3600, idle_utilization=5, min_release_bytes=0,
                                          pressure_free_fraction=0.0, pressure_idle_timeout=30),
}
#: what a method call does, drawn per call ("ok" more often, so kernels do get released)
RELEASE_OUTCOMES = ("ok", "ok", "ok", "refused", "undone", "unconfirmed", "timeout", "lost")
RESTORE_OUTCOMES = ("ok", "ok", "ok", "fail")

EXAMPLES = int(os.environ.get("GPUSHARE_HYPOTHESIS_EXAMPLES", "400"))
STEPS = int(os.environ.get("GPUSHARE_HYPOTHESIS_STEPS", "50"))


def note(text: str) -> None:
    """Count a path an example reached (--hypothesis-show-statistics); nothing outside one."""
    if currently_in_test_context():
        event(text)


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
        #: the live kernels' processes (a kernel shut down is gone from here, memory and all)
        self.procs = {kid: Proc(1000 + i, dict(fp), dict(fp)) for i, (kid, fp) in enumerate(FOOTPRINTS.items())}
        self.next_pid = 2000
        self.nvml_broken = False  # free memory cannot be read

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

    def proc_of(self, kid: str, pids: list[int]) -> Proc | None:
        """The kernel's process if it is one of ``pids`` (None: it exited or was replaced)."""
        proc = self.procs.get(kid)
        return proc if proc is not None and proc.pid in pids else None


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
        for kid in set(self.kernels) - self.km:
            del self.kernels[kid]  # shut down: no record kept
        for kid, rec in self.kernels.items():
            proc = self.node.procs[kid]
            rec.pids = [proc.pid]
            on_gpu = {g: b for g, b in proc.on_gpu.items() if b}
            if kid in UNATTRIBUTED:  # NVML cannot see the pid: the agent's own count, GPU unknown
                rec.gpu_bytes = {-1: sum(on_gpu.values())} if on_gpu else {}
                rec.pid_gpu_bytes, rec.attributed = {}, False
            else:
                rec.gpu_bytes = on_gpu
                rec.pid_gpu_bytes = {proc.pid: dict(on_gpu)} if on_gpu else {}
            rec.execution_state = "busy" if proc.busy else "idle"
            rec.sm_utilization = 0.0 if rec.gpu_bytes else None
            if proc.busy:
                rec.last_activity = now
            rec.history.append((now, rec.gpu_memory_bytes, rec.sm_utilization, dict(rec.gpu_bytes)))
        for g, total in CAPACITY.items():
            used = None if self.node.nvml_broken else self.node.used(g)
            info = GPUInfo(index=g, uuid=f"GPU-fake-{g}", name="fake", memory_total=total,
                           memory_used=used, utilization=0.0)
            self.gpus[g] = GPURecord(info)

    def touch(self, kid: str) -> None:
        rec = self.kernels.get(kid)
        if rec is not None:
            rec.last_activity = clock.now()


class FakeAgent:
    """A kernel's agent: it arbitrates "busy" and shows progress lines."""

    def __init__(self, node: FakeNode, kid: str) -> None:
        self.node, self.kid = node, kid
        self.asked: dict[str, int] = {}  # requests per op

    async def request(self, op: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        self.asked[op] = self.asked.get(op, 0) + 1
        await asyncio.sleep(0)  # a round trip over the socket
        proc = self.node.procs.get(self.kid)
        if proc is None:
            raise ConnectionError("the agent's channel closed")
        if op == "begin_release":
            if proc.busy and not args.get("by_kernel"):
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

    def _wedged(self, kid: str, proc: Proc) -> ReclaimError:
        """What a real restore that runs out of GPU memory does: the process is stuck for good
        (https://github.com/NVIDIA/cuda-checkpoint/issues/44)."""
        proc.wedged = True
        self.model.violation(f"the restore of {kid} ran out of GPU memory: wedged ({proc})")
        return ReclaimError("out of memory during the restore", retryable=False)

    @staticmethod
    def _free_host_copy(proc: Proc) -> None:
        proc.host = {g: n for g, n in proc.host.items() if proc.off(g) and n}

    async def release(self, target: KernelTarget, progress: Any = None) -> ReclaimResult:
        try:
            result = await self._release(target)
        except BaseException:
            self.model.release_ended(target.kernel_id, ok=False)
            raise
        self.model.release_ended(target.kernel_id, ok=True)
        return result

    async def _release(self, target: KernelTarget) -> ReclaimResult:
        kid = target.kernel_id
        with self._alone(kid, "release"):
            plan = self.model.next_plan(kid, "release", RELEASE_OUTCOMES)
            self.model.check_not_hot(kid)
            note(f"release: {plan.outcome}" + (", stalled" if plan.stall else ""))
            proc = self.node.proc_of(kid, target.pids)
            if proc is None:
                raise ConnectionError("the kernel's process is gone")
            if plan.outcome == "refused":
                raise ReclaimError("lock timed out: GPU work still running", resident=True)
            proc.running = False  # locked: from here its GPU calls block
            self._move_off(proc, half=True)
            if plan.stall:
                await self._stall(kid)
            if self.node.procs.get(kid) is not proc:
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
            plan = self.model.next_plan(kid, "restore", RESTORE_OUTCOMES)
            note(f"restore: {plan.outcome}" + (", stalled" if plan.stall else ""))
            proc = self.node.proc_of(kid, target.pids)
            if proc is None:
                raise ReclaimError("the process that held the state is gone", retryable=False)
            self.model.check_room_for_restore(kid, proc)
            if proc.wedged:
                raise ReclaimError("the process is wedged", retryable=False)
            before = dict(proc.on_gpu)
            if plan.stall:
                if not self._move_back(proc, half=True):
                    raise self._wedged(kid, proc)
                await self._stall(kid)
                if self.node.procs.get(kid) is not proc:
                    raise ReclaimError("the process exited during the restore", retryable=False)
            if plan.outcome == "fail":
                proc.on_gpu = before  # all or nothing: the host copy stays, nothing else changed
                raise ReclaimError("restore failed: the driver said no")
            moved = sum(proc.off(g) for g in proc.footprint)
            if not self._move_back(proc):
                raise self._wedged(kid, proc)
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
gpus = st.sampled_from(sorted(CAPACITY))
spins = st.integers(0, 8)
MANUAL = "requested"  # the reason this test's callers give; every other release is automatic


class ControllerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        clock.reset()
        self.loop = VirtualTimeLoop()
        self.node = FakeNode()
        self.data: st.DataObject | None = None  # draws each method call's outcome
        self.calm = False  # the end: every call succeeds at once
        self.script: deque[Plan] = deque()  # outcomes set by a test, used before drawing any
        self.read_gate: asyncio.Event | None = None  # set by a test: reads of free memory wait
        self.host_gate: asyncio.Event | None = None  # set by a test: reads of host memory wait
        self.draw_error: BaseException | None = None  # raised inside a task: re-raised by run()
        self.stalls: dict[str, asyncio.Event] = {}
        self.violations: list[str] = []
        self.waiters: list[Waiter] = []
        self.failed_release_at: dict[str, float] = {}  # kernel -> clock of its last failed release
        #: every kernel state the controller has had: one it forgot (a kernel shut down) may
        #: still have an operation moving bytes, which holds GPU locks and room
        self.known: dict[str, Lifecycle] = {}
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
            config=CONFIGS["idle and pressure"],
            node_room=self,  # this harness is both ports: the fake node and its kernels
            kernels=self,
            emit=lambda payload: None,
            host_memory_reserve=HOST_RESERVE,
            context_bytes=CONTEXT_BYTES,
        )
        await self._poll()

    # -- the fakes' plumbing ---------------------------------------------------------------
    async def read_free(self, gpus: list[int]) -> dict[int, int | None]:
        await asyncio.sleep(0)  # read on the sampling thread
        if self.read_gate is not None:  # a read that takes a while (a test holds it)
            await self.read_gate.wait()
        return {g: None if self.node.nvml_broken else self.node.free(g) for g in gpus}

    async def host_room(self, pid: int | None) -> HostRoom:
        await asyncio.sleep(0)
        if self.host_gate is not None:
            await self.host_gate.wait()
        available = HOST_TOTAL - self.node.host_used()
        return HostRoom(available, "machine", f"the machine has {available} bytes available")

    def total_bytes(self) -> dict[int, int]:
        return dict(CAPACITY)

    async def refresh(self) -> None:
        await self._poll()

    async def node_view(self, gpus: list[int]) -> None:
        return None  # no hub service on this node

    def overrides(self, kid: str) -> dict[str, Any]:
        return {}

    def method_for(self, kid: str) -> str | None:
        return "fake"

    def agent(self, kid: str) -> Any:
        return self.agents.get(kid)

    def live_state(self, kid: str) -> str:
        proc = self.node.procs.get(kid)
        return "unknown" if proc is None else "busy" if proc.busy else "idle"

    async def _poll(self) -> None:
        """The app's poll_once: one sample, then the controller's tick; polls never overlap."""
        async with self.poll_lock:
            await asyncio.sleep(0)
            self.tracker.poll()
            for problem in self.room_problems():  # what the policy is about to see
                self.violation(f"at a poll: {problem}")
            await self.controller.tick()

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def next_plan(self, kid: str, kind: str, outcomes: tuple[str, ...]) -> Plan:
        """What this call does: drawn now, so a method can fail or stall at every step."""
        if self.script:
            return self.script.popleft()
        if self.calm or self.data is None or self.draw_error is not None:
            return Plan()
        try:
            return self.data.draw(st.builds(Plan, st.sampled_from(outcomes), st.booleans()),
                                  label=f"{kind} of {kid}")
        except BaseException as e:  # hypothesis stops the example: say so outside the loop
            self.draw_error = e
            return Plan()

    def release_ended(self, kid: str, ok: bool) -> None:
        if ok:
            self.failed_release_at.pop(kid, None)
        else:
            self.failed_release_at[kid] = clock.now()

    def check_not_hot(self, kid: str) -> None:
        """An automatic release (policy, pressure, make-room) never retries a kernel whose
        release failed within RETRY_AFTER_FAILED_RELEASE: no hot loop of failing releases."""
        op = self.controller.states[kid].op
        if op is not None and op.trigger.startswith("making room"):
            note("a kernel was released to make room")
        failed_at = self.failed_release_at.get(kid)
        if op is not None and op.trigger != MANUAL and failed_at is not None \
                and clock.now() - failed_at < RETRY_AFTER_FAILED_RELEASE:
            self.violation(f"{kid} released again automatically ({op.trigger}) "
                           f"{clock.now() - failed_at:.0f} s after its release failed")

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

    @staticmethod
    def expected_held(kid: str, proc: Proc) -> dict[int, int]:
        """What a complete release must hold: the bytes per GPU, or (GPU unknown) in all."""
        on = {g: b for g, b in proc.footprint.items() if b}
        return {-1: sum(on.values())} if kid in UNATTRIBUTED and on else on

    @staticmethod
    def held_on(held: Held, gpu: int) -> int:
        return held.gpus.get(gpu, 0) + held.gpus.get(-1, 0)

    # -- driving the loop ----------------------------------------------------------------------
    def run(self, aw: Awaitable[Any]) -> Any:
        """Run the loop until ``aw`` is done (its own steps and everyone else's)."""
        result = self.loop.run_until_complete(aw)
        if self.draw_error is not None:
            raise self.draw_error
        return result

    def spin(self, n: int) -> None:
        async def steps() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.run(steps())

    def now(self, fn: Callable[[], Any]) -> Any:
        """Call a synchronous controller API from inside the loop, as the server does."""
        async def call() -> Any:
            return fn()

        return self.run(call())

    def wait(self, what: str, kid: str, aw: Callable[[], Awaitable[Any]], n: int) -> None:
        self.waiters.append(Waiter(what, kid, self.loop.create_task(aw())))
        self.spin(n)

    def pending(self) -> list[Waiter]:
        return [w for w in self.waiters if not w.task.done()]

    def in_flight(self) -> list[str]:
        return [k for k, s in self.known.items() if s.op is not None]

    # -- callers ----------------------------------------------------------------------------------
    async def _ensure(self, kid: str, trigger: str, parent: dict[str, Any] | None) -> None:
        drops = self.controller.get(kid).drops
        await self.controller.ensure_resident(kid, trigger=trigger, parent=parent)
        self.expect_resident(kid, f"ensure_resident({kid}) returned", drops)

    async def _release(self, kid: str, by_kernel: bool) -> None:
        st_ = self.controller.get(kid)
        drops = st_.drops
        await self.controller.release(kid, reason=MANUAL, by_kernel=by_kernel)
        proc = self.node.procs.get(kid)
        if proc is None:
            return  # shut down meanwhile
        if st_.drops == drops and (st_.held is None or not proc.all_off_gpu):
            self.violation(f"release({kid}) returned but the state is {st_.state} and the node "
                           f"has {proc} on the GPU")

    async def _restore_202(self, kid: str) -> None:
        """REST restore's background path: start (or join) the restore, then wait for it."""
        op = self.controller.start_restore(kid, trigger="rest")
        await asyncio.shield(op.task)

    def expect_resident(self, kid: str, when: str, drops: int) -> None:
        st_ = self.controller.states.get(kid)
        proc = self.node.procs.get(kid)
        if st_ is None or proc is None:
            return  # shut down meanwhile
        if st_.drops == drops and (st_.held is not None or not proc.all_on_gpu):
            self.violation(f"{when}, but the node has {proc.on_gpu} of {proc.footprint} on the GPU "
                           f"(running={proc.running}): the cell would run without its state")

    @initialize(data=st.data(), config=st.sampled_from(sorted(CONFIGS)))
    def start(self, data: st.DataObject, config: str) -> None:
        self.data = data  # each method call draws its outcome from it
        self.controller.config = CONFIGS[config]

    @rule(k=kernel_ids, by_kernel=st.booleans(), n=spins)
    def release(self, k: str, by_kernel: bool, n: int) -> None:
        """REST or the panel; by_kernel: %gpushare release, asked by the cell that runs now."""
        self.wait("release", k, lambda: self._release(k, by_kernel=by_kernel), n)

    @rule(k=kernel_ids, cells=st.integers(1, 3), progress=st.booleans(), n=spins)
    def cells_wait(self, k: str, cells: int, progress: bool, n: int) -> None:
        """The gate (or the agent) waits for a restore before cells run."""
        parent = {"msg_id": "m", "msg_type": "execute_request"} if progress else None
        for _ in range(cells):
            self.wait("ensure", k, lambda: self._ensure(k, "gate", parent), 0)
        self.spin(n)

    @rule(k=kernel_ids, how=st.sampled_from(["rest", "background", "agent", "settle"]), n=spins)
    def restore(self, k: str, how: str, n: int) -> None:
        """REST (waiting, or the 202 path that returns and leaves it running), the agent's
        pre_run_cell, or the lazy gate that only waits for an operation to settle."""
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "rest": lambda: self.controller.restore(k, trigger="rest"),
            "background": lambda: self._restore_202(k),
            "agent": lambda: self._ensure(k, "agent", None),
            "settle": lambda: self.controller.settle(k),
        }
        self.wait(how, k, calls[how], n)

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
        if self.now(lambda: self.controller.stop_waiting(k, "interrupted while waiting")):
            note("an interrupt stopped a waiting restore")
        self.spin(n)

    @precondition(lambda self: self.stalls)
    @rule(i=st.integers(0, 10), n=spins)
    def let_go(self, i: int, n: int) -> None:
        kid = sorted(self.stalls)[i % len(self.stalls)]
        self.stalls[kid].set()
        self.spin(n)

    @rule(g=gpus, share=st.sampled_from([0.0, 0.5, 1.0, 1.0]))
    def another_process(self, g: int, share: float) -> None:
        """Another process frees its GPU memory (share 0) or takes some that no restore has
        reserved (it cannot take memory a restore is about to use: that race belongs to the
        hardware, not to the controller)."""
        if not share:
            self.node.other[g] = 0
            return
        room = self.node.free(g) - self.controller.reservations.reserved(g)
        self.node.other[g] += max(0, int(room * share))

    @rule(broken=st.booleans())
    def nvml_fails(self, broken: bool) -> None:
        """Free GPU memory cannot be read (NVML errors): that counts as no room."""
        self.node.nvml_broken = broken

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
        proc = self.node.procs.get(k)
        if proc is not None:
            proc.busy = busy
            if not busy:
                self.tracker.touch(k)

    @rule(k=kernel_ids, pinned=st.booleans())
    def pin(self, k: str, pinned: bool) -> None:
        if k in self.node.procs:
            self.now(lambda: self.controller.set_pinned(k, pinned))

    @rule(k=kernel_ids, n=spins)
    def restart(self, k: str, n: int) -> None:
        """The kernel restarts: the old process and its state are gone (the agent reconnects
        with a new pid, which drops the held state)."""
        if k not in self.node.procs:
            return

        def restart() -> None:  # the agent reconnects with the new pid at once
            self.node.restart(k)
            self.controller.drop_held(k, "the kernel restarted")

        self.now(restart)
        self.spin(n)

    @precondition(lambda self: any(not p.footprint for p in self.node.procs.values()))
    @rule(i=st.integers(0, 10))
    def restarted_kernel_allocates(self, i: int) -> None:
        """A cell in a restarted kernel allocates its GPU state again, where there is room."""
        empty = sorted(k for k, p in self.node.procs.items() if not p.footprint)
        kid = empty[i % len(empty)]
        st_ = self.controller.states.get(kid)
        if st_ is not None and st_.is_held:
            return  # its cells wait for a restore
        fp = FOOTPRINTS[kid]
        if all(self.node.free(g) - self.controller.reservations.reserved(g) >= b for g, b in fp.items()):
            proc = self.node.procs[kid]
            proc.footprint, proc.on_gpu = dict(fp), dict(fp)
            self.tracker.touch(kid)

    @precondition(lambda self: len(self.node.procs) == len(KERNELS))  # one per example
    @rule(k=kernel_ids, n=spins)
    def kernel_shuts_down(self, k: str, n: int) -> None:
        """The kernel is shut down: its process exits and its memory (GPU and host) with it."""
        if k in self.node.procs:
            del self.node.procs[k]
            self.tracker.km.discard(k)
        self.spin(n)

    @rule(seconds=st.sampled_from([1.0, 31.0, 31.0, 61.0]), n=spins)
    def time_passes(self, seconds: float, n: int) -> None:
        clock.advance(seconds)
        self.loop.virtual += seconds
        self.spin(n)

    @rule(n=spins)
    def poll(self, n: int) -> None:
        """The poll loop: one sample, then tick (automatic releases, watchdog, wake-ups)."""
        self.run(self._poll())
        self.spin(n)

    @rule(n=st.integers(1, 30))
    def run_loop(self, n: int) -> None:
        self.spin(n)

    @precondition(lambda self: self.steps >= STEPS * 2 // 3 and self.shutdown_task is None)
    @rule(n=spins)
    def shutdown(self, n: int) -> None:
        self.shutdown_task = self.loop.create_task(self.controller.shutdown(timeout=30))
        self.spin(n)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def count_steps(self) -> None:
        self.steps += 1
        self.known.update(self.controller.states)
        for st_ in self.controller.states.values():
            if st_.waiting:
                note("a restore waited for room")

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
        for kid, st_ in self.controller.states.items():
            op = st_.op
            assert op is None or not op.task.done(), f"an ended operation is still in flight: {kid} {op}"
            if st_.waiting is not None:
                assert op is not None and op.kind == "restore" and op.phase == "waiting", \
                    f"{kid} says it waits ({st_.waiting}) with no restore waiting"
        for kid, proc in self.node.procs.items():
            st_ = self.controller.states.get(kid)
            if st_ is None:
                assert proc.all_on_gpu
                continue
            state, op, held = st_.state, st_.op, st_.held
            where = f"{kid} is {state} (op {op}, held {held}); node: {proc}"
            assert proc.intact, f"part of the state is neither on the GPU nor in host memory: {where}"
            if held is None:
                assert proc.all_on_gpu, f"nothing held, yet its state is not all on the GPU: {where}"
            if state in NOT_HELD:
                assert proc.all_on_gpu, f"shown resident while its state is off the GPU: {where}"
            elif state == RELEASED:
                assert held is not None and held.complete and proc.all_off_gpu, where
                assert held.gpus == self.expected_held(kid, proc), \
                    f"released, but held bytes are not the bytes off the GPU: {where}"
            elif state == FAILED:
                assert held is not None and st_.error, f"failed without a reason: {where}"
            else:
                assert state in (RELEASING, RESTORING) and op is not None, where
            if held is not None:
                for g in proc.footprint:
                    assert proc.off(g) <= self.held_on(held, g), \
                        f"{proc.off(g)} bytes off GPU {g} but only {self.held_on(held, g)} held: {where}"

    @invariant()
    def bytes_accounted_per_gpu(self) -> None:
        states = self.controller.states
        for g, total in CAPACITY.items():
            on = sum(p.on_gpu.get(g, 0) for p in self.node.procs.values())
            assert self.node.used(g) == self.node.other[g] + on <= total
            off = sum(p.off(g) for p in self.node.procs.values())
            held = sum(self.held_on(s.held, g) for s in states.values() if s.held is not None)
            assert off <= held, f"GPU {g}: {off} bytes off the GPU, only {held} held by the controller"
        assert self.node.host_used() <= HOST_TOTAL

    @invariant()
    def reservations_belong_to_restores(self) -> None:
        problems = self.room_problems()
        assert not problems, "\n".join(problems)

    def room_problems(self) -> list[str]:
        """Room is reserved only while a restore moves bytes that are not back yet (once
        back they count as used: reserved too, the GPU would look fuller than it is), and a
        GPU is locked only by a restore that needs it."""
        out = []
        ledger = self.controller.reservations
        self.known.update(self.controller.states)
        restores = [s for s in self.known.values() if s.op is not None and s.op.kind == "restore"]
        needs = [self.controller.need(s.held) for s in restores
                 if s.held is not None and s.op is not None and s.op.phase == "moving"]
        for g in CAPACITY:
            reserved = ledger.reserved(g)
            if reserved > sum(n.get(g, 0) for n in needs):
                out.append(f"GPU {g}: {reserved} bytes reserved, no restore moving there")
            # a restore whose held state was just dropped is being stopped: it may hold a lock
            if ledger.busy(g) and not any(s.held is None or g in self.controller.need(s.held)
                                          for s in restores):
                out.append(f"GPU {g} is locked with no restore on it: {ledger.snapshot()}")
        return out

    # -- the end ------------------------------------------------------------------------------------
    def _drain(self, why: str) -> None:
        """Let every stall go and run until no operation is in flight and nobody waits."""
        for _ in range(200):
            for gate in list(self.stalls.values()):
                gate.set()
            self.calm = True
            self.loop.virtual += 5.0  # backoffs and time limits fire
            self.spin(20)
            self.run(self._poll())
            shutting = self.shutdown_task is not None and not self.shutdown_task.done()
            if not self.in_flight() and not self.pending() and not shutting:
                return
        raise AssertionError(f"{why}: still in flight after every stall was let go: "
                             f"{self.in_flight()}, waiting: {self.pending()}")

    def teardown(self) -> None:
        try:
            if self.violations or self.draw_error is not None:
                return  # the invariant has said it (or hypothesis stopped); the loop may be wedged
            note(f"steps: {'≥30' if self.steps >= 30 else '10-29' if self.steps >= 10 else '<10'}")
            self.node.other = {g: 0 for g in CAPACITY}
            self.node.host_other = 0
            self.node.nvml_broken = False
            self._drain("wedged")
            self.callers_get_answers_not_errors()
            closing = self.controller.closing
            if closing:
                note("the server shut down")
            for _ in range(5):  # restores make kernels active; nothing releases them again
                held = [k for k in self.node.procs if self.controller.needs_restore(k)]
                if not held or closing:
                    break
                note("teardown restored a held kernel")
                for kid in held:
                    self.wait("ensure", kid, lambda kid=kid: self._ensure(kid, "rest", None), 0)
                self._drain("restoring every held kernel")
                for w in self.waiters:
                    assert w.task.done() and w.task.exception() is None, \
                        f"{w.what} of {w.kid} with plenty of room: {w.task.exception()!r}"
                self.waiters = []
            self.every_state_is_true()
            self.reservations_belong_to_restores()
            self.nothing_went_wrong_inside()
            assert set(self.controller.states) <= set(self.node.procs), "a shut-down kernel is remembered"
            for kid, proc in self.node.procs.items():
                st_ = self.controller.states.get(kid)
                assert not proc.wedged, f"{kid} is wedged"
                if st_ is not None and st_.is_held:
                    assert closing, f"{kid} is still {st_.state} after a restore with plenty of room"
                    continue  # shutdown left it held in host memory, and says so
                assert proc.all_on_gpu, f"{kid} ended without its state on the GPU: {proc}"
            assert not self.controller.reservations.snapshot()
            assert not any(self.controller.reservations.busy(g) for g in CAPACITY)
            assert not self.controller.host_inflight
        finally:
            self.close()

    def close(self) -> None:
        """Stop whatever still runs and close the loop (the checks are teardown's)."""
        if self.loop.is_closed():
            return
        try:
            logging.getLogger("jupyter_gpushare").removeHandler(self.bugs)
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            for _ in range(100):  # let every cancellation run its course before the loop closes
                if not asyncio.all_tasks(self.loop):
                    break
                self.loop.run_until_complete(asyncio.sleep(0))
            for w in self.waiters:  # read, so asyncio does not log them as never retrieved
                if w.task.done() and not w.task.cancelled():
                    w.task.exception()
        finally:
            self.loop.close()
            clock.reset()


ControllerModel.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# 400 sequences take 2-4 minutes on 2 idle cores; a loaded machine took longer than the
# suite's 300 s bound per test (a timeout, not a failure of the model)
TestControllerModel = pytest.mark.timeout(900)(ControllerModel.TestCase)


# -- the sequences the state machine found, as plain tests --------------------------------------
# Each failed before its fix in controller.py (the commit says which sequence and why); the
# state machine above keeps looking for more.
@contextmanager
def machine(config: str = "idle and pressure") -> Iterator[ControllerModel]:
    """The model, driven step by step; its teardown's checks run after the test's own."""
    m = ControllerModel()
    m.controller.config = CONFIGS[config]
    try:
        yield m
        m.nothing_went_wrong_inside()
    except BaseException:
        m.close()
        raise
    m.teardown()


def until(m: ControllerModel, cond: Callable[[], bool], what: str) -> None:
    for _ in range(100):
        if cond():
            return
        m.loop.virtual += 1.0  # backoffs fire
        m.spin(10)
    raise AssertionError(f"still waiting for {what}")


def released(m: ControllerModel, kid: str, plan: Plan | None = None) -> Waiter:
    m.script.append(plan or Plan())
    m.release(kid, by_kernel=False, n=0)
    waiter = m.waiters[-1]
    until(m, waiter.task.done, f"the release of {kid}")
    return waiter


def restored(m: ControllerModel, kid: str) -> None:
    m.cells_wait(kid, cells=1, progress=False, n=0)
    waiter = m.waiters[-1]
    until(m, waiter.task.done, f"the restore of {kid}")
    assert waiter.task.exception() is None
    assert m.controller.states[kid].state in NOT_HELD and m.node.procs[kid].all_on_gpu


def test_an_operation_stopped_before_it_began_still_ends():
    """A restore started and stopped in one loop iteration (an interrupt right after the
    gate asked): its task never ran, so st.op stayed set for good and its waiters were
    cancelled instead of answered."""
    with machine() as m:
        released(m, "k2")

        def start_and_stop() -> Any:
            op = m.controller.start_restore("k2", trigger="gate")
            assert m.controller.stop_waiting("k2", "interrupted")
            return op

        op = m.now(start_and_stop)
        m.wait("restore", "k2", lambda: m.controller.wait(op), 0)
        waiter = m.waiters[-1]
        until(m, waiter.task.done, "the stopped restore to end")
        assert not waiter.task.cancelled() and not waiter.task.result().ok
        assert m.controller.states["k2"].op is None
        restored(m, "k2")


def test_a_restore_stopped_while_reading_free_memory_leaves_no_gpu_locked():
    with machine() as m:
        released(m, "k1")
        m.read_gate = m.now(asyncio.Event)
        m.cells_wait("k1", cells=1, progress=False, n=0)
        until(m, lambda: m.controller.reservations.busy(0), "the restore to take GPU 0")
        assert m.now(lambda: m.controller.stop_waiting("k1", "interrupted"))
        until(m, m.waiters[-1].task.done, "the restore to stop")
        m.read_gate.set()
        m.read_gate = None
        m.spin(10)
        assert not any(m.controller.reservations.busy(g) for g in CAPACITY)
        restored(m, "k1")  # with a GPU left locked, this waited for good


def test_a_restore_gives_its_room_back_once_its_bytes_land():
    """The poll after a restore counted its bytes as used and as reserved (every poll
    checks the ledger: see _poll)."""
    with machine() as m:
        released(m, "k0")
        restored(m, "k0")
        assert not m.violations


def test_releases_checked_together_must_fit_in_host_memory_together():
    """k0 (1.5 GiB) and k1 (2 GiB) each fit in the 2.5 GiB of host memory left, not both:
    they were both checked before either counted itself in flight (the agent's answer
    came in between), both moved, and the kernels were OOM-killed."""
    with machine() as m:
        m.node.host_other = HOST_TOTAL - HOST_RESERVE - 2560 * MiB
        m.script.extend([Plan(), Plan()])
        for kid in ("k0", "k1"):  # asked at the same moment (two tabs, or one poll's decisions)
            m.waiters.append(Waiter("release", kid, m.loop.create_task(m._release(kid, False))))
        until(m, lambda: not m.pending(), "both releases")
        outcomes = [w.task.exception() for w in m.waiters[-2:]]
        assert outcomes[0] is None  # checked first, moved
        assert isinstance(outcomes[1], ControllerError) and "not fit in host memory" in outcomes[1].message
        assert m.node.host_used() <= HOST_TOTAL - HOST_RESERVE


def test_a_release_that_failed_half_way_needs_room_only_for_what_left():
    """Half of k0's 1.5 GiB left GPU 0 before the release failed unconfirmed; GPU 0 has
    1.25 GiB free, enough for the 768 MiB to bring back, not for 1.5 GiB again: the restore
    waited for memory for good."""
    with machine() as m:
        waiter = released(m, "k0", Plan("unconfirmed"))
        assert isinstance(waiter.task.exception(), ControllerError)
        assert m.controller.states["k0"].state == FAILED
        assert m.node.free(0) == 1280 * MiB and m.node.procs["k0"].off(0) == 768 * MiB
        restored(m, "k0")


def test_a_restore_is_not_promised_what_a_release_in_flight_may_take_back():
    """k0's release has freed 768 MiB of GPU 0 and stalls; k1's restore (1 GiB there) saw
    it free, reserved it and started; k0's release then failed and its undo took the bytes
    back: k1's restore ran out of memory half-way (wedged, on a real GPU)."""
    with machine() as m:
        released(m, "k1")
        m.another_process(0, 0.5)  # GPU 0: 768 MiB free, less than k1 needs there
        m.script.append(Plan("undone", stall=True))
        m.release("k0", by_kernel=False, n=0)
        until(m, lambda: "k0" in m.stalls, "k0's release to stall half-way")
        assert m.node.free(0) >= 1 * GiB  # k1 would fit now, if k0's bytes were gone for good
        m.script.append(Plan("ok", stall=True))
        m.cells_wait("k1", cells=1, progress=False, n=20)
        assert m.controller.states["k1"].waiting  # not while k0 may take its bytes back
        m.let_go(0, n=20)
        assert m.node.procs["k0"].all_on_gpu  # the undo took them back
        assert not m.node.procs["k1"].wedged and m.controller.states["k1"].waiting
        m.another_process(0, 0.0)  # room comes: k1 restores
        until(m, lambda: "k1" in m.stalls, "k1's restore to move")
        m.let_go(0, n=20)
        until(m, lambda: not m.pending(), "k1's restore")
        assert m.node.procs["k1"].all_on_gpu


def test_a_kernel_restarted_while_its_release_starts_is_not_held_for_the_new_process():
    """k2 (no agent) restarts and allocates again while its release reads host memory; a
    poll sees the new process before the release goes on. The release acts on the old pid
    (gone: unconfirmed), but its held state named the new process as its owner, so no poll
    dropped it, and every restore went to the old pid: failed for good."""
    with machine() as m:
        m.host_gate = m.now(asyncio.Event)
        m.release("k2", by_kernel=False, n=0)
        until(m, lambda: m.controller.states["k2"].op is not None, "the release to start")
        m.restart("k2", n=0)
        m.restarted_kernel_allocates(0)
        m.poll(n=0)
        m.host_gate.set()
        until(m, lambda: not m.pending(), "the release to end")
        m.poll(n=10)  # the new process: a state held for the old one is dropped
        st_ = m.controller.states["k2"]
        assert st_.held is None and st_.state in NOT_HELD, st_
        assert m.node.procs["k2"].all_on_gpu


def test_a_restore_goes_on_as_soon_as_make_room_has_freed_its_room():
    """k1 has been idle for 31 s; k0's restore needs 1.5 GiB of GPU 0 where 1 GiB is free,
    so make-room releases k1. Its release's end signalled 'memory freed' while the restore
    was still inside make-room, so the restore slept its backoff (up to 5 s) or until the
    next poll before looking again. It looks again at once now (no time passes here)."""
    with machine("make-room only") as m:
        released(m, "k0")
        m.another_process(0, 0.5)  # GPU 0: 1 GiB free
        m.time_passes(31.0, n=0)
        m.poll(n=0)  # the poll's wake-up is spent before the restore starts waiting
        m.cells_wait("k0", cells=1, progress=False, n=0)
        waiter = m.waiters[-1]
        for _ in range(50):  # the loop runs; the clock does not move
            m.spin(10)
        assert m.controller.states["k1"].state == RELEASED  # made room
        assert waiter.task.done() and waiter.task.exception() is None
        assert m.node.procs["k0"].all_on_gpu


def test_a_victim_that_refuses_is_not_asked_again_and_again():
    """make-room's victim starts a cell after the last poll: its agent refuses the release.
    The restore must not ask again at once (a refused release frees nothing): before, this
    kind of loop made 12,000 attempts in 4 s."""
    with machine("make-room only") as m:
        released(m, "k0")
        m.another_process(0, 0.5)
        m.time_passes(31.0, n=0)
        m.poll(n=0)
        m.cell_runs("k1", busy=True)  # after the poll: only the agent knows
        m.cells_wait("k0", cells=1, progress=False, n=0)
        for _ in range(50):  # the loop runs; the clock does not move
            m.spin(10)
        assert m.agents["k1"].asked.get("begin_release") == 1
        assert m.controller.states["k0"].waiting
        m.cell_runs("k1", busy=False)
        m.time_passes(31.0, n=0)
        until(m, lambda: not m.pending(), "the restore, once k1 is idle again")


def test_a_stop_whose_cancel_was_lost_still_ends_a_waiting_restore():
    """Python 3.11's wait_for can swallow a cancel that lands as the event it waits on is set
    (a release ending at the moment the server shuts down): the restore went on waiting for
    memory, and shutdown gave up on it after 30 s with its state not reported."""
    with machine() as m:
        released(m, "k1")
        m.another_process(0, 1.0)  # GPU 0 full: k1's restore waits for memory
        m.cells_wait("k1", cells=1, progress=False, n=20)
        assert m.controller.states["k1"].waiting
        op = m.controller.states["k1"].op
        assert op is not None
        op.stopped, op.stop_reason = True, "the server is shutting down"  # the cancel was lost
        until(m, m.waiters[-1].task.done, "the stopped restore to end")
        assert m.controller.states["k1"].op is None and m.controller.states["k1"].waiting is None
        assert not any(m.controller.reservations.busy(g) for g in CAPACITY)
        m.another_process(0, 0.0)
        restored(m, "k1")
