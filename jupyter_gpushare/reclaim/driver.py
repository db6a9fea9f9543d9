"""Release and restore through the CUDA driver checkpoint API (``cuda.core.checkpoint.Process``).

Framework-agnostic: the driver copies every allocation of the process (CUDA context included)
to host memory and frees the GPU, then brings it back at the same addresses. It works for any
kernel language and for code we cannot see. Package cuda-core is an optional extra
(``jupyter-gpushare[checkpoint]``) imported only when the method is first used.

Order of operations and why:

- release: ask the kernel agent to ``trim`` (empty framework caches, so less is copied), then
  **lock every pid, then checkpoint every pid**. Locking all first stops the kernel's
  processes at one moment, and the likeliest failure (a lock timeout: the kernel is busy on the
  GPU) is found before any memory has moved, so undoing it is only unlocks.
- restore: check free memory on every GPU first; then per pid restore and unlock. A restore
  that fails for lack of memory wedges the process for good (a known limit of the CUDA
  checkpoint API: https://github.com/NVIDIA/cuda-checkpoint/issues/44), so
  the method refuses when free memory is short *or unknown* and never calls restore blind.
  Short (another process took the room the controller granted) is said with
  ``ReclaimError.no_room``: nothing moved, and the controller waits for room again.
- Each step reads the driver's state of the pid first, so repeating an operation after a
  partial failure finishes the job instead of failing on an illegal state: ``restore`` is
  also the way back from a release that failed half-way.
- Every driver call runs in a worker thread with a time limit. A call that does not return
  in time ends the operation with the reason (the kernel's state stays held, and the next
  restore reads where the driver left it); it never holds the kernel's operation forever.

``KernelTarget.gpu_bytes`` on restore must be what the kernel held when it was released (the
controller keeps it): the GPU holds nothing of it while released. Optional
``target.pid_bytes = {pid: {gpu: bytes}}`` makes the room check per pid exact and the
progress lines show sizes per pid. The room rule is :mod:`..policy.room`'s, the controller's too
(``margin_bytes`` is 0 in the server: the controller reserves a context's margin itself).

Restoring onto other GPUs (``KernelTarget.gpu_mapping``, driver 580+): the driver wants a GPU
UUID pair for every GPU it sees, each onto a distinct one, so the given moves are completed to
a permutation (:func:`complete_mapping`), and room is checked on the GPUs the memory lands on.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..policy import room
from ..units import format_bytes
from .base import (
    KernelTarget,
    MethodContext,
    Progress,
    ReclaimError,
    ReclaimMethod,
    ReclaimResult,
    Support,
    gpu_moves,
    say,
)

_LOG = logging.getLogger("jupyter_gpushare.reclaim.driver")

_size = functools.partial(format_bytes, whole_below_gib=True)  # "512 MiB", "4.0 GiB"

#: first display driver with the CUDA checkpoint driver API (cuCheckpointProcess*)
MIN_DRIVER = 570
#: first display driver that restores onto another GPU (gpu_mapping)
MIN_DRIVER_MIGRATE = 580


def _bindings_version_ok(version: str) -> tuple[bool, str]:
    """cuda-bindings 12.8+ or 13.0.2+ (13.0.0 and 13.0.1 lack restore), per cuda-core."""
    try:
        parts = tuple(int(x) for x in version.split(".")[:3])
    except ValueError:
        return True, ""  # a dev build: let cuda-core decide at first use
    parts = (*parts, 0, 0)[:3]
    major, minor, patch = parts
    if (major == 12 and (minor, patch) >= (8, 0)) or (major == 13 and (minor, patch) >= (0, 2)):
        return True, ""
    if major > 13:
        return True, ""
    return False, f"cuda-bindings {version} lacks the checkpoint API (needs 12.8+ or 13.0.2+)"


def driver_support(probe_result: Any = None) -> Support:
    """Whether the driver method can work here, and why (not). Cheap; never raises.

    Checks: cuda-core's ``checkpoint.Process`` importable with a cuda-bindings that has the
    API; NVML reachable with a display driver >= 570; no GPU in MIG mode (checkpoint fails
    under MIG). ``probe_result`` (a :class:`~jupyter_gpushare.telemetry.nvml.NVMLProbe`) lets a
    caller that already probed NVML avoid a second look.
    """
    try:
        mod = importlib.import_module("cuda.core.checkpoint")
        if not hasattr(mod, "Process"):
            return Support(False, "cuda.core has no checkpoint.Process (cuda-core is too old)")
    except Exception as e:  # ImportError, or cuda-bindings failing to load its library
        return Support(
            False,
            f"cuda-core with the checkpoint API is not importable ({e.__class__.__name__}: {e}); "
            "install jupyter-gpushare[checkpoint]",
        )
    try:
        bindings = importlib.import_module("cuda.bindings")
        ok, why = _bindings_version_ok(str(getattr(bindings, "__version__", "")))
        if not ok:
            return Support(False, why)
    except Exception as e:
        return Support(False, f"cuda-bindings is not importable ({e})")

    if probe_result is None:
        from ..telemetry.nvml import probe

        probe_result = probe()
    if not probe_result.ok:
        return Support(False, f"NVML unavailable: {probe_result.reason}")
    from ..telemetry.nvml import driver_major

    major = driver_major(probe_result.driver_version)
    if major is None:
        return Support(False, "cannot read the NVIDIA driver version")
    if major < MIN_DRIVER:
        return Support(
            False,
            f"driver {probe_result.driver_version} is older than {MIN_DRIVER}, "
            "the first with the CUDA checkpoint API",
        )
    if probe_result.mig_gpus:
        gpus = ", ".join(str(i) for i in probe_result.mig_gpus)
        return Support(False, f"MIG is enabled on GPU {gpus}: CUDA checkpoint does not work under MIG")
    extra = "" if major >= MIN_DRIVER_MIGRATE else f" (restoring onto another GPU needs {MIN_DRIVER_MIGRATE})"
    return Support(True, f"CUDA checkpoint API available, driver {probe_result.driver_version}{extra}")


_HEX32 = re.compile(r"[0-9a-fA-F]{32}")


def checkpoint_uuid(text: Any) -> str | None:
    """A GPU UUID as cuda-core's ``gpu_mapping`` takes it: NVML's without its "GPU-" prefix
    (32 hex digits, hyphens allowed); None when ``text`` is not one (a MIG UUID, "")."""
    if not isinstance(text, str):
        return None
    bare = text[4:] if text[:4].upper() == "GPU-" else text
    return bare if _HEX32.fullmatch(bare.replace("-", "")) else None


def complete_mapping(moves: dict[int, int], gpus: Iterable[int]) -> dict[int, int]:
    """``moves`` ({from: to}, distinct targets) completed to a permutation of ``gpus``, as the
    driver needs it: a GPU not named stays, except one that a moved GPU takes, which goes to
    where its chain of moves starts ({0: 1} -> {0: 1, 1: 0}; {0: 1, 1: 2} -> ... 2: 0)."""
    perm = {g: g for g in gpus}
    perm.update(moves)
    targets = set(moves.values())
    for start in moves:
        if start in targets:
            continue  # inside a chain or a cycle: closed from its start
        end = start
        while end in moves:
            end = moves[end]
        perm[end] = start
    return perm


def _explain(e: BaseException) -> str:
    """The driver's message, with a hint where cuda-core's wording misleads."""
    text = str(e) or e.__class__.__name__
    if "not supported by the installed NVIDIA driver" in text:
        # cuda-core maps CUDA_ERROR_NOT_FOUND and CUDA_ERROR_NOT_SUPPORTED to this sentence
        text += (
            " (cuda-core words NOT_FOUND/NOT_SUPPORTED this way: the pid may have no CUDA "
            "context, have exited, or hold memory checkpoint cannot move, e.g. UVM or IPC)"
        )
    return text


def _real_process_factory() -> Callable[[int], Any]:
    """``cuda.core.checkpoint.Process``, with the driver initialised in this process.

    The driver docs: restore needs persistence mode or ``cuInit`` in the calling process,
    else every call returns CUDA_ERROR_NOT_INITIALIZED. ``cuInit`` creates no context and
    takes no GPU memory.
    """
    from cuda.bindings import driver as cu
    from cuda.core.checkpoint import Process

    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ReclaimError(f"cuInit failed in the server process: {err}")
    return Process


class _Hung(Exception):
    """A driver call that did not return within its time limit."""


class DriverMethod(ReclaimMethod):
    """Checkpoint a kernel's CUDA processes through the driver and restore them."""

    name = "driver"
    supports_lazy = True  # a checkpointed process runs its CPU code; CUDA calls wait
    auto_rank = 2  # frees the CUDA context too and works for any framework: first choice

    def __init__(
        self,
        free_bytes: Callable[[int], int | None],
        lock_timeout_ms: int = 10_000,
        process_factory: Callable[[int], Any] | None = None,
        log: logging.Logger | None = None,
        margin_bytes: int = 0,
        call_timeout: float = 600.0,
        probe: Any = None,
        gpu_uuids: Callable[[], dict[int, str]] | None = None,
    ) -> None:
        """
        free_bytes: free memory on a GPU index, read now; None = unknown (restore refuses).
        lock_timeout_ms: how long a lock waits for the kernel's in-flight CUDA work (0 = forever).
        process_factory: pid -> object with the ``cuda.core.checkpoint.Process`` surface
            (tests inject a fake); default: the real class, loaded on first use.
        margin_bytes: extra free memory required on each GPU beyond what the kernel held.
        call_timeout: seconds a checkpoint, restore or unlock call may take before the
            operation gives up on it (a lock gets its own timeout plus 10 s).
        probe: an NVML probe already taken, so ``support()`` does not take another.
        gpu_uuids: node GPU index -> UUID of every GPU the driver sees (blocking), for a
            restore onto other GPUs; default: the GPUs of an NVML probe.
        """
        self.free_bytes = free_bytes
        self.lock_timeout_ms = lock_timeout_ms
        self._factory = process_factory
        self.log = log or _LOG
        self.margin_bytes = margin_bytes
        self.call_timeout = call_timeout
        self._probe = probe
        self.gpu_uuids = gpu_uuids
        self._refusal: list[str | None] = []  # move_refusal's answer, once known

    @classmethod
    def create(cls, context: MethodContext) -> DriverMethod:
        return cls(free_bytes=context.free_bytes, lock_timeout_ms=int(context.lock_timeout * 1000),
                   probe=context.probe, gpu_uuids=context.gpu_uuids)

    def support(self) -> Support:
        found = driver_support(self._probe)
        if found.ok:
            self.move_refusal()  # read now, so the server's later asks never block on NVML
        return found

    def _nvml(self) -> Any:
        """The NVML probe given, else one taken now and kept once it worked (the driver's
        version and the GPUs' UUIDs do not change while the server runs). Blocking."""
        if getattr(self._probe, "ok", False):
            return self._probe
        from ..telemetry.nvml import probe

        look = probe()
        if look.ok:
            self._probe = look
        return look

    def move_refusal(self) -> str | None:
        """None from driver 580 on (restore with GPU pairs), else why not. The first call
        reads NVML unless a probe was given (blocking); the answer is kept."""
        if not self._refusal:
            from ..telemetry.nvml import driver_major

            look = self._nvml()
            major = driver_major(look.driver_version) if look.ok else None
            if major is None:
                why = look.reason if not look.ok else "its version is unreadable"
                self._refusal.append(
                    f"restoring onto another GPU needs NVIDIA driver {MIN_DRIVER_MIGRATE} or newer, "
                    f"and the driver's version is not known ({why})")
            elif major < MIN_DRIVER_MIGRATE:
                self._refusal.append(
                    f"driver {look.driver_version} cannot restore onto another GPU (needs "
                    f"{MIN_DRIVER_MIGRATE} or newer)")
            else:
                self._refusal.append(None)
        return self._refusal[0]

    def _read_uuids(self) -> dict[int, str]:
        """Node GPU index -> UUID of every GPU the driver sees (blocking)."""
        if self.gpu_uuids is not None:
            return dict(self.gpu_uuids())
        look = self._nvml()
        if not look.ok:
            raise ReclaimError(f"NVML is unavailable: {look.reason}")
        return {g.index: g.uuid for g in look.gpus if not g.mig}

    async def _uuid_mapping(self, moves: dict[int, int]) -> tuple[dict[int, int], dict[str, str]]:
        """The moves completed to a permutation of every GPU the driver sees, by index and
        as cuda-core's ``gpu_mapping`` (UUID -> UUID); ReclaimError when it cannot be built."""
        why = "not restoring onto other GPUs"
        try:
            seen = await self._call("reading the GPUs' UUIDs", self._read_uuids, 30)
        except Exception as e:
            raise ReclaimError(f"{why}: cannot read the GPUs' UUIDs ({e})") from None
        uuids: dict[int, str] = {}
        for gpu, text in sorted(seen.items()):
            uuid = checkpoint_uuid(text)
            if uuid is None:  # the driver needs a pair for every GPU: one unknown is fatal
                raise ReclaimError(f"{why}: the UUID of GPU {gpu} is not known ({text!r})")
            uuids[gpu] = uuid
        unknown = sorted({*moves, *moves.values()} - uuids.keys())
        if unknown:
            raise ReclaimError(f"{why}: GPU {unknown[0]} is not one the driver sees "
                               f"(it sees {len(uuids)})")
        perm = complete_mapping(moves, uuids)
        return perm, {uuids[a]: uuids[b] for a, b in perm.items()}

    # -- helpers ------------------------------------------------------------------------
    def _process(self, pid: int) -> Any:
        if self._factory is None:
            try:
                self._factory = _real_process_factory()
            except ReclaimError:
                raise
            except Exception as e:
                raise ReclaimError(f"the CUDA checkpoint API is unavailable: {e}", resident=True) from e
        try:
            return self._factory(pid)
        except Exception as e:
            raise ReclaimError(f"pid {pid}: cannot open it for checkpointing: {e}", resident=True) from e

    async def _call(self, what: str, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run a blocking driver call in a worker thread, within a time limit."""
        limit = self.call_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn), limit)
        except asyncio.TimeoutError:
            raise _Hung(f"{what} did not return in {limit:g} s") from None

    def _lock_limit(self) -> float:
        return self.lock_timeout_ms / 1000 + 10 if self.lock_timeout_ms else self.call_timeout

    async def _state(self, proc: Any) -> str | None:
        """The driver's state of the pid, None when it cannot be read."""
        try:
            return str(await self._call("reading the checkpoint state", lambda: proc.state, 30))
        except Exception:
            return None

    @staticmethod
    def _pid_bytes(target: KernelTarget, pid: int) -> dict[int, int]:
        if pid in target.pid_bytes:
            return dict(target.pid_bytes[pid])
        if len(target.pids) == 1:
            return dict(target.gpu_bytes)
        return {}

    def _size(self, target: KernelTarget, pid: int) -> str:
        b = sum(self._pid_bytes(target, pid).values())
        return f" ({_size(b)})" if b else ""

    def _needed(self, target: KernelTarget, pids: list[int]) -> dict[int, int]:
        """Bytes the given pids need back per GPU (all of the kernel's when not known per pid)."""
        return room.of_processes(target.gpu_bytes, target.pid_bytes, pids)

    async def _room(self, need: dict[int, int]) -> str | None:
        """None when every GPU has room for ``need``; else why not (a person reads it)."""
        found = await self._lack(need)
        return found[0] if found else None

    async def _lack(self, need: dict[int, int]) -> tuple[str, bool] | None:
        """None when every GPU has room for ``need``; else why not, and whether only room
        was short (False: free memory or the GPU is not known)."""
        if any(gpu < 0 for gpu in need):
            return "the GPU this kernel's memory was on is not known, so a restore is not safe", False
        for gpu, b in sorted(need.items()):
            try:
                free = await self._call(f"reading free memory of GPU {gpu}",
                                        functools.partial(self.free_bytes, gpu), 30)
            except _Hung:
                free = None
            if free is None:
                return f"free memory on GPU {gpu} is unknown, so a restore is not safe", False
            if room.lacking({gpu: b}, {gpu: free}, self.margin_bytes):
                return f"GPU {gpu} has {_size(free)} free, {_size(b + self.margin_bytes)} needed", True
        return None

    # -- release ------------------------------------------------------------------------
    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        if not target.pids:
            raise ReclaimError("no local process of this kernel holds GPU memory", resident=True)
        t0 = time.perf_counter()
        procs = [(pid, self._process(pid)) for pid in target.pids]  # fails fast without cuda-core
        if target.agent is not None:
            await say(progress, "asking the kernel to trim its GPU caches")
            try:
                await target.agent.request("trim", timeout=30)
            except Exception as e:  # an optimisation only: checkpoint copes without it
                self.log.info("kernel %s: trim before checkpoint failed: %s", target.kernel_id, e)
        states = {pid: await self._state(p) for pid, p in procs}
        for pid in target.pids:
            if states[pid] == "failed":
                raise ReclaimError(
                    f"pid {pid} is in the driver's failed checkpoint state: its GPU state cannot "
                    "be brought back; restart the kernel", retryable=False)

        touched: list[tuple[int, Any]] = []
        step, pid = "lock", 0
        try:
            for pid, p in procs:
                if states[pid] in ("locked", "checkpointed"):
                    touched.append((pid, p))
                    continue
                await say(progress, f"locking pid {pid}")
                touched.append((pid, p))  # a lock that times out may still land: undo checks
                await self._call(f"lock of pid {pid}", functools.partial(p.lock, self.lock_timeout_ms),
                                 self._lock_limit())
            step = "checkpoint"
            for pid, p in procs:
                if states[pid] == "checkpointed":
                    continue
                await say(progress, f"checkpointing pid {pid}{self._size(target, pid)}")
                await self._call(f"checkpoint of pid {pid}", p.checkpoint)
        except Exception as e:
            msg = f"{step} of pid {pid} failed: {_explain(e)}"
            if step == "lock" and not isinstance(e, _Hung):
                msg += f" (timeout {self.lock_timeout_ms} ms: is the kernel busy on the GPU?)"
            undo, complete = await self._rollback(target, touched, progress)
            if isinstance(e, _Hung):  # the call may still land after the rollback looked
                complete, undo = False, "a driver call is still pending, so the state stays held"
            raise ReclaimError(f"{msg}; {undo}", resident=complete) from e

        total = sum(target.gpu_bytes.values())
        n = len(procs)
        return ReclaimResult(
            bytes=total,
            seconds=time.perf_counter() - t0,
            detail=f"{n} pid{'s' if n != 1 else ''} checkpointed",
        )

    async def _rollback(
        self, target: KernelTarget, touched: list[tuple[int, Any]], progress: Progress | None
    ) -> tuple[str, bool]:
        """Bring every pid we touched back to running, newest first.

        Returns what happened and whether every pid is confirmed running."""
        stuck: list[str] = []
        for pid, p in reversed(touched):
            state = await self._state(p)
            try:
                if state == "checkpointed":
                    why = await self._room(self._needed(target, [pid]))
                    if why:
                        stuck.append(f"pid {pid} stays checkpointed ({why})")
                        continue
                    await say(progress, f"rolling back: restoring pid {pid}")
                    await self._call(f"restore of pid {pid}", p.restore)
                    state = "locked"
                if state == "locked":
                    await self._call(f"unlock of pid {pid}", p.unlock, 30)
                elif state != "running":
                    stuck.append(f"pid {pid} is {state or 'in an unknown state'}")
            except Exception as e:
                stuck.append(f"pid {pid}: undo failed ({_explain(e)})")
        if not stuck:
            return "the kernel runs as before", True
        for line in stuck:
            self.log.error("kernel %s: rollback: %s", target.kernel_id, line)
        return "rollback incomplete: " + "; ".join(stuck) + " (the state stays held)", False

    # -- restore ------------------------------------------------------------------------
    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        t0 = time.perf_counter()
        procs = [(pid, self._process(pid)) for pid in target.pids]
        moves: dict[int, int] = {}
        if target.gpu_mapping:
            try:
                refusal = await self._call("reading the driver version", self.move_refusal, 30)
            except _Hung as e:
                refusal = f"cannot tell whether the driver restores onto another GPU ({e})"
            moves = gpu_moves(target, refusal)
        states = {pid: await self._state(p) for pid, p in procs}
        failed = [pid for pid, s in states.items() if s == "failed"]
        if failed:
            raise ReclaimError(
                f"pid {failed[0]} is in the driver's failed checkpoint state; it cannot be "
                "restored: restart the kernel", retryable=False)
        unknown = [pid for pid, s in states.items() if s is None]
        if unknown:
            raise ReclaimError(f"cannot read the checkpoint state of pid {unknown[0]}; the state "
                               "stays held")
        to_restore = [pid for pid in target.pids if states[pid] not in ("running", "locked")]
        need = self._needed(target, to_restore)
        perm: dict[int, int] = {}
        restore_args: dict[str, Any] = {}  # restore() without arguments: back where it was
        if moves:
            if not to_restore:
                raise ReclaimError("not restoring onto other GPUs: no process of this kernel is "
                                   "checkpointed, so nothing is left to move (restore it without "
                                   "a mapping)")
            perm, restore_args["gpu_mapping"] = await self._uuid_mapping(moves)
        landing: dict[int, int] = {}  # where the memory comes back
        for gpu, b in need.items():
            landing[perm.get(gpu, gpu)] = landing.get(perm.get(gpu, gpu), 0) + b
        lack = await self._lack(landing)
        if lack:  # nothing moved yet: a room taken meanwhile is waited for again (no_room)
            why, short = lack
            raise ReclaimError(f"not restoring: {why}; the state stays held in host memory",
                               no_room=why if short else "")

        for pid, p in procs:
            step = "restore"
            try:
                if pid in to_restore:
                    gpus = ", ".join(str(g) for g in sorted(
                        {perm.get(g, g) for g in self._pid_bytes(target, pid) or need}))
                    await say(progress, f"restoring pid {pid}{self._size(target, pid)} to GPU {gpus}")
                    await self._call(f"restore of pid {pid}",
                                     functools.partial(p.restore, **restore_args))
                if states[pid] != "running":
                    step = "unlock"
                    await self._call(f"unlock of pid {pid}", p.unlock, 30)
            except Exception as e:
                left = [q for q in to_restore if target.pids.index(q) > target.pids.index(pid)]
                held = "its GPU state is still held by the driver"
                if left:
                    held += f"; pids {', '.join(map(str, left))} stay checkpointed"
                raise ReclaimError(f"{step} of pid {pid} failed: {_explain(e)}; {held}") from e
        total = sum(need.values())
        return ReclaimResult(
            bytes=total,
            seconds=time.perf_counter() - t0,
            detail=f"{len(to_restore)} pid{'s' if len(to_restore) != 1 else ''} restored",
        )
