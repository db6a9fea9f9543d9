"""The per-kernel state machine: the only place a kernel's gpushare state changes.

States (DESIGN.md): active -> idle -> releasing -> released -> restoring -> active;
failed (a restore went wrong: the state is still held, the reason is shown);
untracked (no GPU use, no local pid, or no way to release it). ``pinned`` is a flag.

One operation per kernel at a time (a per-kernel asyncio lock). Every transition emits
an event and updates metrics. Failures never lose state: a failed release leaves the
kernel resident and running; a failed restore leaves the state held on the host.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from . import clock, metrics, policy
from .reclaim import KernelTarget, ReclaimError, ReclaimMethod
from .sim.node import format_bytes
from .tracker import KernelRecord, Tracker

log = logging.getLogger(__name__)

ACTIVE, IDLE, RELEASING, RELEASED, RESTORING, FAILED, UNTRACKED = (
    "active", "idle", "releasing", "released", "restoring", "failed", "untracked",
)
HELD = (RELEASING, RELEASED, RESTORING, FAILED)  # GPU state not (fully) on the GPU
IDLE_AFTER = 60.0  # s without activity before a resident kernel shows as "idle"


class ControllerError(Exception):
    """A request the state does not allow (409), or for an unknown kernel (404)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class KernelState:
    kernel_id: str
    state: str = UNTRACKED
    pinned: bool = False
    method: str | None = None
    releases: int = 0
    restores: int = 0
    last_restore_seconds: float | None = None
    last_release_seconds: float | None = None
    error: str | None = None
    waiting: str | None = None  # why a restore waits (for memory), None when it does not
    released_bytes: int = 0
    released_gpus: dict[int, int] = field(default_factory=dict)
    released_pid: int | None = None
    released_pid_bytes: dict[int, dict[int, int]] = field(default_factory=dict)
    released_at: float | None = None
    release_failed_at: float | None = None
    idle_timeout: float | None = None  # per-kernel override (kernelspec metadata, magic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def held(self) -> bool:
        return self.state in HELD


Emit = Callable[[dict[str, Any]], None]
AgentLookup = Callable[[str], Any]


class Controller:
    def __init__(
        self,
        tracker: Tracker,
        methods: dict[str, ReclaimMethod],
        choose_method: Callable[[str], str | None],
        config: policy.PolicyConfig,
        free_bytes: Callable[[int], int | None],
        total_bytes: Callable[[], dict[int, int]],
        agent: AgentLookup,
        emit: Emit,
        restore_mode: str = "eager",
        restore_grace: float = 30.0,
        kernel_overrides: Callable[[str], dict[str, Any]] | None = None,
    ):
        self.tracker = tracker
        self.methods = methods
        self.choose_method = choose_method
        self.config = config
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.agent = agent
        self.emit = emit
        self.restore_mode = restore_mode
        self.restore_grace = restore_grace
        self.kernel_overrides = kernel_overrides or (lambda kid: {})
        self.states: dict[str, KernelState] = {}
        self._memory_freed = asyncio.Event()
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
        return st is not None and st.held

    def candidate(self, st: KernelState, rec: KernelRecord, now: float) -> policy.Candidate:
        window = st.idle_timeout if st.idle_timeout else self.config.idle_timeout
        since = now - max(window, 1.0)  # at least one sample's worth of window
        return policy.Candidate(
            kernel_id=st.kernel_id,
            resident=st.state in (ACTIVE, IDLE),
            busy=rec.busy,
            pinned=st.pinned,
            idle_seconds=rec.idle_seconds(now),
            max_utilization=rec.max_utilization_since(since),
            gpu_bytes={g: b for g, b in rec.gpu_bytes.items() if g >= 0},
            idle_timeout=st.idle_timeout,
            releasable=self.choose_method(st.kernel_id) is not None,
        )

    def release_in(self, kernel_id: str) -> float | None:
        st, rec = self.states.get(kernel_id), self.tracker.kernels.get(kernel_id)
        if st is None or rec is None:
            return None
        return policy.seconds_until_release(self.candidate(st, rec, clock.now()), self.config)

    # -- the loop --------------------------------------------------------------------------
    async def tick(self) -> None:
        """After each tracker poll: sync states, drop the dead, apply the policy."""
        now = clock.now()
        for kid in set(self.states) - set(self.tracker.kernels):
            if kid not in self.tracker.km:
                self._forget(kid, "the kernel is gone")
        candidates = []
        for kid, rec in self.tracker.kernels.items():
            st = self.get(kid)
            self._check_restart(st, rec)
            if not st.held:
                st.state = self._resident_state(rec, now)
            candidates.append(self.candidate(st, rec, now))
            self._watchdog(st, rec, now)
        free = {g: f for g in self.total_bytes() if (f := self.free_bytes(g)) is not None}
        for decision in policy.decide(candidates, free, self.total_bytes(), self.config):
            st = self.states[decision.kernel_id]
            if st.release_failed_at is not None and now - st.release_failed_at < max(
                self.config.idle_timeout, 60.0
            ):
                continue  # a release that failed is not retried every poll
            self._spawn(self._auto_release(decision))
        self._memory_freed.set()  # waiting restores re-check after every poll
        self._update_metrics()

    def _resident_state(self, rec: KernelRecord, now: float) -> str:
        if not rec.gpu_memory_bytes:
            return UNTRACKED
        if rec.busy or rec.idle_seconds(now) < min(IDLE_AFTER, self.config.idle_timeout or IDLE_AFTER):
            return ACTIVE
        return IDLE

    def _check_restart(self, st: KernelState, rec: KernelRecord) -> None:
        if st.held and st.released_pid is not None and rec.pids and rec.pids[0] != st.released_pid:
            self.drop_held(st.kernel_id, "the kernel restarted")

    def _watchdog(self, st: KernelState, rec: KernelRecord, now: float) -> None:
        """Lazy mode: a released kernel busy for longer than restore_grace gets restored."""
        if st.state != RELEASED or not rec.busy:
            self._busy_since.pop(st.kernel_id, None)
            return
        since = self._busy_since.setdefault(st.kernel_id, now)
        if now - since >= self.restore_grace:
            self._busy_since.pop(st.kernel_id, None)
            self._spawn(self.ensure_resident(st.kernel_id, trigger="watchdog"))

    async def _auto_release(self, decision: policy.Decision) -> None:
        try:
            await self.release(decision.kernel_id, reason=decision.reason, automatic=True)
        except ControllerError as e:
            log.debug("gpushare: automatic release of %s skipped: %s", decision.kernel_id, e)
        except Exception:
            log.exception("gpushare: automatic release of %s failed", decision.kernel_id)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- release -----------------------------------------------------------------------------
    def _target(self, kid: str, rec: KernelRecord | None, st: KernelState) -> KernelTarget:
        if st.held:  # what the kernel held when released: nothing of it is on the GPU now
            gpu_bytes, pid_bytes = dict(st.released_gpus), st.released_pid_bytes
        else:
            gpu_bytes = {g: b for g, b in rec.gpu_bytes.items() if g >= 0} if rec else {}
            pid_bytes = rec.pid_gpu_bytes if rec else {}
        # only pids that hold GPU memory have something to checkpoint (the driver needs a context)
        pids = [p for p in (rec.pids if rec else []) if p in pid_bytes] or (rec.pids[:1] if rec else [])
        return KernelTarget(kernel_id=kid, pids=pids, gpu_bytes=gpu_bytes, agent=self.agent(kid),
                            extra={"pid_gpu_bytes": {p: dict(b) for p, b in pid_bytes.items()}})

    async def release(
        self, kernel_id: str, reason: str = "requested", automatic: bool = False,
        by_kernel: bool = False,
    ) -> KernelState:
        st = self.get(kernel_id)
        if st.lock.locked() and not automatic:
            raise ControllerError(409, f"kernel is {st.state}: another operation is running")
        async with st.lock:
            rec = self.tracker.kernels.get(kernel_id)
            if st.held:
                raise ControllerError(409, f"kernel is already {st.state}")
            if rec is None or not rec.gpu_memory_bytes:
                raise ControllerError(409, "kernel holds no GPU memory")
            if st.pinned and automatic:
                raise ControllerError(409, "kernel is pinned")
            if rec.busy and not by_kernel:
                raise ControllerError(409, "kernel is busy running a cell; release it when idle")
            method_name = self.choose_method(kernel_id)
            if method_name is None:
                raise ControllerError(409, "no release method is available for this kernel")
            method = self.methods[method_name]
            target = self._target(kernel_id, rec, st)
            previous = st.state
            st.state, st.method, st.error = RELEASING, method_name, None
            self._notify_agent(kernel_id, RELEASING)
            started = time.monotonic()
            try:
                result = await method.release(target)
            except (ReclaimError, ConnectionError, asyncio.TimeoutError) as e:
                st.state = previous
                st.error = f"release failed: {e}"
                st.release_failed_at = clock.now()
                self._notify_agent(kernel_id, previous)
                metrics.RELEASES.labels(method_name, "failed").inc()
                self._emit(st, "release_failed", reason=str(e), seconds=time.monotonic() - started)
                log.warning("gpushare: release of kernel %s failed: %s", kernel_id, e)
                raise ControllerError(409, st.error) from None
            seconds = time.monotonic() - started
            st.state = RELEASED
            st.released_bytes = result.bytes or target_bytes(target)
            st.released_gpus = dict(target.gpu_bytes)
            st.released_pid = rec.pids[0] if rec.pids else None
            st.released_pid_bytes = target.extra.get("pid_gpu_bytes", {})
            st.released_at = clock.now()
            st.release_failed_at = None
            st.releases += 1
            st.last_release_seconds = seconds
            self._notify_agent(kernel_id, RELEASED)
            metrics.RELEASES.labels(method_name, "ok").inc()
            metrics.RELEASE_SECONDS.observe(seconds)
            self._emit(st, "released", bytes=st.released_bytes, seconds=seconds, reason=reason)
            log.info("gpushare: released %s of kernel %s in %.2f s (%s)",
                     format_bytes(st.released_bytes), kernel_id, seconds, reason)
            self._memory_freed.set()
            self._update_metrics()
            return st

    # -- restore -------------------------------------------------------------------------
    async def restore(self, kernel_id: str, trigger: str = "rest", parent: dict | None = None) -> KernelState:
        """Restore a held kernel; 409 when it is not held."""
        st = self.get(kernel_id)
        if not st.held:
            raise ControllerError(409, f"kernel is {st.state}, not released")
        return await self.ensure_resident(kernel_id, trigger=trigger, parent=parent)

    async def ensure_resident(
        self, kernel_id: str, trigger: str = "gate", parent: dict | None = None
    ) -> KernelState:
        """Return once the kernel's GPU state is on the GPU (waits for a release in flight)."""
        st = self.get(kernel_id)
        if not st.held:
            return st
        async with st.lock:
            if not st.held:
                return st  # somebody else restored it while we waited
            await self._restore_locked(st, trigger, parent)
            return st

    async def _restore_locked(self, st: KernelState, trigger: str, parent: dict | None) -> None:
        kid = st.kernel_id
        method = self.methods[st.method or ""]
        need = dict(st.released_gpus)
        shown = _Shower(self.agent(kid), parent)
        try:
            if not await self._wait_for_room(st, need, shown):
                return  # the held state was dropped while we waited (restart, shutdown)
        finally:
            st.waiting = None  # done, dropped or cancelled (an interrupt): not waiting any more
        st.state, st.error = RESTORING, None
        expected = st.last_restore_seconds
        await shown(f"gpushare: restoring {format_bytes(st.released_bytes)} to GPU "
                    f"{', '.join(map(str, sorted(need))) or '-'}"
                    + (f" (last time {expected:.2f} s)" if expected else "") + " ...")
        started = time.monotonic()
        rec = self.tracker.kernels.get(kid)
        try:
            result = await method.restore(self._target(kid, rec, st))
        except (ReclaimError, ConnectionError, asyncio.TimeoutError) as e:
            st.state, st.error = FAILED, f"restore failed: {e}"
            metrics.RESTORES.labels(method.name, "failed").inc()
            self._emit(st, "restore_failed", reason=str(e), seconds=time.monotonic() - started)
            await shown(f"gpushare: restore failed, your state is still held: {e}")
            log.warning("gpushare: restore of kernel %s failed: %s", kid, e)
            raise ControllerError(409, st.error) from None
        seconds = time.monotonic() - started
        moved = result.bytes or st.released_bytes
        st.state, st.waiting = ACTIVE, None
        st.restores += 1
        st.last_restore_seconds = seconds
        st.released_bytes, st.released_gpus, st.released_pid, st.released_at = 0, {}, None, None
        st.released_pid_bytes = {}
        self.tracker.touch(kid)
        self._notify_agent(kid, ACTIVE)
        metrics.RESTORES.labels(method.name, "ok").inc()
        metrics.RESTORE_SECONDS.observe(seconds)
        self._emit(st, "restored", bytes=moved, seconds=seconds, reason=trigger)
        await shown(f"gpushare: restored {format_bytes(moved)} in {seconds:.2f} s")
        log.info("gpushare: restored %s of kernel %s in %.2f s (%s)", format_bytes(moved), kid, seconds, trigger)
        self._update_metrics()

    async def _wait_for_room(self, st: KernelState, need: dict[int, int], shown: _Shower) -> bool:
        """Never restore without room: make room per policy, else wait and say why.

        False when the held state went away while waiting."""
        announced = False
        while True:
            if not st.held:
                return False
            free = {g: self.free_bytes(g) for g in need}
            if all(f is not None and f >= need[g] for g, f in free.items()):
                st.waiting = None
                return True
            known_free = {g: f for g, f in free.items() if f is not None}
            now = clock.now()
            cands = [self.candidate(self.states[k], r, now) for k, r in self.tracker.kernels.items()
                     if k in self.states]
            plan = policy.make_room(need, known_free, cands, self.config, exclude=st.kernel_id)
            if plan:
                for d in plan:
                    try:
                        await self.release(d.kernel_id, reason=d.reason, automatic=True)
                    except ControllerError as e:
                        log.info("gpushare: could not make room with %s: %s", d.kernel_id, e)
                continue
            short = ", ".join(
                f"{format_bytes(n)} on GPU {g} ({format_bytes(free[g] or 0)} free)"
                for g, n in need.items() if (free[g] or 0) < n
            )
            st.waiting = f"waiting for memory: needs {short}"
            if not announced:
                announced = True
                self._emit(st, "restore_waiting", bytes=sum(need.values()), reason=st.waiting)
                await shown(f"gpushare: {st.waiting}; the cell runs once memory frees "
                            "(interrupt to stop waiting)")
            self._memory_freed.clear()
            try:
                await asyncio.wait_for(self._memory_freed.wait(), 5.0)
            except asyncio.TimeoutError:
                pass

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

    def drop_held(self, kernel_id: str, why: str) -> None:
        """The process that held the state is gone (restart, death): nothing left to restore."""
        st = self.states.get(kernel_id)
        if st is None or not st.held:
            return
        log.warning("gpushare: kernel %s: %s; its released GPU state is gone with the old process",
                    kernel_id, why)
        st.state, st.error, st.waiting = UNTRACKED, f"{why}: released state dropped", None
        st.released_bytes, st.released_gpus, st.released_pid, st.released_at = 0, {}, None, None
        st.released_pid_bytes = {}
        metrics.forget_kernel(kernel_id)
        self._memory_freed.set()

    def _forget(self, kernel_id: str, why: str) -> None:
        self.drop_held(kernel_id, why)
        self.states.pop(kernel_id, None)
        metrics.forget_kernel(kernel_id)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Leave no kernel wedged: restore every held kernel that has room, log the rest."""
        for task in list(self._tasks):
            task.cancel()
        for kid, st in list(self.states.items()):
            if st.state not in (RELEASED, FAILED):
                continue
            need = st.released_gpus
            room = all((self.free_bytes(g) or 0) >= n for g, n in need.items())
            if not room:
                log.error("gpushare: at shutdown kernel %s stays released (no room on the GPU); "
                          "its state is held by the driver/agent until it exits", kid)
                continue
            try:
                await asyncio.wait_for(self.ensure_resident(kid, trigger="shutdown"), timeout)
            except Exception as e:
                log.error("gpushare: at shutdown could not restore kernel %s: %s", kid, e)

    # -- plumbing -------------------------------------------------------------------------------
    def _notify_agent(self, kernel_id: str, state: str) -> None:
        agent = self.agent(kernel_id)
        if agent is not None:
            agent.notify("state", state=state, restore_mode=self.restore_mode)

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
            if st.held:
                host += st.released_bytes
                metrics.KERNEL_HOST_BYTES.labels(st.kernel_id).set(st.released_bytes)
            else:
                metrics.forget_kernel(st.kernel_id)
        for state in (ACTIVE, IDLE, RELEASING, RELEASED, RESTORING, FAILED, UNTRACKED):
            metrics.KERNELS.labels(state).set(counts.get(state, 0))
        metrics.HOST_BYTES.set(host)


def target_bytes(target: KernelTarget) -> int:
    return sum(target.gpu_bytes.values())


class _Shower:
    """Shows one transient progress line in the output of the cell that triggered a restore."""

    def __init__(self, agent: Any, parent: dict | None):
        self.agent = agent
        self.parent = parent
        self.display_id = f"gpushare-{time.monotonic_ns()}"

    async def __call__(self, text: str) -> None:
        if self.agent is None or not self.parent:
            return
        try:
            await self.agent.request("show", timeout=5, parent=self.parent,
                                     display_id=self.display_id, text=text)
        except Exception as e:  # progress is a courtesy; never fail a restore over it
            log.warning("gpushare: could not show progress: %s", e)
