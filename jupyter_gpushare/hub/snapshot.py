"""One user server's ``/api/gpushare/status``, read leniently and checked.

The service talks to servers it does not control (another version of gpushare, a server
that answers garbage): every field it uses is type-checked here, unknown fields are
ignored, and anything wrong raises ``ValueError`` with what was wrong, so that server is
shown with its error and never acted on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_KERNELS = 10_000
MAX_PIDS = 64  # per kernel: the kernel and its children


@dataclass
class GPUSnap:
    index: int
    uuid: str
    name: str
    total: int | None
    used: int | None
    utilization: float | None
    released_bytes: int
    #: what the server's kernels will still bring onto it, each once (None: a server before
    #: the field; the service then counts released_bytes and waiting restores' needs)
    returning_bytes: int | None = None
    #: of those, what its restores in flight reserved and has not landed yet (None: a server
    #: before the field; the service then counts none)
    restoring_bytes: int | None = None
    #: what its kernels placed there and not using it yet are expected to allocate (None: a
    #: server before the field; the service then tells others nothing of its placements)
    placed_bytes: int | None = None


@dataclass
class KernelSnap:
    id: str
    path: str
    state: str
    pinned: bool
    gpu_bytes: dict[int, int]  # by this server's GPU index
    idle_seconds: float
    busy: bool
    utilization: float
    releasable: bool
    idle_timeout: float
    released_bytes: int
    released_gpus: list[int]
    waiting: str | None
    restore_need: dict[int, int]
    method: str | None
    error: str | None
    restores: int = 0
    last_restore_seconds: float | None = None
    pids: list[int] = field(default_factory=list)  # the kernel's processes, as its server says
    memory_cap: int | None = None  # its memory cap per GPU (None: none, or an older server)
    over_cap: str | None = None  # "holds 9.1 GiB of its 8 GiB cap on GPU 0", as its server says


@dataclass
class Snapshot:
    """What one server said, when."""

    at: float  # service clock
    backend: str
    server_idle_timeout: float
    node: str = ""  # the machine its GPUs are in, as the server names it ("": not said)
    gpus: list[GPUSnap] = field(default_factory=list)
    kernels: list[KernelSnap] = field(default_factory=list)

    def uuid_of(self, index: int) -> str | None:
        for g in self.gpus:
            if g.index == index:
                return g.uuid
        return None


def _get(obj: dict[str, Any], key: str, kinds: type | tuple[type, ...], nullable: bool = False) -> Any:
    value = obj.get(key)
    if value is None and nullable:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ValueError(f"{key} must not be a boolean")
    if not isinstance(value, kinds):
        raise ValueError(f"{key} has the wrong type ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} is not finite")
    return value


def _count(obj: dict[str, Any], key: str, nullable: bool = False) -> int | None:
    value = _get(obj, key, int, nullable)
    if value is not None and value < 0:
        raise ValueError(f"{key} is negative")
    return value


def _per_gpu(obj: dict[str, Any], key: str) -> dict[int, int]:
    raw = _get(obj, key, dict)
    out = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not k.lstrip("-").isdigit():
            raise ValueError(f"{key} has a key that is not a GPU index: {k!r}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{key}[{k}] is not a byte count")
        out[int(k)] = v
    return out


def parse_status(raw: bytes, at: float) -> Snapshot:
    """A server's status body -> Snapshot; ValueError says what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise ValueError("the status is not JSON") from None
    if not isinstance(body, dict):
        raise ValueError("the status is not a JSON object")
    snap = Snapshot(at, str(_get(body, "backend", str))[:40],
                    float(_get(body, "idle_timeout", (int, float))),
                    node=(_get(body, "node", str, nullable=True) or "")[:100])
    for g in _get(body, "gpus", list):
        if not isinstance(g, dict):
            raise ValueError("a GPU is not an object")
        util = _get(g, "utilization", (int, float), nullable=True)
        snap.gpus.append(GPUSnap(
            index=_count(g, "index") or 0, uuid=_get(g, "uuid", str)[:100], name=_get(g, "name", str)[:100],
            total=_count(g, "memory_total", nullable=True), used=_count(g, "memory_used", nullable=True),
            utilization=None if util is None else float(util), released_bytes=_count(g, "released_bytes") or 0,
            returning_bytes=_count(g, "returning_bytes", nullable=True),
            restoring_bytes=_count(g, "restoring_bytes", nullable=True),
            placed_bytes=_count(g, "placed_bytes", nullable=True)))
    kernels = _get(body, "kernels", list)
    if len(kernels) > MAX_KERNELS:
        raise ValueError(f"{len(kernels)} kernels: more than {MAX_KERNELS}")
    for k in kernels:
        if not isinstance(k, dict):
            raise ValueError("a kernel is not an object")
        util = _get(k, "sm_utilization", (int, float), nullable=True)
        idle = _get(k, "idle_seconds", (int, float), nullable=True)
        method = _get(k, "method", str, nullable=True)
        blocked = _get(k, "release_blocked", str, nullable=True)
        need = _per_gpu(k, "restore_need") if "restore_need" in k else {}
        pids = _get(k, "pids", list, nullable=True) or []
        snap.kernels.append(KernelSnap(
            id=_get(k, "id", str)[:100], path=_get(k, "path", str)[:300], state=_get(k, "state", str)[:20],
            pinned=_get(k, "pinned", bool), gpu_bytes=_per_gpu(k, "gpu_bytes"),
            idle_seconds=float(idle or 0.0), busy=_get(k, "execution_state", str) == "busy",
            utilization=float(util or 0.0), releasable=method is not None and blocked is None,
            idle_timeout=float(_get(k, "idle_timeout", (int, float))),
            released_bytes=_count(k, "released_bytes") or 0,
            released_gpus=[g for g in _get(k, "gpus", list) if isinstance(g, int)],
            waiting=_get(k, "waiting", str, nullable=True), restore_need=need, method=method,
            error=_get(k, "error", str, nullable=True), restores=_count(k, "restores") or 0,
            last_restore_seconds=_get(k, "last_restore_seconds", (int, float), nullable=True),
            pids=[p for p in pids[:MAX_PIDS] if isinstance(p, int) and not isinstance(p, bool) and p > 0],
            memory_cap=_count(k, "memory_cap", nullable=True),
            over_cap=(_get(k, "over_cap", str, nullable=True) or "")[:200] or None))
    return snap
