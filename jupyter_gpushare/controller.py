"""The per-kernel state machine: the only place a kernel's gpushare state changes.

The promise it keeps: a released kernel comes back exactly as it was, or says why not and
keeps its state; no kernel is left wedged; the state shown is true. How:

- **Operations are owned here.** A release or a restore runs in a task the controller owns;
  callers (the gate, REST, the agent, make-room) only *wait* for it, shielded. A closed tab,
  a network blip or an interrupt stops their waiting, never the bytes in flight; every exit
  of an operation, cancellation included, ends in a true state. One operation per kernel.
- **The held state is one value** (:class:`Held`): set the moment bytes may start to leave
  the GPU, cleared only when a method confirms the kernel runs with all of it on the GPU.
  Undo is reported by the method, never assumed: an unconfirmed one is ``failed`` (held,
  restorable, reason shown), never ``active``.
- **Restores reserve room first** (:mod:`.reservations`): one restore at a time per GPU, its
  bytes reserved before it moves them, so no restore runs without room (a restore without
  room wedges a real process for good).
- **Only a restore's waiting can be cancelled** (an interrupt, server shutdown); once bytes
  move, the operation runs to its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import ahead, clock, metrics, policy
from .hostmem import HostRoom
from .node_locks import NodeLocks
from .reclaim import KernelTarget, ReclaimError, ReclaimMethod
from .reservations import Grant, Reservations
from .states import (
    ACTIVE,
    ALL,
    FAILED,
    IDLE,
    RELEASED,
    RELEASING,
    RESTORING,
    UNTRACKED,
)
from .tracker import KernelRecord, Tracker
from .units import format_bytes

log = logging.getLogger(__name__)

IDLE_AFTER = 60.0  # s without activity before a resident kernel shows as "idle"
#: restores that precede the code of the cell they show progress in (its only output so far)
CLEARED_TRIGGERS = ("gate", "agent")
RETRY_AFTER_FAILED_RELEASE = 60.0  # s before a kernel whose release failed is tried again
WAIT_BACKOFF = (0.25, 5.0)  # s between make-room rounds: first, and the most
STRICT_SETTLE = 0.5  # s between the two readings of a restore without a turn across servers
MEMORY_WAIT = "waiting for memory"


class ControllerError(Exception):
    """A request the state does not allow (409), or for an unknown kernel (404)."""

    def __init__(self, status: int, message: str, retryable: bool = True):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retryable = retryable


@dataclass
class Held:
    """A kernel's GPU state while it is (or may be) off the GPU."""

    method: str
    bytes: int  # bytes that left (or may have left) the GPU
    gpus: dict[int, int]  # GPU index -> bytes to bring back; -1 = a GPU we could not tell
    pids: list[int]  # the processes the method acts on
    pid_bytes: dict[int, dict[int, int]]  # pid -> GPU -> bytes, when known per pid
    kernel_pid: int | None  # the kernel's process when released (a new one = a restart)
    attributed: bool  # bytes measured per process (NVML, simulated) rather than self-reported
    since: float  # clock.now() when the release began
    complete: bool = False  # the release finished: everything is off the GPU


@dataclass
class Outcome:
    """How an operation ended, for whoever waited for it."""

    ok: bool
    message: str = ""
    retryable: bool = True
    dropped: bool = False  # the held state is gone (restart, death): nothing left to restore


@dataclass
class Operation:
    kind: str  # "release" | "restore"
    trigger: str
    task: asyncio.Task[Outcome] = field(init=False, repr=False)  # ends with the operation; never cancelled
    body: asyncio.Task[Outcome] = field(init=False, repr=False)  # the work; only its waiting is stopped
    phase: str = "waiting"  # "waiting" (may be stopped) | "moving" (runs to its end)
    stop_reason: str = ""
    stopped: bool = False  # stop() was called: the waiting loop ends even if its cancel was lost
    on_end: Callable[[], None] | None = None  # gives back what the work claimed, however it ends

    def stop(self, why: str) -> None:
        """Stop the work, not the task waiters await: that one still ends in an Outcome,
        even when the work is stopped before it began."""
        self.stop_reason, self.stopped = why, True
        self.body.cancel()


@dataclass
class KernelState:
    kernel_id: str
    pinned: bool = False
    held: Held | None = None
    op: Operation | None = None
    failed: bool = False  # the last operation went wrong and the state is held
    resident: str = UNTRACKED  # active / idle / untracked, from the last poll
    method: str | None = None
    releases: int = 0
    restores: int = 0
    last_restore_seconds: float | None = None
    last_release_seconds: float | None = None
    error: str | None = None
    retryable: bool = True
    waiting: str | None = None  # why a restore waits, None when it does not
    waiting_note: str | None = None  # what the node-wide service says about that wait
    release_failed_at: float | None = None
    idle_timeout: float | None = None  # per-kernel override (kernelspec metadata, magic)
    background: str | None = None  # the agent saw threads use the GPU outside cells (sticky)
    idle_gpu_work_at: float | None = None  # last sample with GPU work while no cell ran
    allow_background: bool = False  # the user accepts releases despite background work
    host_refusal: str | None = None  # why the state would not fit in host memory now
    drops: int = 0  # times a held state was dropped (restarts): waiters compare it
    drop_after_op: str | None = None  # a restart seen while bytes were moving

    @property
    def state(self) -> str:
        op = self.op
        if op is not None and (op.kind == "release" or op.phase == "moving"):
            return RELEASING if op.kind == "release" else RESTORING
        if self.held is not None:
            return FAILED if self.failed else RELEASED
        return self.resident

    @property
    def is_held(self) -> bool:
        """Cells must wait: the GPU state is (or may soon be) off the GPU."""
        return self.held is not None or (self.op is not None and self.op.kind == "release")

    @property
    def released_bytes(self) -> int:
        return self.held.bytes if self.held is not None else 0

    @property
    def released_gpus(self) -> dict[int, int]:
        return dict(self.held.gpus) if self.held is not None else {}

    @property
    def release_blocked(self) -> str | None:
        """Why an idle kernel is not released automatically (None: nothing stops it)."""
        if self.background and not self.allow_background:
            return self.background
        if self.idle_gpu_work_at is not None and not self.allow_background:
            return ("the GPU computed while no cell ran (a background thread?): a release would "
                    "make that work wait; release by hand or allow it with "
                    "%gpushare allow-background")
        return self.host_refusal


Emit = Callable[[dict[str, Any]], None]
AgentLookup = Callable[[str], Any]


class Controller:
    def __init__(
        self,
        tracker: Tracker,
        methods: dict[str, ReclaimMethod],
        choose_method: Callable[[str], str | None],
        config: policy.PolicyConfig,
        read_free: Callable[[list[int]], Awaitable[dict[int, int | None]]],
        total_bytes: Callable[[], dict[int, int]],
        agent: AgentLookup,
        emit: Emit,
        restore_mode: str = "eager",
        restore_grace: float = 30.0,
        kernel_overrides: Callable[[str], dict[str, Any]] | None = None,
        refresh: Callable[[], Awaitable[None]] | None = None,
        host_room: Callable[[int | None], Awaitable[HostRoom]] | None = None,
        host_memory_reserve: int = 0,
        context_bytes: int = 0,
        live_state: Callable[[str], str] | None = None,
        rules: policy.Policy | None = None,
        clear_progress: bool = True,
        node_locks: NodeLocks | None = None,
    ):
        """
        read_free(gpus): free bytes per GPU read now (None = unknown), off the event loop.
        refresh(): one poll, so what status shows after an operation is of one moment.
        host_room(pid): host memory the kernel's process may still use.
        host_memory_reserve: host bytes a release must leave free.
        context_bytes: counted on top of self-reported bytes when a restore needs room.
        live_state(kernel_id): the kernel's execution state now ("busy", "idle", ...).
        rules: the release rules (``c.GPUShareApp.policy_class``); default: ``policy.Policy``.
        clear_progress: take a restore's progress line out of the cell once it succeeded
            (cells that waited at the gate or in the agent: the line is all they hold yet).
        node_locks: restores also take turns per GPU with other servers on the machine.
        """
        self.tracker = tracker
        self.methods = methods
        self.choose_method = choose_method
        self.config = config
        self.rules = rules or policy.Policy(config)
        self.clear_progress = clear_progress
        self.read_free = read_free
        self.total_bytes = total_bytes
        self.agent = agent
        self.emit = emit
        self.restore_mode = restore_mode
        self.restore_grace = restore_grace
        self.kernel_overrides = kernel_overrides or (lambda kid: {})
        self.refresh = refresh
        self.host_room = host_room
        self.host_memory_reserve = host_memory_reserve
        self.context_bytes = context_bytes
        self.live_state = live_state or (lambda kid: "unknown")
        self.states: dict[str, KernelState] = {}
        self.reservations = Reservations(node_locks, uuid_of=self._gpu_uuid)
        self.host_inflight: dict[str, int] = {}  # host-memory scope -> bytes being released
        self.closing = False
        self.agent_timeout = 10.0  # s the agent has to answer whether a release may start
        self._freed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._busy_since: dict[str, float] = {}

    # -- reading -------------------------------------------------------------------------
    def get(self, kernel_id: str) -> KernelState:
        if kernel_id not in self.states:
            if kernel_id not in self.tracker.kernels and kernel_id not in self.tracker.km:
                raise ControllerError(404, f"no kernel {kernel_id!r} on this server")
            st = self.states[kernel_id] = KernelState(kernel_id)
            st.idle_timeout = self.kernel_overrides(kernel_id).get("idle_timeout")
        return self.states[kernel_id]

    def needs_restore(self, kernel_id: str) -> bool:
        st = self.states.get(kernel_id)
        return st is not None and st.is_held

    def idle_timeout(self, st: KernelState) -> float:
        """The kernel's idle timeout in effect (its own, else the server's; 0 = never)."""
        return policy.effective_idle_timeout(st.idle_timeout, self.config.idle_timeout)

    def candidate(self, st: KernelState, rec: KernelRecord, now: float,
                  pressure_window: float | None = None) -> policy.Candidate:
        """The policy's view of a kernel. ``pressure_window``: seconds over which quietness
        on the GPU is judged for room-making (default ``pressure_idle_timeout``)."""
        # utilization windows of at least one sample
        since = now - max(self.idle_timeout(st), 1.0)
        window = self.config.pressure_idle_timeout if pressure_window is None else pressure_window
        pressure_since = now - max(window, 1.0)
        return policy.Candidate(
            kernel_id=st.kernel_id,
            resident=st.held is None and st.op is None and st.resident in (ACTIVE, IDLE),
            busy=rec.busy,
            pinned=st.pinned,
            idle_seconds=rec.idle_seconds(now),
            max_utilization=rec.max_utilization_since(since),
            pressure_utilization=rec.max_utilization_since(pressure_since),
            gpu_bytes={g: b for g, b in rec.gpu_bytes.items() if g >= 0},
            idle_timeout=st.idle_timeout,
            releasable=self.choose_method(st.kernel_id) is not None and st.release_blocked is None,
        )

    def release_in(self, kernel_id: str, idle_seconds: float | None = None) -> float | None:
        """Seconds until the automatic release if nothing changes (None: never).

        ``idle_seconds``: count from that idle time instead of the kernel's own (0: from now,
        as for a cell that runs now: a cell is use, so the idle clock starts again at its end)."""
        st, rec = self.states.get(kernel_id), self.tracker.kernels.get(kernel_id)
        if st is None or rec is None:
            return None
        c = self.candidate(st, rec, clock.now())
        if idle_seconds is not None:
            c = replace(c, idle_seconds=idle_seconds, busy=False)
        return self.rules.seconds_until_release(c)

    def seen_free(self) -> dict[int, int]:
        """Free memory per GPU from the last sample, minus what restores reserved."""
        out = {}
        for g in self.total_bytes():
            rec = self.tracker.gpus.get(g)
            info = rec.info if rec is not None else None
            if info is None or info.memory_total is None or info.memory_used is None:
                continue
            out[g] = info.memory_total - info.memory_used - self.reservations.reserved(g)
        return out

    # -- the loop --------------------------------------------------------------------------
    async def tick(self) -> None:
        """After each tracker poll: sync states, drop the dead, apply the policy.

        One kernel's trouble is logged and the loop goes on with the others."""
        now = clock.now()
        for kid in set(self.states) - set(self.tracker.kernels):
            if kid not in self.tracker.km:
                self._forget(kid, "the kernel is gone")
        candidates = []
        for kid, rec in list(self.tracker.kernels.items()):
            try:
                st = self.get(kid)
                self._check_restart(st, rec)
                st.resident = self._resident_state(st, rec, now)
                self._note_background(st, rec, now)
                self._note_host_room(st, rec)
                candidates.append(self.candidate(st, rec, now))
                self._watchdog(st, rec, now)
            except Exception:
                log.exception("gpushare: kernel %s: could not apply the policy", kid)
        for decision in self.rules.decide(candidates, self.seen_free(), self.total_bytes()):
            st = self.states[decision.kernel_id]
            recently_failed = st.release_failed_at is not None and (
                now - st.release_failed_at < max(self.idle_timeout(st), RETRY_AFTER_FAILED_RELEASE))
            if recently_failed or st.op is not None or self.closing:
                continue
            try:
                self._start_release(st, decision.reason, automatic=True, by_kernel=False)
            except ControllerError as e:
                log.debug("gpushare: automatic release of %s skipped: %s", decision.kernel_id, e)
        self._signal_freed()  # waiting restores look again after every poll
        self._update_metrics()

    def _resident_state(self, st: KernelState, rec: KernelRecord, now: float) -> str:
        if not rec.gpu_memory_bytes:
            return UNTRACKED
        if rec.busy or rec.idle_seconds(now) < min(IDLE_AFTER, self.idle_timeout(st) or IDLE_AFTER):
            return ACTIVE
        return IDLE

    def _check_restart(self, st: KernelState, rec: KernelRecord) -> None:
        held = st.held
        if held is not None and held.kernel_pid is not None and rec.pids and rec.pids[0] != held.kernel_pid:
            self.drop_held(st.kernel_id, "the kernel restarted")

    def _note_background(self, st: KernelState, rec: KernelRecord, now: float) -> None:
        """GPU work while no cell runs means a thread of the kernel uses the GPU: a release
        would block that thread until a cell comes, so automatic releases stop. The agent's
        word (threads it saw use the GPU) holds until the user allows it; GPU work seen by
        utilization alone holds for one idle window after it was last seen."""
        threads = rec.background_threads
        if threads and not st.background:
            st.background = (f"background threads use the GPU ({', '.join(threads[:3])}): a "
                             "release would make them wait; release by hand or allow it with "
                             "%gpushare allow-background")
        if rec.gpu_work_while_idle:
            st.idle_gpu_work_at = now
        if st.idle_gpu_work_at is not None and now - st.idle_gpu_work_at > max(self.idle_timeout(st), 1.0):
            st.idle_gpu_work_at = None

    def _note_host_room(self, st: KernelState, rec: KernelRecord) -> None:
        st.host_refusal = None if st.held is not None else self._host_refusal(
            rec.host_room, rec.gpu_memory_bytes)

    def _host_refusal(self, room: HostRoom | None, need: int) -> str | None:
        """Why ``need`` bytes do not fit in host memory (None: they fit, or we cannot tell)."""
        if room is None or room.available is None or need <= 0:
            return None
        inflight = self.host_inflight.get(room.scope, 0) + (
            self.host_inflight.get("machine", 0) if room.scope != "machine" else 0)
        fits = room.available - inflight - self.host_memory_reserve
        if need <= fits:
            return None
        extra = f", {format_bytes(inflight)} of other releases in flight" if inflight else ""
        return (f"its GPU state ({format_bytes(need)}) would not fit in host memory: "
                f"{room.detail}{extra}, host_memory_reserve {format_bytes(self.host_memory_reserve)}")

    def _watchdog(self, st: KernelState, rec: KernelRecord, now: float) -> None:
        """Lazy mode: a released kernel busy for longer than restore_grace gets restored."""
        if st.state != RELEASED or not rec.busy or st.op is not None:
            self._busy_since.pop(st.kernel_id, None)
            return
        since = self._busy_since.setdefault(st.kernel_id, now)
        if now - since >= self.restore_grace:
            self._busy_since.pop(st.kernel_id, None)
            self._spawn(self._quietly(self.ensure_resident(st.kernel_id, trigger="watchdog")))

    async def _quietly(self, aw: Awaitable[Any]) -> None:
        try:
            await aw
        except ControllerError as e:
            log.info("gpushare: %s", e.message)
        except Exception:
            log.exception("gpushare: background restore failed")

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _signal_freed(self) -> None:
        """Wake every restore waiting for memory (each waits on the event of its time)."""
        self._freed.set()
        self._freed = asyncio.Event()

    # -- operations: start, wait ------------------------------------------------------------
    def _start(self, st: KernelState, op: Operation, body: Awaitable[Outcome]) -> Operation:
        op.body = asyncio.ensure_future(body)
        op.task = asyncio.ensure_future(self._run(st, op))
        st.op = op
        return op

    async def _run(self, st: KernelState, op: Operation) -> Outcome:
        """Every operation ends here: whatever happened, ``op`` is cleared and waiters wake."""
        try:
            return await op.body
        except asyncio.CancelledError:  # only a waiting phase can be stopped
            return Outcome(False, op.stop_reason or "stopped while waiting for GPU memory")
        except Exception as e:  # a bug: never leave the state or the waiters stuck on it
            log.exception("gpushare: %s of kernel %s failed unexpectedly", op.kind, st.kernel_id)
            if st.held is not None:
                st.failed, st.error = True, f"{op.kind} failed: {type(e).__name__}: {e}"
            return Outcome(False, f"{op.kind} failed: {type(e).__name__}: {e}")
        finally:
            if op.on_end is not None:
                op.on_end()
            if st.op is op:
                st.op = None
            st.waiting = st.waiting_note = None
            if st.drop_after_op:
                why, st.drop_after_op = st.drop_after_op, None
                self.drop_held(st.kernel_id, why)
            self._signal_freed()
            self._update_metrics()

    @staticmethod
    async def _to_the_end(aw: Awaitable[Any]) -> Any:
        """Await ``aw`` to its end even if our task is cancelled meanwhile: bytes in flight
        finish, so the state that follows is true."""
        inner = asyncio.ensure_future(aw)
        while True:
            try:
                return await asyncio.shield(inner)
            except asyncio.CancelledError:
                if inner.done():
                    return inner.result()
                log.warning("gpushare: an operation that moves bytes was asked to stop; it finishes first")

    async def _wait(self, op: Operation) -> Outcome:
        """Wait for an operation without being able to stop it (our cancellation stays ours)."""
        return await asyncio.shield(op.task)

    async def settle(self, kernel_id: str) -> None:
        """Wait until no operation is in flight on the kernel (lazy mode's gate)."""
        st = self.states.get(kernel_id)
        while st is not None and st.op is not None:
            await self._wait(st.op)

    def stop_waiting(self, kernel_id: str, why: str) -> bool:
        """Stop a restore that waits for memory (an interrupt). Never stops bytes in flight."""
        st = self.states.get(kernel_id)
        op = st.op if st is not None else None
        if op is None or op.kind != "restore" or op.phase != "waiting":
            return False
        op.stop(why)
        return True

    # -- release -----------------------------------------------------------------------------
    async def release(
        self, kernel_id: str, reason: str = "requested", automatic: bool = False,
        by_kernel: bool = False,
    ) -> KernelState:
        st = self.get(kernel_id)
        op = self._start_release(st, reason, automatic=automatic, by_kernel=by_kernel)
        outcome = await self._wait(op)
        if not outcome.ok:
            raise ControllerError(409, outcome.message, outcome.retryable)
        return st

    async def release_if_idle(self, kernel_id: str, idle_for: float, reason: str) -> KernelState:
        """Release as an automatic release would, for someone outside this server (the
        node-wide service): only a kernel the policy may take, idle for at least ``idle_for``
        seconds (409 says why not). Nobody working is released this way."""
        st = self.get(kernel_id)
        rec = self.tracker.kernels.get(kernel_id)
        if rec is None or not rec.gpu_memory_bytes or st.held is not None or st.op is not None:
            raise ControllerError(409, f"kernel is {st.state}: nothing to release")
        # quiet on the GPU over the caller's window, not this server's pressure window: the
        # service's rule (its pressure_idle_timeout) is the one that holds across users
        c = self.candidate(st, rec, clock.now(), pressure_window=idle_for)
        busy_now = c.busy or self.live_state(kernel_id) == "busy"
        if busy_now or c.pinned:
            why = "busy running a cell" if busy_now else "pinned"
        elif c.idle_seconds < idle_for:  # GPU work counts as use; "used N s ago" says when
            raise ControllerError(409, f"kernel was used {c.idle_seconds:.0f} s ago (less than "
                                       f"{idle_for:g} s): not released for another user")
        elif policy.eligible(c, self.config):
            return await self.release(kernel_id, reason=reason, automatic=True)
        elif (c.pressure_utilization or 0.0) > self.config.idle_utilization:  # over S seconds
            why = "using the GPU"
        else:
            why = st.release_blocked or (
                "not released automatically (idle timeout 0, too small, or no method)")
        raise ControllerError(409, f"kernel is {why}: not released for another user")

    def restore_need(self, kernel_id: str) -> dict[int, int]:
        """Bytes per GPU a waiting restore needs free (empty when no restore waits)."""
        st = self.states.get(kernel_id)
        if st is None or st.held is None or not (st.waiting or "").startswith(MEMORY_WAIT):
            return {}  # not waiting, or waiting for a restore turn, not for memory
        return self._need(st.held)

    def _start_release(self, st: KernelState, reason: str, automatic: bool, by_kernel: bool) -> Operation:
        """Check what can be checked at once, then start the release (409s say why not)."""
        if self.closing:
            raise ControllerError(409, "the server is shutting down")
        if st.op is not None:
            raise ControllerError(409, f"kernel is {st.state}: another operation is running")
        if st.held is not None:
            raise ControllerError(409, f"kernel is already {st.state}")
        rec = self.tracker.kernels.get(st.kernel_id)
        if rec is None or not rec.gpu_memory_bytes:
            raise ControllerError(409, "kernel holds no GPU memory")
        if st.pinned and automatic:
            raise ControllerError(409, "kernel is pinned")
        method_name = self.choose_method(st.kernel_id)
        if method_name is None:
            raise ControllerError(409, "no release method is available for this kernel")
        op = Operation("release", reason)
        return self._start(st, op, self._release_op(st, op, rec, method_name, reason, automatic, by_kernel))

    def _release_target(self, kid: str, rec: KernelRecord) -> KernelTarget:
        gpu_bytes = dict(rec.gpu_bytes)
        pid_bytes = rec.pid_gpu_bytes
        # only pids with GPU memory (or, unmeasured, a GPU device open) have a context to move
        pids = [p for p in rec.pids if p in pid_bytes] or list(rec.gpu_pids) or rec.pids[:1]
        return KernelTarget(kernel_id=kid, pids=pids, gpu_bytes=gpu_bytes, agent=self.agent(kid),
                            extra={"pid_gpu_bytes": {p: dict(b) for p, b in pid_bytes.items()}})

    async def _refuse(self, st: KernelState, op: Operation, message: str) -> Outcome:
        """Nothing moved and nothing changed: say why, keep the kernel as it is."""
        log.info("gpushare: release of kernel %s refused: %s", st.kernel_id, message)
        return Outcome(False, message)

    async def _release_op(
        self, st: KernelState, op: Operation, rec: KernelRecord, method_name: str, reason: str,
        automatic: bool, by_kernel: bool,
    ) -> Outcome:
        kid = st.kernel_id
        method = self.methods[method_name]
        target = self._release_target(kid, rec)
        need = rec.gpu_memory_bytes
        # the held state is built from this moment's record, as the target is: a poll while we
        # wait below may already show a restarted kernel's new process in ``rec``
        kernel_pid, gpus, attributed = (rec.pids[0] if rec.pids else None), self._gpus_of(rec), rec.attributed
        room = await self.host_room(kernel_pid) if self.host_room else None
        why = self._host_refusal(room, need)
        if why:
            st.host_refusal = why
            return await self._refuse(st, op, f"not released: {why}")
        scope = room.scope if room is not None else "machine"
        # claimed at the check, before the agent is asked (that yields): releases checked
        # meanwhile must count these bytes, or two that fit alone both move and OOM the host.
        # Given back when the method returns (the host's own numbers count the bytes then),
        # or when the operation ends without moving (refused, stopped)
        give_back = op.on_end = self._host_claim(scope, need)
        agent = self.agent(kid)
        if agent is not None:  # the agent knows whether a cell runs now: it decides
            try:
                await agent.request("begin_release", timeout=self.agent_timeout,
                                    by_kernel=by_kernel, automatic=automatic,
                                    background_ok=st.allow_background)
            except (ConnectionError, TimeoutError) as e:
                return await self._refuse(st, op, f"the kernel's agent did not answer ({e or 'timeout'})")
            except Exception as e:
                if getattr(e, "kind", "") == "BackgroundGPUWork":
                    st.background = str(e)  # sticky: shown until the user allows it
                return await self._refuse(st, op, str(e) or type(e).__name__)
        elif self.live_state(kid) == "busy" and not by_kernel:
            return await self._refuse(st, op, "kernel is busy running a cell; release it when idle")

        op.phase = "moving"
        held = Held(method=method_name, bytes=need, gpus=gpus, pids=list(target.pids),
                    pid_bytes=target.extra["pid_gpu_bytes"], kernel_pid=kernel_pid,
                    attributed=attributed, since=clock.now())
        st.held, st.method, st.failed, st.error = held, method_name, False, None
        self._notify_agent(kid, RELEASING)
        started = time.monotonic()
        try:
            result = await self._to_the_end(method.release(target, self._progress_log(kid)))
        except ReclaimError as e:
            return await self._release_failed(st, held, method_name, str(e), e.resident,
                                              e.retryable, started)
        except Exception as e:  # a timeout, a lost channel, a bug: the undo is not confirmed
            return await self._release_failed(st, held, method_name, str(e) or type(e).__name__,
                                              False, True, started)
        finally:
            give_back()
        seconds = time.monotonic() - started
        if st.held is not held:  # dropped meanwhile (a restart): nothing left to show
            return Outcome(False, st.error or "the held state was dropped", dropped=True)
        held.complete = True
        held.bytes = result.bytes or need
        st.release_failed_at = None
        st.releases += 1
        st.last_release_seconds = seconds
        self._notify_agent(kid, RELEASED)
        metrics.RELEASES.labels(method_name, "ok").inc()
        metrics.RELEASE_SECONDS.observe(seconds)
        self._emit(st, "released", bytes=held.bytes, seconds=seconds, reason=reason)
        log.info("gpushare: released %s of kernel %s in %.2f s (%s)",
                 format_bytes(held.bytes), kid, seconds, reason)
        await self._refresh()
        return Outcome(True)

    async def _release_failed(
        self, st: KernelState, held: Held, method_name: str, why: str, resident: bool,
        retryable: bool, started: float,
    ) -> Outcome:
        kid = st.kernel_id
        st.release_failed_at = clock.now()
        if resident and st.held is held:
            st.held = None
            st.error = f"release failed: {why}"
        elif st.held is held:
            st.failed, st.retryable = True, retryable
            st.error = f"release failed and the kernel could not be confirmed running: {why}"
        metrics.RELEASES.labels(method_name, "failed").inc()
        self._notify_agent(kid, st.state)
        self._emit(st, "release_failed", reason=why, seconds=time.monotonic() - started)
        log.warning("gpushare: release of kernel %s failed: %s", kid, st.error)
        await self._refresh()
        return Outcome(False, st.error or why, retryable)

    def _host_claim(self, scope: str, n: int) -> Callable[[], None]:
        """Count ``n`` bytes as on their way into host memory; returns the (idempotent) undo."""
        self.host_inflight[scope] = self.host_inflight.get(scope, 0) + n
        claimed = [n]

        def give_back() -> None:
            if claimed:
                claimed.clear()
                self.host_inflight[scope] -= n
                if not self.host_inflight[scope]:
                    del self.host_inflight[scope]

        return give_back

    def _gpus_of(self, rec: KernelRecord) -> dict[int, int]:
        return {g: b for g, b in rec.gpu_bytes.items() if b}

    # -- restore ---------------------------------------------------------------------------
    async def restore(self, kernel_id: str, trigger: str = "rest", parent: dict | None = None) -> KernelState:
        """Restore a held kernel; 409 when it is not held."""
        st = self.get(kernel_id)
        if not st.is_held:
            raise ControllerError(409, f"kernel is {st.state}, not released")
        return await self.ensure_resident(kernel_id, trigger=trigger, parent=parent)

    def start_restore(self, kernel_id: str, trigger: str = "rest", parent: dict | None = None) -> Operation:
        """Start (or join) the restore of a held kernel and return it without waiting."""
        st = self.get(kernel_id)
        if st.op is not None:
            return st.op
        if st.held is None:
            raise ControllerError(409, f"kernel is {st.state}, not released")
        if self.closing:
            raise ControllerError(409, "the server is shutting down")
        op = Operation("restore", trigger)
        return self._start(st, op, self._restore_op(st, op, st.held, parent, wait=True))

    async def ensure_resident(
        self, kernel_id: str, trigger: str = "gate", parent: dict | None = None
    ) -> KernelState:
        """Return once the kernel's GPU state is on the GPU (waits for a release in flight).

        Raises ControllerError when the restore fails, is stopped, or the held state is
        dropped (a restart) while waiting: the cell that waited must not run in its place."""
        st = self.get(kernel_id)
        drops = st.drops
        while True:
            if st.drops != drops:
                raise ControllerError(409, f"{st.error or 'the kernel restarted'}; this cell did not run",
                                      retryable=False)
            op = st.op
            if op is not None:
                if ahead.superseded(self, st, op, trigger):  # the cell's own restore takes over
                    op.stop("a cell's restore took over")
                outcome = await self._wait(op)
                if op.trigger == ahead.AHEAD and trigger != ahead.AHEAD:
                    continue  # an ahead restore that did not bring it back: the cell's does
                if op.kind == "restore" and not outcome.ok and st.drops == drops:
                    raise ControllerError(409, outcome.message, outcome.retryable and not outcome.dropped)
                continue
            if st.held is None:
                return st
            self.start_restore(kernel_id, trigger, parent)

    def _need(self, held: Held) -> dict[int, int]:
        """Bytes to reserve per GPU: what the kernel held, on every GPU when we could not tell
        which, plus a CUDA context where the bytes were the kernel's own count."""
        known = {g: b for g, b in held.gpus.items() if g >= 0}
        unknown = held.gpus.get(-1, 0)
        margin = 0 if held.attributed else self.context_bytes
        if unknown or (not known and held.bytes):
            every = list(self.total_bytes()) or [0]
            return {g: known.get(g, 0) + (unknown or held.bytes) + margin for g in every}
        return {g: b + margin for g, b in known.items()}

    async def _restore_op(
        self, st: KernelState, op: Operation, held: Held, parent: dict | None, wait: bool
    ) -> Outcome:
        need = self._need(held)
        shown = _Shower(self.agent(st.kernel_id), parent,
                        clear_when_done=self.clear_progress and op.trigger in CLEARED_TRIGGERS)
        grant = await self._wait_for_room(st, op, held, need, shown, wait)
        if isinstance(grant, Outcome):
            return grant
        try:
            op.phase = "moving"
            return await self._to_the_end(self._move_back(st, op, held, shown, grant))
        finally:
            grant.release()

    async def _move_back(
        self, st: KernelState, op: Operation, held: Held, shown: _Shower, grant: Grant
    ) -> Outcome:
        kid = st.kernel_id
        method = self.methods[held.method]
        st.error = None
        expected = st.last_restore_seconds
        gpus = ", ".join(str(g) for g in sorted(held.gpus) if g >= 0) or "-"
        await shown(f"gpushare: restoring {format_bytes(held.bytes)} to GPU {gpus}"
                    + (f" (last time {expected:.2f} s)" if expected else "") + " ...")
        rec = self.tracker.kernels.get(kid)
        target = KernelTarget(kernel_id=kid, pids=list(held.pids), gpu_bytes=dict(held.gpus),
                              agent=self.agent(kid), extra={"pid_gpu_bytes": held.pid_bytes})
        if rec is not None and not target.pids:
            target.pids = rec.pids[:1]
        started = time.monotonic()

        async def progress(text: str) -> None:
            await shown(f"gpushare: {text}")

        try:
            result = await method.restore(target, progress)
        except Exception as e:
            grant.release()  # nothing landed: the room is free again
            retryable = e.retryable if isinstance(e, ReclaimError) else True
            why = str(e) or type(e).__name__
            ended = self._process_ended(kid, held)
            if ended:  # the process that held the state is gone: nothing to retry
                st.drop_after_op = ended  # dropped as the operation ends, before waiters wake
                metrics.RESTORES.labels(method.name, "failed").inc()
                self._emit(st, "restore_failed", reason=f"{ended} ({why})",
                           seconds=time.monotonic() - started)
                gone = f"{ended}: its released GPU state is gone"
                await shown(f"gpushare: restore failed: {gone}")
                log.warning("gpushare: restore of kernel %s failed: %s (%s)", kid, gone, why)
                return Outcome(False, gone, False, dropped=True)
            # a restore ahead of a cell that fails leaves the kernel released, the reason shown
            st.failed, st.retryable = st.failed or op.trigger != ahead.AHEAD, retryable
            st.error = ahead.failed_restore_error(op.trigger, why)
            metrics.RESTORES.labels(method.name, "failed").inc()
            self._notify_agent(kid, FAILED if st.failed else RELEASED)
            self._emit(st, "restore_failed", reason=why, seconds=time.monotonic() - started,
                       trigger=op.trigger)
            await shown(f"gpushare: restore failed, your state is still held: {why}")
            log.warning("gpushare: restore of kernel %s failed: %s", kid, why)
            await self._refresh()
            return Outcome(False, st.error, retryable)
        grant.release()  # landed bytes count as used from here: not twice, as reserved too
        seconds = time.monotonic() - started
        moved = result.bytes or held.bytes
        if st.held is held:
            st.held = None
        st.failed, st.error, st.retryable = False, None, True
        st.restores += 1
        st.last_restore_seconds = seconds
        self.tracker.touch(kid)
        self._notify_agent(kid, ACTIVE)
        metrics.RESTORES.labels(method.name, "ok").inc()
        metrics.RESTORE_SECONDS.observe(seconds)
        self._emit(st, "restored", bytes=moved, seconds=seconds, reason=op.trigger)
        await shown(f"gpushare: restored {format_bytes(moved)} in {seconds:.2f} s")
        await shown.done()  # before the cell's code runs (saved notebooks carry no timings)
        log.info("gpushare: restored %s of kernel %s in %.2f s (%s)",
                 format_bytes(moved), kid, seconds, op.trigger)
        await self._refresh()
        return Outcome(True)

    def _process_ended(self, kernel_id: str, held: Held) -> str | None:
        """Why the process that holds the state is gone (restarted, died), else None."""
        ended = getattr(self.tracker, "process_ended", None)  # a tracker that cannot tell: None
        if held.kernel_pid is None or ended is None:
            return None
        why: str | None = ended(kernel_id, held.kernel_pid)
        return why

    async def _wait_for_room(
        self, st: KernelState, op: Operation, held: Held, need: dict[int, int], shown: _Shower,
        wait: bool,
    ) -> Grant | Outcome:
        """Never restore without room: take the GPUs, check, reserve; else make room per
        policy, or wait and say why. An Outcome when it ends without room."""
        announced = False
        delay = WAIT_BACKOFF[0]
        while True:
            # Python 3.11's wait_for can swallow a cancel that lands as what it waits for
            # completes (a release ending as the server shuts down): look at the flag too
            if op.stopped:
                raise asyncio.CancelledError
            if st.held is not held:
                return Outcome(False, f"{st.error or 'the held state was dropped'}", False, dropped=True)
            if ahead.yields(self, st, op, need):  # a cell's restore waits for these GPUs: it goes first
                try:
                    await asyncio.wait_for(self._freed.wait(), WAIT_BACKOFF[1])
                except asyncio.TimeoutError:
                    pass
                continue
            # a turn behind another restore of this server on the same GPU is not `waiting`
            # (the other one moves its bytes and gives the GPU back); a turn another server
            # holds is (it may keep it): the cell and status say so
            grant = await self._take_turn(st, need, shown)
            want = need
            strict = set(grant.unguarded) & set(need)  # no turn across servers on these GPUs
            try:
                want = await self._still_to_land(st, held, need)
                free = await self.read_free(list(need))
                room = {g: None if f is None else f - self._releases_may_take_back(g)
                        for g, f in free.items()}
                short = self._short(want, room, strict)
                if not short and strict:  # and the room must still be there a moment later
                    await asyncio.sleep(STRICT_SETTLE)
                    again = await self.read_free(sorted(strict))
                    room.update({g: None if f is None else f - self._releases_may_take_back(g)
                                 for g, f in again.items()})
                    short = self._short(want, room, strict)
            except asyncio.CancelledError:  # stopped while reading: leave no GPU locked
                grant.release()
                raise
            except Exception as e:
                log.warning("gpushare: cannot read free GPU memory: %s", e)
                free = {g: None for g in need}
                room = {g: None for g in need}
                short = dict(want)
            if op.stopped:
                grant.release()
                raise asyncio.CancelledError
            if not short and st.held is held:
                grant.reserve(want)
                st.waiting = None
                return grant
            grant.release()
            if not short:
                continue  # dropped meanwhile: the check at the top says so
            shortfall = [(f"{format_bytes(n)} on GPU {g}",
                          (f"{format_bytes(max(room[g] or 0, 0))} free" if room.get(g) is not None
                           else "free memory unknown")
                          + ("; twice that without a restore turn" if g in strict else ""))
                         for g, n in short.items()]
            st.waiting = f"{MEMORY_WAIT}: needs " + ", ".join(
                f"{needs} ({free})" for needs, free in shortfall)
            if not wait:
                return Outcome(False, st.waiting)
            if not announced:
                announced = True
                # the event's reason has no parentheses (the lab's toast adds its own) and
                # does not repeat "waiting for memory" (the toast says it waits)
                why = "needs " + "; ".join(f"{needs}, {free}" for needs, free in shortfall)
                self._emit(st, "restore_waiting", bytes=sum(want.values()), reason=why,
                           trigger=op.trigger)
                await shown(f"gpushare: {st.waiting}; the cell runs once memory frees "
                            "(interrupt to stop waiting)")
            if await self._make_room(st, want, free):
                delay = WAIT_BACKOFF[0]
                continue  # room was made: look at once (its end's wake-up came while we waited on it)
            freed = self._freed
            try:
                await asyncio.wait_for(freed.wait(), delay)
                delay = WAIT_BACKOFF[0]
            except asyncio.TimeoutError:
                delay = min(delay * 2, WAIT_BACKOFF[1])

    @staticmethod
    def _short(want: dict[int, int], room: dict[int, int | None], strict: set[int]) -> dict[int, int]:
        """GPUs without room for ``want``: on a GPU without a restore turn across servers
        (``strict``), room for twice the state, so that two such restores started at the same
        moment both fit."""
        return {g: n for g, n in want.items()
                if room.get(g) is None or (room[g] or 0) < n * (2 if g in strict else 1)}

    async def _take_turn(self, st: KernelState, need: dict[int, int], shown: _Shower) -> Grant:
        """The restore turn of every GPU in ``need``. While another server holds one, the
        cell's progress line and ``status`` say so (``waiting``)."""
        said = asyncio.Event()

        def on_turn_wait(gpu: int, holder: int | None, left: float) -> None:
            by = f" (process {holder})" if holder else ""
            st.waiting = (f"waiting for another server's restore turn on GPU {gpu}{by}, "
                          f"at most {left:.0f} s more")
            said.set()

        task = asyncio.ensure_future(self.reservations.acquire(list(need), on_turn_wait))
        heard = asyncio.ensure_future(said.wait())
        try:
            while not task.done():
                await asyncio.wait({task, heard}, return_when=asyncio.FIRST_COMPLETED)
                if heard.done() and not task.done():
                    said.clear()
                    heard = asyncio.ensure_future(said.wait())
                    await shown(f"gpushare: {st.waiting} (interrupt to stop waiting)")
        except asyncio.CancelledError:
            task.cancel()
            try:
                (await task).release()  # it had finished: give its locks back
            except BaseException:
                pass
            raise
        finally:
            heard.cancel()
        return task.result()

    def _releases_may_take_back(self, gpu: int) -> int:
        """Bytes that releases in flight may put back on ``gpu``: an undo re-allocates what the
        release freed, so those bytes are not free for a restore until the release has ended
        (a restore promised them would run out of memory mid-way: wedged)."""
        total = 0
        for other in self.states.values():
            if other.op is not None and other.op.kind == "release" and other.held is not None:
                total += other.held.gpus.get(gpu, 0) + other.held.gpus.get(-1, 0)
        return total

    async def _still_to_land(self, st: KernelState, held: Held, need: dict[int, int]) -> dict[int, int]:
        """``need`` less what the kernel's process still holds on each GPU. A release that
        failed part-way (or before moving anything) left those bytes in place, and they count
        as used already: charging them again left such a kernel waiting for memory it does not
        need, for good on a busy GPU. Measured now, per process, never from an older poll: a
        count that lags behind bytes that did leave would make room that is not there."""
        if held.complete or not held.attributed:
            return need  # every byte left (the method said so), or not measured per process
        await self._refresh()
        rec = self.tracker.kernels.get(st.kernel_id)
        if rec is None or not rec.attributed or not rec.pids or rec.pids[0] != held.kernel_pid:
            return need  # not measured per process, or another process now: charge it all
        return {g: max(0, n - rec.gpu_bytes.get(g, 0)) for g, n in need.items()}

    async def _make_room(self, st: KernelState, need: dict[int, int], free: dict[int, int | None]) -> bool:
        """Release idle kernels per policy; a victim whose release failed recently is skipped.
        True when some victim was released (a refused or failed one frees nothing: the caller
        backs off, or a victim refused again and again would be asked in a tight loop)."""
        made = False
        now = clock.now()
        known_free = {g: self.reservations.seen_free(g, f) for g, f in free.items() if f is not None}
        cands = []
        for k, rec in self.tracker.kernels.items():
            other = self.states.get(k)
            if other is None or other.op is not None or k == st.kernel_id:
                continue
            if other.release_failed_at is not None and now - other.release_failed_at < RETRY_AFTER_FAILED_RELEASE:
                continue
            cands.append(self.candidate(other, rec, now))
        plan = self.rules.make_room(need, {g: f for g, f in known_free.items() if f is not None},
                                    cands, exclude=st.kernel_id)
        for d in plan or []:
            victim = self.states[d.kernel_id]
            try:
                victim_op = self._start_release(victim, d.reason, automatic=True, by_kernel=False)
            except ControllerError as e:
                log.info("gpushare: could not make room with %s: %s", d.kernel_id, e.message)
                continue
            outcome = await self._wait(victim_op)
            if not outcome.ok:
                log.info("gpushare: could not make room with %s: %s", d.kernel_id, outcome.message)
            made = made or outcome.ok
        return made

    # -- pin, drop, shutdown ------------------------------------------------------------------
    def set_pinned(self, kernel_id: str, pinned: bool) -> KernelState:
        st = self.get(kernel_id)
        if st.pinned != pinned:
            st.pinned = pinned
            self._emit(st, "pinned" if pinned else "unpinned")
        return st

    def set_idle_timeout(self, kernel_id: str, seconds: float | None) -> KernelState:
        st = self.get(kernel_id)
        st.idle_timeout = seconds
        return st

    def set_allow_background(self, kernel_id: str, allow: bool) -> KernelState:
        st = self.get(kernel_id)
        st.allow_background = allow
        return st

    def drop_held(self, kernel_id: str, why: str) -> None:
        """The process that held the state is gone (restart, death): nothing left to restore."""
        st = self.states.get(kernel_id)
        if st is None or st.held is None:
            return
        op = st.op
        if op is not None and op.phase == "moving":
            st.drop_after_op = why  # the method fails on its own; drop once it has
            return
        log.warning("gpushare: kernel %s: %s; its released GPU state is gone with the old process",
                    kernel_id, why)
        st.held, st.failed, st.waiting = None, False, None
        st.error, st.retryable = f"{why}: its released GPU state is gone", False
        st.drops += 1
        if op is not None:
            op.stop(st.error)
        metrics.forget_kernel(kernel_id)
        self._signal_freed()

    def _forget(self, kernel_id: str, why: str) -> None:
        self.drop_held(kernel_id, why)
        st = self.states.get(kernel_id)
        if st is not None and st.op is not None and st.op.phase == "waiting":
            st.op.stop(why)
        self.states.pop(kernel_id, None)
        self._busy_since.pop(kernel_id, None)
        metrics.forget_kernel(kernel_id)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Leave no kernel wedged: stop waiting restores, let bytes in flight land, then
        restore every held kernel that has room and say which stay held."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        ops = []
        for st in self.states.values():
            if st.op is not None:
                self.stop_waiting(st.kernel_id, "the server is shutting down")
                ops.append(st.op.task)
        if ops:
            _, pending = await asyncio.wait(ops, timeout=timeout)
            if pending:
                log.error("gpushare: at shutdown %d operation(s) still move bytes after %.0f s",
                          len(pending), timeout)
        for kid, st in list(self.states.items()):
            if st.held is None or st.op is not None:
                continue
            op = Operation("restore", "shutdown")
            self._start(st, op, self._restore_op(st, op, st.held, None, wait=False))
            try:
                outcome = await asyncio.wait_for(self._wait(op), timeout)
            except asyncio.TimeoutError:
                log.error("gpushare: at shutdown the restore of kernel %s did not finish in %.0f s",
                          kid, timeout)
                continue
            if not outcome.ok:
                log.error("gpushare: at shutdown kernel %s stays released (%s); its state is held "
                          "in host memory until the kernel exits", kid, outcome.message)

    # -- plumbing -------------------------------------------------------------------------------
    def _gpu_uuid(self, gpu: int) -> str | None:
        rec = self.tracker.gpus.get(gpu)
        return rec.info.uuid if rec is not None and rec.info.uuid else None

    async def _refresh(self) -> None:
        if self.refresh is not None:
            try:
                await self.refresh()
            except Exception:
                log.exception("gpushare: refresh after an operation failed")

    def _progress_log(self, kernel_id: str) -> Callable[[str], None]:
        return lambda text: log.debug("gpushare: kernel %s: %s", kernel_id, text)

    def _notify_agent(self, kernel_id: str, state: str) -> None:
        agent = self.agent(kernel_id)
        if agent is not None:
            try:
                agent.notify("state", state=state, restore_mode=self.restore_mode)
            except Exception as e:  # the agent learns its state again when it reconnects
                log.debug("gpushare: could not tell kernel %s its state: %s", kernel_id, e)

    def _emit(self, st: KernelState, action: str, **data: Any) -> None:
        rec = self.tracker.kernels.get(st.kernel_id)
        payload: dict[str, Any] = {"kernel_id": st.kernel_id, "action": action}
        if st.method:
            payload["method"] = st.method
        if rec is not None and rec.path:
            payload["path"] = rec.path
        for k, v in data.items():
            if v is not None:
                payload[k] = int(v) if k == "bytes" else v
        try:
            self.emit(payload)
        except Exception:
            log.exception("gpushare: could not emit event %s", action)

    def _update_metrics(self) -> None:
        counts: dict[str, int] = {}
        host = 0
        for st in self.states.values():
            counts[st.state] = counts.get(st.state, 0) + 1
            if st.held is not None:
                host += st.held.bytes
                metrics.KERNEL_HOST_BYTES.labels(st.kernel_id).set(st.held.bytes)
            else:
                metrics.forget_kernel(st.kernel_id)
        for state in ALL:
            metrics.KERNELS.labels(state).set(counts.get(state, 0))
        metrics.HOST_BYTES.set(host)


class _Shower:
    """Shows one transient progress line in the output of the cell that triggered a restore
    (through the kernel's agent, so it arrives in order with the cell's own messages).

    ``clear_when_done``: :meth:`done` takes the line out of the cell again; only for cells
    whose code has not run yet (the line is then all they hold), never for a magic's cell."""

    def __init__(self, agent: Any, parent: dict | None, clear_when_done: bool = False):
        self.agent = agent
        self.parent = parent
        self.clear_when_done = clear_when_done
        self.display_id = f"gpushare-{time.monotonic_ns()}"
        self.shown = False

    async def __call__(self, text: str) -> None:
        if await self._ask("show", text=text):
            self.shown = True

    async def done(self) -> None:
        """The restore succeeded: the cell keeps no gpushare output (unless configured to)."""
        if self.shown and self.clear_when_done:
            await self._ask("clear")

    async def _ask(self, op: str, **args: Any) -> bool:
        if self.agent is None or not self.parent:
            return False
        try:
            await self.agent.request(op, timeout=5, parent=self.parent,
                                     display_id=self.display_id, **args)
        except Exception as e:  # progress is a courtesy; never fail a restore over it
            log.warning("gpushare: could not %s progress: %s", op, e)
            return False
        return True


__all__ = ["ACTIVE", "FAILED", "IDLE", "RELEASED", "RELEASING", "RESTORING", "UNTRACKED",
           "Controller", "ControllerError", "Held", "KernelState", "Operation", "Outcome"]
