"""The orchestration of kernels' releases and restores: the only caller of their steps.

The promise it keeps: a released kernel comes back exactly as it was, or says why not and
keeps its state; no kernel is left wedged; the state shown is true. How:

- **The states and their steps** are :mod:`.lifecycle`'s (one table); this module decides
  when each step happens.
- **Operations are owned here** (:mod:`.operations`). A release or a restore runs in a task
  the controller owns; callers (the gate, REST, the agent, make-room) only *wait* for it,
  shielded. Every exit of an operation, cancellation included, ends in a true state. One
  operation per kernel.
- **What is said about an action is said once** (:mod:`.announce`): event, metrics, agent.
- **The held state is one value** (:class:`.lifecycle.Held`): set the moment bytes may start to leave
  the GPU, cleared only when a method confirms the kernel runs with all of it on the GPU.
  Undo is reported by the method, never assumed: an unconfirmed one is ``failed`` (held,
  restorable, reason shown), never ``active``.
- **Restores reserve room first** (:mod:`.reservations`, the need from
  :mod:`..policy.room`): one restore at a time per GPU, its bytes reserved before it moves
  them, so no restore runs without room (a restore without room wedges a real process for
  good).
- **Only a restore's waiting can be cancelled** (an interrupt, server shutdown); once bytes
  move, the operation runs to its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from .. import clock, policy
from ..node.node_locks import NodeLocks
from ..policy import caps
from ..policy.room import to_reserve
from ..reclaim import KernelTarget, ReclaimError, ReclaimMethod
from ..states import (
    ACTIVE,
    ALL,
    FAILED,
    IDLE,
    RELEASED,
    RELEASING,
    UNTRACKED,
)
from ..units import format_bytes
from . import ahead, metrics
from .announce import Announcer
from .errors import ControllerError
from .hostmem import HostRoom
from .lifecycle import Held, Lifecycle
from .operations import Operation, Outcome, to_the_end, wait_for
from .ports import KernelFacts, NodeRoom
from .progress import CellProgress
from .rebalance import Rebalancer
from .reservations import Grant, Reservations
from .restore_room import MEMORY_WAIT, RestoreRoom
from .tracker import KernelRecord, Tracker

log = logging.getLogger(__name__)


def onto(mapping: dict[int, int], why: str | None = None) -> str | None:
    """Where a restore that moves puts the state, for a person (None: it stays). ``why``:
    the reason it moved (default: its GPUs had no room); for one that stays, why it stays
    on a busy GPU ("" or None: nothing to say)."""
    if not mapping:
        return why or None
    to = ", ".join(str(mapping[g]) for g in sorted(mapping))
    came = ", ".join(str(g) for g in sorted(mapping))
    return f"onto GPU {to}: {why or f'GPU {came} had no room'}"

IDLE_AFTER = 60.0  # s without activity before a resident kernel shows as "idle"
#: restores that precede the code of the cell they show progress in (its only output so far)
CLEARED_TRIGGERS = ("gate", "agent")
RETRY_AFTER_FAILED_RELEASE = 60.0  # s before a kernel whose release failed is tried again
#: times one restore goes back to waiting when its method finds the room taken right before
#: its call (another process allocated since the grant); the next such refusal fails it, so
#: a process that keeps taking the room cannot keep the restore going round for ever
ROOM_TAKEN_WAITS = 3


class RoomTaken(Exception):
    """A restore's method refused for room alone, nothing moved: it waits for room again."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


Emit = Callable[[dict[str, Any]], None]


class Controller:
    def __init__(
        self,
        tracker: Tracker,
        methods: dict[str, ReclaimMethod],
        config: policy.ReleaseSettings,
        node_room: NodeRoom,
        kernels: KernelFacts,
        emit: Emit,
        *,
        rules: policy.Policy | None = None,
        restore_mode: str = "eager",
        restore_grace: float = 30.0,
        move_after: float = 0.0,
        host_memory_reserve: int = 0,
        context_bytes: int = 0,
        clear_progress: bool = True,
        node_locks: NodeLocks | None = None,
    ):
        """
        config: the release settings (idle timeout, pressure, ...) the rules read.
        node_room, kernels: the ports through which the node and the kernels are read
            (:mod:`.ports`).
        emit: sends one kernel event (schema ``events/kernel-v1.yaml``).
        rules: the release rules (``c.GPUShareApp.policy_class``); default: ``policy.Policy``.
        move_after: seconds a restore waits for room on its kernel's own GPUs before it goes
            onto others that have room, where the method can (0: never moves).
        host_memory_reserve: host bytes a release must leave free.
        context_bytes: counted on top of self-reported bytes when a restore needs room.
        clear_progress: take a restore's progress line out of the cell once it succeeded
            (cells that waited at the gate or in the agent: the line is all they hold yet).
        node_locks: restores also take turns per GPU with other servers on the machine.
        """
        self.tracker = tracker
        self.methods = methods
        self.config = config
        self.rules = rules or policy.Policy(config)
        self.clear_progress = clear_progress
        self.node_room = node_room
        self.kernels = kernels
        self.emit = emit
        self.restore_mode = restore_mode
        self.restore_grace = restore_grace
        self.move_after = move_after
        self.host_memory_reserve = host_memory_reserve
        self.context_bytes = context_bytes
        self.announce = Announcer(emit, kernels.agent, self._path_of, lambda: self.restore_mode)
        self.states: dict[str, Lifecycle] = {}
        self.reservations = Reservations(node_locks, uuid_of=self._gpu_uuid)
        self.room = RestoreRoom(self)
        self.rebalancer = Rebalancer(self)  # idle kernels off contended GPUs, between cells
        self.host_inflight: dict[str, int] = {}  # host-memory scope -> bytes being released
        self.closing = False
        self.agent_timeout = 10.0  # s the agent has to answer whether a release may start
        # set when memory may have freed (a poll, an operation's end), then replaced: a
        # waiting restore waits on the event of its time (restore_room.py)
        self.freed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._busy_since: dict[str, float] = {}
        #: the admin's default cap for this server's kernels, bytes per GPU (None: none);
        #: the server sets it (GPUShareApp.memory_limit, the hub service's caps)
        self.default_cap: Callable[[], int | None] = lambda: None
        #: per GPU, bytes other servers' kernels placed there and not using it yet are expected
        #: to take, and how many they are (the node daemon's or the hub service's word; the
        #: server sets them when it has either)
        self.placed_elsewhere: Callable[[], dict[int, int]] = dict
        self.pending_elsewhere: Callable[[], dict[int, int]] = dict
        #: tells the node's other servers now what this server's kernels want (the node
        #: daemon's exchange, started at once; the server sets it when it has a daemon)
        self.tell_wanted: Callable[[], None] | None = None
        #: kernel -> (its held state, the cap in effect when it was released): a restore
        #: refuses a state over a cap set or lowered since (cap_refusal)
        self._cap_at_release: dict[str, tuple[Held, int | None]] = {}
        #: kernel -> its kernelspec's memory_limit (None: none), read once, for its ceiling
        self._spec_cap: dict[str, int | None] = {}

    # -- reading -------------------------------------------------------------------------
    def get(self, kernel_id: str) -> Lifecycle:
        if kernel_id not in self.states:
            if kernel_id not in self.tracker.kernels and kernel_id not in self.tracker.km:
                raise ControllerError(404, f"no kernel {kernel_id!r} on this server")
            st = self.states[kernel_id] = Lifecycle(kernel_id)
            overrides = self.kernels.overrides(kernel_id)
            st.idle_timeout = overrides.get("idle_timeout")
            self._spec_cap[kernel_id] = overrides.get("memory_limit")
            st.cap_ceiling = self.cap_ceiling(kernel_id)
        return self.states[kernel_id]

    def find(self, kernel_id: str) -> Lifecycle | None:
        """The kernel's record, None when nothing was recorded for it yet (read only)."""
        return self.states.get(kernel_id)

    def lifecycles(self) -> list[Lifecycle]:
        """Every kernel's record (a copy of the list: safe to walk while operations run)."""
        return list(self.states.values())

    def method_for(self, kernel_id: str) -> str | None:
        """The release method that can act on the kernel now (None: none can)."""
        return self.kernels.method_for(kernel_id)

    def needs_restore(self, kernel_id: str) -> bool:
        st = self.states.get(kernel_id)
        return st is not None and st.is_held

    def memory_cap(self, st: Lifecycle) -> int | None:
        """The kernel's memory cap in effect, bytes per GPU (None: uncapped)."""
        return caps.effective(st.own_cap, st.cap_ceiling)

    def cap_ceiling(self, kernel_id: str) -> int | None:
        """The most a kernel's cap may be now: the smaller of its kernelspec's and the
        admin's (``default_cap``, which follows the hub service's caps); None: neither."""
        return caps.ceiling(self._spec_cap.get(kernel_id), self.default_cap())

    def cap_refusal(self, st: Lifecycle, held: Held) -> str | None:
        """Why ``held`` may not come back under the kernel's memory cap (None: it may).

        A restore never brings back more than a cap set or lowered since the release: a
        method that restores a process whole (the driver) cannot limit what comes back, so
        a state over that cap on a GPU (past one CUDA context, as a running kernel is
        flagged) is refused before anything moves, and stays held. A kernel over its cap
        when it was released (watched, not limited) comes back as it was."""
        cap = self.memory_cap(st)
        found = caps.over(held.gpus, cap, self.context_bytes)
        if cap is None or found is None:
            return None
        then = self._cap_at_release.get(st.kernel_id)
        if then is not None and then[0] is held and then[1] is not None and cap >= then[1]:
            return None
        gpu, n = found
        if st.cap_ceiling is None or n <= st.cap_ceiling + self.context_bytes:
            how = "lift or raise its own cap (%gpushare cap off, or the panel), then restore"
        else:
            how = (f"its kernelspec's or the admin's cap ({caps.describe(st.cap_ceiling)}) "
                   "cannot be raised by the kernel: ask for a higher cap, or restart the "
                   "kernel (its released GPU state is then lost)")
        where = f" on GPU {gpu}" if gpu >= 0 else ""
        return (f"not restored: its GPU state holds {format_bytes(n)}{where}, more than its "
                f"memory cap of {caps.describe(cap)} per GPU, set since it was released; a "
                f"restore never brings back more than the cap: {how}; the state stays held")

    def idle_timeout(self, st: Lifecycle) -> float:
        """The kernel's idle timeout in effect (its own, else the server's; 0 = never)."""
        return policy.effective_idle_timeout(st.idle_timeout, self.config.idle_timeout)

    def candidate(self, st: Lifecycle, rec: KernelRecord, now: float,
                  pressure_window: float | None = None) -> policy.Candidate:
        """The policy's view of a kernel. ``pressure_window``: seconds over which quietness
        on the GPU is judged for room-making (default ``pressure_idle_timeout``)."""
        return policy.observed(
            st.kernel_id, self.config, now,
            resident=st.held is None and st.op is None and st.resident in (ACTIVE, IDLE),
            busy=rec.busy,
            pinned=st.pinned,
            idle_seconds=rec.idle_seconds(now),
            utilization_since=rec.max_utilization_since,
            gpu_bytes=rec.gpu_bytes,
            idle_timeout=st.idle_timeout,
            releasable=self.method_for(st.kernel_id) is not None and st.release_blocked is None,
            memory_cap=self.memory_cap(st), cap_slack=self.context_bytes,
            pressure_window=pressure_window,
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

    def holds(self, kernel_id: str, pid: int | None) -> Callable[[], dict[int, int] | None]:
        """What the kernel's process ``pid`` holds per GPU at the last poll, the reading
        ``seen_free`` pairs with its restore's reservation (None: not measured per process,
        or another process now)."""
        def now() -> dict[int, int] | None:
            rec = self.tracker.kernels.get(kernel_id)
            if rec is None or not rec.attributed or not rec.pids or (
                    pid is not None and rec.pids[0] != pid):
                return None
            return dict(rec.gpu_bytes)
        return now

    def seen_free(self) -> dict[int, int]:
        """Free memory per GPU from the last sample, minus what restores reserved and has
        not landed yet (landed bytes are in the sample's used memory already)."""
        out = {}
        for g in self.node_room.total_bytes():
            rec = self.tracker.gpus.get(g)
            info = rec.info if rec is not None else None
            if info is None or info.memory_total is None or info.memory_used is None:
                continue
            out[g] = info.memory_total - info.memory_used - self.reservations.reserved(g)
        return out

    def wanted_free(self, now: float) -> dict[int, int]:
        """Free memory per GPU as the release policy weighs it: :meth:`seen_free` less what
        kernels this server placed there and that have not allocated yet are expected to
        take, and, with the hub service, what other servers' such kernels are
        (:attr:`placed_elsewhere`). A kernel started on a GPU where idle kernels leave too
        little room for it has them make way before its first allocation, not after it
        failed, whoever's they are."""
        promised = self.room.load.promised(now)
        others = self.placed_elsewhere()
        return {g: f - promised.get(g, 0) - others.get(g, 0) for g, f in self.seen_free().items()}

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
                st.observe(self._resident_state(st, rec, now))
                self._note_background(st, rec, now)
                self._note_host_room(st, rec)
                candidates.append(self.candidate(st, rec, now))
                self._watchdog(st, rec, now)
            except Exception:
                log.exception("gpushare: kernel %s: could not apply the policy", kid)
        for decision in self.rules.decide(candidates, self.wanted_free(now), self.node_room.total_bytes()):
            st = self.states[decision.kernel_id]
            if self.failed_recently(st, now) or st.op is not None or self.closing:
                continue
            try:
                self._start_release(st, decision.reason, automatic=True, by_kernel=False)
            except ControllerError as e:
                log.debug("gpushare: automatic release of %s skipped: %s", decision.kernel_id, e)
        try:
            self.rebalancer.tick(now)
        except Exception:
            log.exception("gpushare: the rebalance pass failed")
        self._signal_freed()  # waiting restores look again after every poll
        self._update_metrics()

    def failed_recently(self, st: Lifecycle, now: float) -> bool:
        """A kernel whose release failed is not tried again, automatically or to make room,
        for its idle timeout (at least ``RETRY_AFTER_FAILED_RELEASE``): the same refusal
        would come back at every poll."""
        return st.release_failed_at is not None and (
            now - st.release_failed_at < max(self.idle_timeout(st), RETRY_AFTER_FAILED_RELEASE))

    def _resident_state(self, st: Lifecycle, rec: KernelRecord, now: float) -> str:
        if not rec.gpu_memory_bytes:
            return UNTRACKED
        if rec.busy or rec.idle_seconds(now) < min(IDLE_AFTER, self.idle_timeout(st) or IDLE_AFTER):
            return ACTIVE
        return IDLE

    def _check_restart(self, st: Lifecycle, rec: KernelRecord) -> None:
        held = st.held
        if held is not None and held.kernel_pid is not None and rec.pids and rec.pids[0] != held.kernel_pid:
            self.drop_held(st.kernel_id, "the kernel restarted")

    def _note_background(self, st: Lifecycle, rec: KernelRecord, now: float) -> None:
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

    def _note_host_room(self, st: Lifecycle, rec: KernelRecord) -> None:
        need = self._host_need(rec, self.kernels.method_for(st.kernel_id))
        st.host_refusal = None if st.held is not None else self._host_refusal(rec.host_room, need)

    def _host_need(self, rec: KernelRecord, method_name: str | None) -> int:
        """Host memory a release takes: with a method that uses the kept host copies, only
        what it copies into no kept buffer (the kept copies are there already, counted in
        the room, and a written one is copied into its own buffer; an agent that does not
        say: all it copies); else (the driver's checkpoint copies everything) the whole GPU
        state."""
        method = self.methods.get(method_name) if method_name is not None else None
        if rec.to_copy_bytes is None or not getattr(method, "uses_kept_copies", False):
            return rec.gpu_memory_bytes
        new = rec.to_copy_new_bytes
        return min(rec.gpu_memory_bytes, rec.to_copy_bytes if new is None else new)

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

    def _watchdog(self, st: Lifecycle, rec: KernelRecord, now: float) -> None:
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
        self.freed.set()
        self.freed = asyncio.Event()

    # -- operations: start, wait ------------------------------------------------------------
    def _start(self, st: Lifecycle, op: Operation, body: Awaitable[Outcome]) -> Operation:
        """Start ``op`` (its first step already taken: ``st.op`` is ``op``)."""
        op.body = asyncio.ensure_future(body)
        op.task = asyncio.ensure_future(self._run(st, op))
        return op

    async def _run(self, st: Lifecycle, op: Operation) -> Outcome:
        """Every operation ends here: whatever happened, ``op`` is cleared and waiters wake."""
        try:
            return await op.body
        except asyncio.CancelledError:  # only a waiting phase can be stopped
            return Outcome(False, op.stop_reason or "stopped while waiting for GPU memory")
        except Exception as e:  # a bug: never leave the state or the waiters stuck on it
            log.exception("gpushare: %s of kernel %s failed unexpectedly", op.kind, st.kernel_id)
            st.crashed(f"{op.kind} failed: {type(e).__name__}: {e}")
            return Outcome(False, f"{op.kind} failed: {type(e).__name__}: {e}")
        finally:
            if op.on_end is not None:
                op.on_end()
            dropped = st.operation_ended(op)
            if dropped:
                self.drop_held(st.kernel_id, dropped)
            self._signal_freed()
            self._update_metrics()

    async def wait(self, op: Operation) -> Outcome:
        """Wait for ``op`` to end; cancelling the waiter never stops the operation."""
        return await wait_for(op)

    async def settle(self, kernel_id: str) -> None:
        """Wait until no operation is in flight on the kernel (lazy mode's gate)."""
        st = self.states.get(kernel_id)
        while st is not None and st.op is not None:
            await wait_for(st.op)

    def stop_waiting(self, kernel_id: str, why: str) -> bool:
        """Stop a restore that waits for memory (an interrupt). Never stops bytes in flight."""
        st = self.states.get(kernel_id)
        op = st.op if st is not None else None
        if op is None or not op.stoppable:
            return False
        op.stop(why)
        return True

    # -- release -----------------------------------------------------------------------------
    async def release(
        self, kernel_id: str, reason: str = "requested", automatic: bool = False,
        by_kernel: bool = False,
    ) -> Lifecycle:
        st = self.get(kernel_id)
        op = self._start_release(st, reason, automatic=automatic, by_kernel=by_kernel)
        outcome = await wait_for(op)
        if not outcome.ok:
            raise ControllerError(409, outcome.message, outcome.retryable)
        return st

    async def release_if_idle(self, kernel_id: str, idle_for: float, reason: str) -> Lifecycle:
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
        busy_now = c.busy or self.kernels.live_state(kernel_id) == "busy"
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

    def release_automatically(self, kernel_id: str, reason: str) -> Operation:
        """Start a release as the policy would (a pinned kernel is refused: 409)."""
        return self._start_release(self.get(kernel_id), reason, automatic=True, by_kernel=False)

    def note_waiting(self, kernel_id: str, note: str | None) -> None:
        """What the node-wide service says about a restore's wait (shown beside it)."""
        st = self.states.get(kernel_id)
        if st is not None and st.waiting:
            st.waiting_note = note

    def stop_now(self) -> None:
        """The server goes without waiting (another one took over): no new operation starts."""
        self.closing = True

    def restore_need(self, kernel_id: str) -> dict[int, int]:
        """Bytes per GPU a waiting restore needs free (empty when no restore waits)."""
        st = self.states.get(kernel_id)
        if st is None or st.held is None or not (st.waiting or "").startswith(MEMORY_WAIT):
            return {}  # not waiting, or waiting for a restore turn, not for memory
        return self.need(st.held)

    def _start_release(self, st: Lifecycle, reason: str, automatic: bool, by_kernel: bool) -> Operation:
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
        method_name = self.kernels.method_for(st.kernel_id)
        if method_name is None:
            raise ControllerError(409, "no release method is available for this kernel")
        st.observe(self._resident_state(st, rec, clock.now()))  # this moment's, not the last tick's
        op = Operation("release", reason)
        st.begin_release(op)
        return self._start(st, op, self._release_op(st, op, rec, method_name, reason, automatic, by_kernel))

    def _release_target(self, kid: str, rec: KernelRecord) -> KernelTarget:
        gpu_bytes = dict(rec.gpu_bytes)
        pid_bytes = rec.pid_gpu_bytes
        # only pids with GPU memory (or, unmeasured, a GPU device open) have a context to move
        pids = [p for p in rec.pids if p in pid_bytes] or list(rec.gpu_pids) or rec.pids[:1]
        return KernelTarget(kernel_id=kid, pids=pids, gpu_bytes=gpu_bytes, agent=self.kernels.agent(kid),
                            pid_bytes={p: dict(b) for p, b in pid_bytes.items()})

    async def _refuse(self, st: Lifecycle, op: Operation, message: str) -> Outcome:
        """Nothing moved and nothing changed: say why, keep the kernel as it is."""
        st.release_refused()
        log.info("gpushare: release of kernel %s refused: %s", st.kernel_id, message)
        return Outcome(False, message)

    async def _release_op(
        self, st: Lifecycle, op: Operation, rec: KernelRecord, method_name: str, reason: str,
        automatic: bool, by_kernel: bool,
    ) -> Outcome:
        kid = st.kernel_id
        method = self.methods[method_name]
        target = self._release_target(kid, rec)
        need = rec.gpu_memory_bytes
        # the held state is built from this moment's record, as the target is: a poll while we
        # wait below may already show a restarted kernel's new process in ``rec``
        kernel_pid, gpus, attributed = (rec.pids[0] if rec.pids else None), self._gpus_of(rec), rec.attributed
        room = await self.node_room.host_room(kernel_pid)
        host_need = self._host_need(rec, method_name)
        why = self._host_refusal(room, host_need)
        if why:
            st.host_refusal = why
            return await self._refuse(st, op, f"not released: {why}")
        scope = room.scope if room is not None else "machine"
        # claimed at the check, before the agent is asked (that yields): releases checked
        # meanwhile must count these bytes, or two that fit alone both move and OOM the host.
        # Given back when the method returns (the host's own numbers count the bytes then),
        # or when the operation ends without moving (refused, stopped)
        give_back = op.on_end = self._host_claim(scope, host_need)
        agent = self.kernels.agent(kid)
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
        elif self.kernels.live_state(kid) == "busy" and not by_kernel:
            return await self._refuse(st, op, "kernel is busy running a cell; release it when idle")

        op.phase = "moving"
        held = Held(method=method_name, bytes=need, gpus=gpus, pids=list(target.pids),
                    pid_bytes=target.pid_bytes, kernel_pid=kernel_pid,
                    attributed=attributed, since=clock.now())
        st.hold(held)
        self._cap_at_release[kid] = (held, self.memory_cap(st))
        self.announce.tell_agent(kid, RELEASING)
        started = time.monotonic()
        try:
            result = await to_the_end(method.release(target, self._progress_log(kid)))
        except ReclaimError as e:
            if e.unfit and e.resident:  # undone: another method may free what this one cannot
                self.kernels.method_failed(kid, method_name, e.unfit)
            outcome = await self._release_failed(st, held, method_name, str(e), e.resident,
                                                 e.retryable, started)
            if e.unfit and e.resident and self.kernels.method_for(kid) not in (None, method_name):
                st.release_failed_at = None  # the next release uses another method: no wait
            return outcome
        except Exception as e:  # a timeout, a lost channel, a bug: the undo is not confirmed
            return await self._release_failed(st, held, method_name, str(e) or type(e).__name__,
                                              False, True, started)
        finally:
            give_back()
        seconds = time.monotonic() - started
        if st.held is not held:  # dropped meanwhile (a restart): nothing left to show
            return Outcome(False, st.error or "the held state was dropped", dropped=True)
        st.release_done(held, result.bytes or need, seconds, result.detail)
        self.announce(kid, "released", method=method_name, state=RELEASED, bytes=held.bytes,
                      seconds=seconds, reason=reason, detail=result.detail or None)
        log.info("gpushare: released %s of kernel %s in %.2f s (%s)%s",
                 format_bytes(held.bytes), kid, seconds, reason,
                 f": {result.detail}" if result.detail else "")
        await self.refresh_quietly()
        return Outcome(True, result.detail)

    async def _release_failed(
        self, st: Lifecycle, held: Held, method_name: str, why: str, resident: bool,
        retryable: bool, started: float,
    ) -> Outcome:
        kid = st.kernel_id
        if resident:
            st.release_undone(held, why, clock.now())
        else:
            st.release_unconfirmed(held, why, retryable, clock.now())
        self.announce(kid, "release_failed", method=method_name, state=st.state, reason=why,
                      seconds=time.monotonic() - started)
        log.warning("gpushare: release of kernel %s failed: %s", kid, st.error)
        await self.refresh_quietly()
        return Outcome(False, st.error or why, retryable)

    def _host_claim(self, scope: str, n: int) -> Callable[[], None]:
        """Count ``n`` bytes as on their way into host memory; returns the (idempotent) undo.
        A claim of nothing (a release whose kept host copies are all current) counts nothing:
        an entry of 0 would be deleted by whichever claim on its scope ends first, and the
        other's undo would find none."""
        claimed = [n] if n > 0 else []
        if claimed:
            self.host_inflight[scope] = self.host_inflight.get(scope, 0) + n

        def give_back() -> None:
            if claimed:
                claimed.clear()
                left = self.host_inflight.get(scope, 0) - n
                if left > 0:
                    self.host_inflight[scope] = left
                else:
                    self.host_inflight.pop(scope, None)

        return give_back

    def _gpus_of(self, rec: KernelRecord) -> dict[int, int]:
        return {g: b for g, b in rec.gpu_bytes.items() if b}

    # -- restore ---------------------------------------------------------------------------
    async def restore(self, kernel_id: str, trigger: str = "rest", parent: dict | None = None) -> Lifecycle:
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
        st.begin_restore(op)
        return self._start(st, op, self._restore_op(st, op, st.held, parent, wait=True))

    async def ensure_resident(
        self, kernel_id: str, trigger: str = "gate", parent: dict | None = None
    ) -> Lifecycle:
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
                outcome = await wait_for(op)
                if op.trigger == ahead.AHEAD and trigger != ahead.AHEAD:
                    continue  # an ahead restore that did not bring it back: the cell's does
                if op.kind == "restore" and not outcome.ok and st.drops == drops:
                    raise ControllerError(409, outcome.message, outcome.retryable and not outcome.dropped)
                continue
            if st.held is None:
                return st
            self.start_restore(kernel_id, trigger, parent)

    def need(self, held: Held) -> dict[int, int]:
        """Bytes to reserve per GPU before restoring ``held`` (see :func:`..policy.room.to_reserve`)."""
        return to_reserve(held.gpus, held.bytes, held.attributed, self.context_bytes,
                               list(self.node_room.total_bytes()))

    async def _restore_op(
        self, st: Lifecycle, op: Operation, held: Held, parent: dict | None, wait: bool
    ) -> Outcome:
        need = self.need(held)
        shown = CellProgress(self.kernels.agent(st.kernel_id), parent,
                        clear_when_done=self.clear_progress and op.trigger in CLEARED_TRIGGERS)
        refused = self._refuse_over_cap(st, held)  # before it waits for (or makes) room
        if refused is not None:
            return refused
        again = ""  # why it waits once more: its room was taken right before the method's call
        taken = 0
        while True:
            # a kernel moved off a contended GPU goes to its new one; else the room finds where
            grant = await self.rebalancer.grant(st, op, held, need, shown) or await self.room.find(
                st, op, held, need, shown, wait, again)
            if isinstance(grant, Outcome):
                return grant
            refused = self._refuse_over_cap(st, held)  # the cap may have changed while it waited
            if refused is not None:
                grant.release()
                return refused
            try:
                st.restore_moving()
                return await to_the_end(self._move_back(st, op, held, shown, grant,
                                                        wait_again=taken < ROOM_TAKEN_WAITS))
            except RoomTaken as e:
                taken += 1
                again = e.why
                if self.rebalancer.granted.get(st.kernel_id) is grant:  # it did not move
                    self.rebalancer.granted.pop(st.kernel_id)
            finally:
                grant.release()

    def _refuse_over_cap(self, st: Lifecycle, held: Held) -> Outcome | None:
        """The outcome of a restore refused for the kernel's cap (None: not refused); the
        state stays as it is, the reason shown in status."""
        why = self.cap_refusal(st, held)
        if why is None or st.held is not held:
            return None
        st.note_error(why)
        log.info("gpushare: kernel %s: %s", st.kernel_id, why)
        return Outcome(False, why, True)

    async def _move_back(
        self, st: Lifecycle, op: Operation, held: Held, shown: CellProgress, grant: Grant,
        wait_again: bool = False,
    ) -> Outcome:
        """Move the state back under ``grant``. ``wait_again``: a refusal of the method for
        room alone (``ReclaimError.no_room``: nothing moved) goes back to waiting for room
        (:class:`RoomTaken`) instead of failing the restore."""
        kid = st.kernel_id
        method = self.methods[held.method]
        expected = st.last_restore_seconds
        moved_to = onto(grant.mapping, grant.why)
        gpus = ", ".join(str(grant.mapping.get(g, g)) for g in sorted(held.gpus) if g >= 0) or "-"
        await shown(f"gpushare: restoring {format_bytes(held.bytes)} to GPU {gpus}"
                    + (f" ({moved_to})" if moved_to else "")
                    + (f" (last time {expected:.2f} s)" if expected else "") + " ...")
        rec = self.tracker.kernels.get(kid)
        target = KernelTarget(kernel_id=kid, pids=list(held.pids), gpu_bytes=dict(held.gpus),
                              agent=self.kernels.agent(kid), pid_bytes=held.pid_bytes,
                              gpu_mapping=dict(grant.mapping))
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
            no_room = e.no_room if isinstance(e, ReclaimError) else ""
            if no_room and st.held is held and not self.closing:
                if wait_again and op.trigger != ahead.AHEAD:
                    raise await self._room_taken(st, op, method.name, held, no_room, shown) from None
                why += (f" (the room was taken right before the restore {ROOM_TAKEN_WAITS + 1} "
                        "times: another process keeps taking it)"
                        if op.trigger != ahead.AHEAD else "")
            ended = self._process_ended(kid, held)
            if ended:  # the process that held the state is gone: nothing to retry
                st.drop(ended)  # bytes were moving: dropped as the operation ends, before waiters wake
                self.announce(kid, "restore_failed", method=method.name, reason=f"{ended} ({why})",
                              seconds=time.monotonic() - started)
                gone = f"{ended}: its released GPU state is gone"
                await shown(f"gpushare: restore failed: {gone}")
                log.warning("gpushare: restore of kernel %s failed: %s (%s)", kid, gone, why)
                return Outcome(False, gone, False, dropped=True)
            # a restore ahead of a cell that fails leaves the kernel released, the reason shown
            st.restore_failed(ahead.failed_restore_error(op.trigger, why), retryable,
                              stays_released=op.trigger == ahead.AHEAD)
            self.announce(kid, "restore_failed", method=method.name,
                          state=FAILED if st.failed else RELEASED, reason=why,
                          seconds=time.monotonic() - started, trigger=op.trigger)
            await shown(f"gpushare: restore failed, your state is still held: {why}")
            log.warning("gpushare: restore of kernel %s failed: %s", kid, why)
            await self.refresh_quietly()
            return Outcome(False, st.error or why, retryable)
        grant.release()  # landed bytes count as used from here: not twice, as reserved too
        seconds = time.monotonic() - started
        moved = result.bytes or held.bytes
        st.restore_done(held, seconds, moved_to)
        self.tracker.touch(kid)
        self.announce(kid, "restored", method=method.name, state=ACTIVE, bytes=moved,
                      seconds=seconds, reason=op.trigger)
        await shown(f"gpushare: restored {format_bytes(moved)} in {seconds:.2f} s"
                    + (f", {moved_to}" if moved_to else ""))
        await shown.done()  # before the cell's code runs (saved notebooks carry no timings)
        log.info("gpushare: restored %s of kernel %s in %.2f s (%s)",
                 format_bytes(moved), kid, seconds, op.trigger)
        await self.refresh_quietly()
        return Outcome(True)

    async def _room_taken(self, st: Lifecycle, op: Operation, method: str, held: Held,
                          short: str, shown: CellProgress) -> RoomTaken:
        """The method found the room taken right before its call (``short``: "GPU 0 has
        512 MiB free, 1.0 GiB needed"), nothing moved: back to waiting, said in status, in
        the cell and by a ``restore_waiting`` event (its reason without parentheses)."""
        why = f"the room was taken right before the restore ({short})"
        self.announce(st.kernel_id, "restore_waiting", method=method, bytes=held.bytes,
                      reason=f"the room was taken right before the restore: {short}",
                      trigger=op.trigger)
        await shown(f"gpushare: {why}: waiting for room again (interrupt to stop waiting)")
        log.info("gpushare: kernel %s: %s; waiting for room again", st.kernel_id, why)
        if st.short_since is None:
            st.short_since = clock.now()  # its wait counts from here, or from its first
        # last, with no await after it: an interrupt from here stops the wait, not a move
        st.restore_room_taken(f"{MEMORY_WAIT}: {why}")
        return RoomTaken(why)

    def _process_ended(self, kernel_id: str, held: Held) -> str | None:
        """Why the process that holds the state is gone (restarted, died), else None."""
        ended = getattr(self.tracker, "process_ended", None)  # a tracker that cannot tell: None
        if held.kernel_pid is None or ended is None:
            return None
        why: str | None = ended(kernel_id, held.kernel_pid)
        return why

    # -- pin, drop, shutdown ------------------------------------------------------------------
    def set_pinned(self, kernel_id: str, pinned: bool) -> Lifecycle:
        st = self.get(kernel_id)
        if st.pinned != pinned:
            st.pinned = pinned
            self.announce(kernel_id, "pinned" if pinned else "unpinned", method=st.method)
        return st

    def set_idle_timeout(self, kernel_id: str, seconds: float | None) -> Lifecycle:
        st = self.get(kernel_id)
        st.idle_timeout = seconds
        return st

    def set_memory_cap(self, kernel_id: str, cap: int | None) -> Lifecycle:
        """The kernel's own cap (None: back to its ceiling); never above the ceiling."""
        st = self.get(kernel_id)
        if cap is not None and st.cap_ceiling is not None and cap > st.cap_ceiling:
            raise ControllerError(409, f"this kernel's cap can be at most "
                                       f"{caps.describe(st.cap_ceiling)} per GPU (its kernelspec's "
                                       "or the admin's): a kernel may lower its cap, not raise it")
        st.own_cap = cap
        return st

    def set_allow_background(self, kernel_id: str, allow: bool) -> Lifecycle:
        st = self.get(kernel_id)
        st.allow_background = allow
        return st

    def drop_held(self, kernel_id: str, why: str) -> None:
        """The process that held the state is gone (restart, death): nothing left to restore."""
        st = self.states.get(kernel_id)
        if st is None or st.held is None:
            return
        op = st.op
        if not st.drop(why):
            return  # bytes are moving: the method fails on its own, the drop follows its end
        log.warning("gpushare: kernel %s: %s; its released GPU state is gone with the old process",
                    kernel_id, why)
        if op is not None:
            op.stop(st.error or why)
        metrics.forget_kernel(kernel_id)
        self._signal_freed()

    def _forget(self, kernel_id: str, why: str) -> None:
        self.drop_held(kernel_id, why)
        st = self.states.get(kernel_id)
        if st is not None and st.op is not None and st.op.phase == "waiting":
            st.op.stop(why)
        self.states.pop(kernel_id, None)
        self._busy_since.pop(kernel_id, None)
        self._cap_at_release.pop(kernel_id, None)
        self._spec_cap.pop(kernel_id, None)
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
            st.begin_restore(op)
            self._start(st, op, self._restore_op(st, op, st.held, None, wait=False))
            try:
                outcome = await asyncio.wait_for(wait_for(op), timeout)
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

    async def refresh_quietly(self) -> None:
        try:
            await self.node_room.refresh()
        except Exception:
            log.exception("gpushare: refresh after an operation failed")

    def _progress_log(self, kernel_id: str) -> Callable[[str], None]:
        return lambda text: log.debug("gpushare: kernel %s: %s", kernel_id, text)

    def _path_of(self, kernel_id: str) -> str:
        rec = self.tracker.kernels.get(kernel_id)
        return rec.path if rec is not None else ""

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



__all__ = ["Controller", "ControllerError", "Held", "Lifecycle", "Operation", "Outcome"]
