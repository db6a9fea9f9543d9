"""One interface for the ways GPU memory leaves the GPU and comes back.

A method never leaves a kernel worse than it found it: when ``release`` fails the
kernel keeps running resident (the method undoes what it did, e.g. unlocks), and
when ``restore`` fails the state is still held on the host. Either failure raises
:class:`ReclaimError` with a message a person can act on.

Methods are driven only by the controller, which guarantees one operation per
kernel at a time and checks for room on the GPU before calling ``restore``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class ReclaimError(Exception):
    """A release or restore failed; the kernel's state is intact. ``str()`` says why."""


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
    gpu_bytes: dict[int, int]  # bytes held per GPU index right now
    agent: AgentLink | None = None  # None when the kernel has no agent (e.g. R, Julia)
    extra: dict[str, Any] = field(default_factory=dict)


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


class ReclaimMethod(abc.ABC):
    """Base class of ``driver``, ``framework`` and ``simulated``."""

    name: str = ""

    @abc.abstractmethod
    def support(self) -> Support:
        """Whether this method can work on this machine (cheap; cached by callers)."""

    @abc.abstractmethod
    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        """Move the kernel's GPU state to host memory and free the GPU memory."""

    @abc.abstractmethod
    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        """Bring the state back onto the GPU(s) it came from and let the kernel run."""

    async def abort(self, target: KernelTarget) -> None:  # noqa: B027 - optional hook
        """Best effort at server shutdown: leave the kernel unlocked (resident if possible)."""
