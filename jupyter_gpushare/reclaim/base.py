"""One interface for the ways GPU memory leaves the GPU and comes back.

The contract every method keeps (the controller relies on it, and tests check it):

- ``release`` moves the kernel's GPU state to host memory. When it fails it raises
  :class:`ReclaimError` and says whether it *confirmed* that the kernel runs as before
  (``resident=True``: nothing left the GPU, or the undo completed). Undo is reported, never
  assumed: when the method cannot confirm it (a timeout, a lost connection, an undo that
  failed), it raises with ``resident=False`` and the controller keeps the state held.
- ``restore`` brings the kernel back to running with its whole state on the GPU **from any
  point** a release or an earlier restore may have left it (locked, checkpointed, partly
  moved, or already running): it reads where the kernel is and finishes the job, so a
  restore is always the way back. It raises :class:`ReclaimError` when it cannot; the state
  is then still held (``retryable`` says whether trying again can help). A restore that
  finds too little free memory right before it would move anything refuses with
  ``no_room`` set: nothing moved, so the controller waits for room again.
- A restore given ``KernelTarget.gpu_mapping`` brings the state back onto those GPUs instead,
  or, when the method cannot (:meth:`ReclaimMethod.move_refusal`) or the mapping cannot be
  honoured, raises :class:`ReclaimError` before anything moved (retryable, the state stays
  held). A release's undo never moves.
- Every call a method makes to a driver or an agent is bounded in time: a hung call ends in
  an error with the reason, never in a hung operation.

Methods are driven only by the controller, which guarantees one operation per kernel at a
time and reserves room on the GPU before calling ``restore``.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import RemoteError


class ReclaimError(Exception):
    """A release or restore failed. ``str()`` says why, for a person.

    ``resident``: the method confirmed that the kernel runs with all of its GPU state on the
    GPU (only a failed release can say so). ``retryable``: a later restore may succeed
    (False when the state is known to be lost or wedged, e.g. the driver's failed state).
    ``unfit``: why this method cannot free this kernel's memory (its release would leave it
    on the GPU), in a few words; the server then picks another method for the kernel where
    it can ("" = the method may work next time).
    ``no_room``: a restore's own room check, read right before its first driver or kernel
    call, found less free memory than it needs (another process took it since the
    controller granted the room), in a few words ("GPU 0 has 512 MiB free, 1.0 GiB
    needed"); set only when nothing moved, never by a rollback or after any byte moved.
    The controller then waits for room again instead of failing ("" = not so).
    """

    def __init__(self, message: str, *, resident: bool = False, retryable: bool = True,
                 unfit: str = "", no_room: str = ""):
        super().__init__(message)
        self.resident = resident
        self.retryable = retryable
        self.unfit = unfit
        self.no_room = no_room


class AgentLink(Protocol):
    """The server's handle on one kernel's in-kernel agent (see ``channel``)."""

    async def request(self, op: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send ``op`` to the agent and return its reply (raises on error reply / timeout)."""
        ...


@dataclass
class KernelTarget:
    """What a method needs to know about the kernel it acts on."""

    kernel_id: str
    pids: list[int]  # the kernel's local pids that hold GPU memory (CUDA contexts)
    gpu_bytes: dict[int, int]  # bytes per GPU index: held now (release) or when released (restore)
    agent: AgentLink | None = None  # None when the kernel has no agent (e.g. R, Julia)
    #: pid -> GPU -> bytes, where measured per process: makes a partial restore's room exact
    pid_bytes: dict[int, dict[int, int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # what a method of another package needs
    #: restore only: node GPU released from -> node GPU to restore onto, naming only the GPUs
    #: that move (e.g. {0: 1}); empty = back where it was. The method completes it as its
    #: mechanism needs.
    gpu_mapping: dict[int, int] = field(default_factory=dict)


@dataclass
class ReclaimResult:
    bytes: int  # bytes moved off (release) or back onto (restore) the GPU
    seconds: float
    detail: str = ""  # e.g. "2 pids checkpointed", "3 tensors could not be moved"


@dataclass
class Support:
    ok: bool
    reason: str  # why (not) usable, for doctor and logs


#: progress callback: a one-line human message, e.g. "restoring 4.0 GiB to GPU 1"
Progress = Callable[[str], Awaitable[None] | None]


async def say(progress: Progress | None, text: str) -> None:
    """Report progress, if anyone listens."""
    if progress is not None:
        out = progress(text)
        if inspect.isawaitable(out):
            await out


#: what a request to the kernel's agent raises when it did not get its answer
#: (Python 3.10's asyncio.TimeoutError is not yet the built-in one)
AGENT_ERRORS = (RemoteError, ConnectionError, TimeoutError, asyncio.TimeoutError)


def agent_failure(e: BaseException) -> str:
    """Why a request to the agent failed, for a person."""
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "the kernel did not answer in time"
    return str(e) or type(e).__name__


def require_agent(target: KernelTarget, missing: str) -> AgentLink:
    """The kernel's agent, for methods that act through it; ``missing``: why there is none,
    as the person reads it (nothing moved, so the kernel stays as it is)."""
    if target.agent is None:
        raise ReclaimError(missing, resident=True)
    return target.agent


def gpu_moves(target: KernelTarget, refusal: str | None) -> dict[int, int]:
    """The moves ``target.gpu_mapping`` asks for, checked (pairs ``{g: g}`` dropped).

    Raises :class:`ReclaimError` (retryable: the state stays held, nothing moved) when there
    are moves and ``refusal`` (the method's :meth:`ReclaimMethod.move_refusal`) says why it
    cannot make them, or when the mapping cannot be honoured: not GPU indices, two GPUs onto
    one, or onto a GPU that holds this kernel's memory and does not move itself (a process's
    devices stay distinct GPUs, as CUDA's do)."""
    mapping = target.gpu_mapping or {}
    for src, dst in mapping.items():
        for gpu in (src, dst):
            if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
                raise ReclaimError(f"cannot restore onto other GPUs: {gpu!r} is not a GPU index")
    moves = {src: dst for src, dst in mapping.items() if src != dst}
    if not moves:
        return {}
    if refusal is not None:
        raise ReclaimError(refusal)
    onto: dict[int, int] = {}
    for src, dst in sorted(moves.items()):
        if dst in onto:
            raise ReclaimError(f"cannot restore GPUs {onto[dst]} and {src} both onto GPU {dst}")
        onto[dst] = src
    held = {g for g, b in target.gpu_bytes.items() if b} | {
        g for per_gpu in target.pid_bytes.values() for g, b in per_gpu.items() if b}
    for dst, src in sorted(onto.items()):
        if dst in held and dst not in moves:
            raise ReclaimError(f"cannot restore GPU {src} onto GPU {dst}: this kernel's memory "
                               f"on GPU {dst} does not move, and two of its GPUs cannot become one")
    return moves


def reply_int(reply: dict[str, Any], key: str, default: int = 0) -> int:
    """An integer field of an agent's reply; a wrong type is the agent's error, said so."""
    value = reply.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReclaimError(f"the kernel agent answered {key}={value!r}, not a byte count")
    return value


@dataclass(frozen=True)
class MethodContext:
    """What the server offers a method when it creates one (:meth:`ReclaimMethod.create`)."""

    #: free memory of a GPU read now, None = unknown (blocking: call it off the event loop)
    free_bytes: Callable[[int], int | None] = lambda gpu: None
    #: seconds a release waits for the kernel's running GPU work before giving up
    lock_timeout: float = 10.0
    #: a look at NVML the caller already took (``telemetry.nvml.NVMLProbe``), or None
    probe: Any = None
    #: node GPU index -> UUID of every GPU the driver sees, read now (blocking), or None
    #: (unknown: a method that needs UUIDs reads them itself)
    gpu_uuids: Callable[[], dict[int, str]] | None = None


class ReclaimMethod(abc.ABC):
    """Base class of ``driver``, ``framework`` and ``simulated``.

    A new method is a subclass in its own module, registered as a
    ``jupyter_gpushare.release_methods`` entry point of its package (built-ins: one line in
    ``jupyter_gpushare.reclaim.METHODS``); the class attributes below tell the server when it
    applies, and ``c.GPUShareApp.release_method`` takes its ``name``.

    Hooks a method may override: :meth:`create` (take the server's settings) and
    :meth:`move_refusal` (whether a restore can bring the state back onto other GPUs than it
    was released from: ``KernelTarget.gpu_mapping``; default: it cannot).
    """

    name: str = ""
    #: needs the kernel's agent (the kernel was started by this server with the agent loaded)
    needs_agent: bool = False
    #: the kernel can run CPU-only cells while released (lazy restore): GPU calls just wait
    supports_lazy: bool = False
    #: acts on the simulated GPU node (backend "simulated") rather than on real GPUs
    simulated: bool = False
    #: release_method "auto" takes the supported method of the highest rank
    auto_rank: int = 0
    #: a release copies only what has no current host copy kept by the kernel's agent (its
    #: report's ``to_copy_bytes``), so the host memory check asks for no more; False: it
    #: copies the whole GPU state (the driver's checkpoint)
    uses_kept_copies: bool = False

    @classmethod
    def create(cls, context: MethodContext) -> ReclaimMethod:
        """The instance the server uses. Default: ``cls()``; override to take settings."""
        return cls()

    def move_refusal(self) -> str | None:
        """None when a restore can honour ``KernelTarget.gpu_mapping`` (restore onto other
        GPUs), else why not, for a person. Cheap after its first call (callers may ask often).

        A method that returns None completes the mapping as its mechanism needs and refuses
        one it cannot honour with :class:`ReclaimError` before anything moved (see
        :func:`gpu_moves`)."""
        return f"the {self.name} method cannot restore onto another GPU"

    @abc.abstractmethod
    def support(self) -> Support:
        """Whether this method can work on this machine (cheap; cached by callers)."""

    @abc.abstractmethod
    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        """Move the kernel's GPU state to host memory and free the GPU memory."""

    @abc.abstractmethod
    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        """Bring the state back onto the GPU(s) it came from, or those ``target.gpu_mapping``
        names, and let the kernel run."""
