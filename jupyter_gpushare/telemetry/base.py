"""The one interface every source of GPU numbers implements.

Implementations must not touch hardware at import time: everything happens in
``open()`` (called once by the app) and the sampling methods.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field


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

    A new source is a subclass in its own module plus one line in
    ``jupyter_gpushare.telemetry.BACKENDS`` (then ``c.GPUShareApp.backend = "its name"``), or
    any subclass named in ``c.GPUShareApp.telemetry_class``. Required: the abstract methods
    below. Optional: :meth:`create` (how the server builds it), :meth:`foreign_pids`.
    """

    #: the backend's name in the REST API and the logs ("nvml", "simulated")
    name: str = ""
    #: how a person names the source in messages ("NVML"); default: ``name``
    label: str = ""

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
