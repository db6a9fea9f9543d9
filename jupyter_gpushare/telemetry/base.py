"""The one interface every source of GPU numbers implements.

Implementations must not touch hardware at import time: everything happens in
``open()`` (called once by the app) and the sampling methods.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: a request handler of the agent channel: ``(connection, message) -> reply fields`` (a dict,
#: None, or an awaitable of either); raising ValueError / RuntimeError / LookupError answers the
#: agent with that error (see ``jupyter_gpushare.server.channel``)
AgentHandler = Callable[[Any, dict[str, Any]], Any]


@dataclass
class GPUInfo:
    """One GPU (or MIG instance) as the server shows it.

    Fields that the source cannot read are ``None`` ("unavailable"), never an error.
    """

    index: int
    uuid: str
    name: str
    memory_total: int | None  # bytes
    memory_used: int | None  # bytes
    utilization: float | None  # percent SM busy over the last sample period
    mig: bool = False
    parent_index: int | None = None  # for MIG instances: the physical GPU


@dataclass
class ProcessUsage:
    """GPU use of one OS process on one GPU."""

    pid: int
    gpu: int  # GPUInfo.index
    memory_bytes: int
    sm_utilization: float | None = None  # percent, since the previous sample; None = unknown


@dataclass
class TelemetryStatus:
    """What `doctor` and the status API say about a source."""

    name: str
    available: bool
    reason: str = ""  # why not available / what degraded
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TelemetrySettings:
    """What the server hands a source when it creates one (:meth:`Telemetry.create`)."""

    simulated_gpus: tuple[int, ...] = ()  # bytes per GPU of the simulated node
    simulated_node: str = ""  # the file a node shared by several servers lives in; "" = private


class Telemetry(abc.ABC):
    """A source of device and per-process GPU numbers.

    A new source is a subclass in its own module, registered by its package under the entry
    point group ``jupyter_gpushare.telemetry_backends`` (``name = "module:Class"``; then
    ``c.GPUShareApp.backend = "name"``), or any subclass named in
    ``c.GPUShareApp.telemetry_class``. Required: the abstract methods below. Optional:
    :meth:`create` (how the server builds it), :meth:`foreign_pids`, and the server hooks
    (:attr:`simulated`, :meth:`agent_handlers`, :meth:`agent_gone`, :meth:`hello_extra`,
    :meth:`launch_env`, :meth:`context_bytes`, :meth:`total_bytes`,
    :meth:`shares_node_locks`), whose defaults are those of a real GPU node.
    """

    #: the backend's name in the REST API and the logs ("nvml", "simulated")
    name: str = ""
    #: how a person names the source in messages ("NVML"); default: ``name``
    label: str = ""
    #: its GPUs are simulated: the release methods that act on it are those whose
    #: ``ReclaimMethod.simulated`` is True (and only those)
    simulated: bool = False

    @classmethod
    def create(cls, settings: TelemetrySettings) -> Telemetry:
        """The source the server uses. Default: ``cls()``; override to take settings."""
        return cls()

    @abc.abstractmethod
    def open(self) -> TelemetryStatus:
        """Connect to the source (init NVML, ...). Never raises: returns status."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the source (nvmlShutdown, ...). Safe to call twice."""

    @abc.abstractmethod
    def status(self) -> TelemetryStatus:
        """Current availability and degradations."""

    @abc.abstractmethod
    def devices(self) -> list[GPUInfo]:
        """All GPUs (MIG instances listed as their own GPUs). Empty when unavailable."""

    @abc.abstractmethod
    def free_bytes(self, index: int) -> int | None:
        """Free memory of GPU ``index`` read now (not from the last sample); None = unknown.

        A restore is started only when this says there is room, so it must be fresh; a
        source that cannot tell returns None and restores wait (never guess)."""

    @abc.abstractmethod
    def processes(self) -> list[ProcessUsage]:
        """Per-process memory on every GPU, and SM utilization since the previous call.

        Calls that fail with NotFound / NotSupported degrade to ``None`` utilization
        or an empty list; they never raise.
        """

    def foreign_pids(self, pids: Iterable[int]) -> set[int]:
        """Of ``pids`` (reported by :meth:`processes`), those that do not exist in this
        process's pid namespace: the server runs in a container that does not see the
        processes the source counts, so kernels are matched by their agents' own reports.
        Default: none (the source reports only processes it can see)."""
        return set()

    # -- server hooks: what the server asks of its source beyond numbers ------------------------
    # Each default is what a real GPU node needs; the simulated backend overrides them. They
    # are called after open(), from the event loop: keep them cheap.

    def agent_handlers(self) -> Mapping[str, AgentHandler]:
        """Extra requests the kernels' agents may send on the agent channel, by op name (the
        simulated node: its GPUs' allocations). The server's own ops keep their names.
        Default: none."""
        return {}

    def agent_gone(self, pid: int) -> None:
        """The agent of the kernel process ``pid`` disconnected (not replaced by a newer
        connection of the same kernel). Default: nothing."""
        return None

    def hello_extra(self) -> dict[str, Any]:
        """Fields every kernel's agent is told when it connects, in the hello reply (the
        simulated node: ``simulated_gpus``, its GPUs' sizes). Default: none."""
        return {}

    def launch_env(self) -> dict[str, str]:
        """Environment variables set in every kernel the gpushare provisioner starts, over
        whatever the kernel's environment has. Default: none."""
        return {}

    def context_bytes(self, configured: int) -> int:
        """GPU bytes one CUDA context takes on these GPUs (``configured``:
        ``GPUShareApp.context_bytes``). Default: ``configured``."""
        return configured

    def total_bytes(self) -> dict[int, int] | None:
        """Memory of each GPU by index when the source knows it without a sample; None: the
        server reads it from the last sample (``GPUInfo.memory_total``). Default: None."""
        return None

    def shares_node_locks(self) -> bool:
        """Whether other servers on this machine may use the same GPUs, so that restores take
        turns with theirs through lock files (``GPUShareApp.node_lock_dir``). Default: True."""
        return True


class UnavailableTelemetry(Telemetry):
    """A backend that cannot be used here, e.g. a plug-in whose module fails to import: no
    GPUs, and its status says why (as NVML on a machine without a driver). The server runs
    with it, tracking nothing, so the reason shows in the status API and the log."""

    reason: str = "unavailable"

    @classmethod
    def failed(cls, name: str, reason: str) -> type[UnavailableTelemetry]:
        """A subclass that stands for backend ``name``, unavailable because of ``reason``."""
        return type(f"Unavailable_{name}", (cls,), {"name": name, "reason": reason})

    def open(self) -> TelemetryStatus:
        return self.status()

    def close(self) -> None:
        return None

    def status(self) -> TelemetryStatus:
        return TelemetryStatus(self.name, False, self.reason)

    def devices(self) -> list[GPUInfo]:
        return []

    def free_bytes(self, index: int) -> int | None:
        return None

    def processes(self) -> list[ProcessUsage]:
        return []
