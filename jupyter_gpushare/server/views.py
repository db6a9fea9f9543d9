"""The JSON shapes of the REST API (written down in openapi.yaml), built from tracker and
controller."""

from __future__ import annotations

import os
import socket
from typing import Any

from .. import clock
from ..core import ahead
from ..core.controller import Controller
from ..core.lifecycle import Lifecycle
from ..core.tracker import KernelRecord, Tracker
from ..node.gpu_load import coming_back
from ..node.placement import placed_gpus
from ..policy import caps


def kernel_view(controller: Controller, kernel_id: str) -> dict[str, Any]:
    rec: KernelRecord | None = controller.tracker.kernels.get(kernel_id)
    st: Lifecycle = controller.get(kernel_id)
    now = clock.now()
    return {
        "id": kernel_id,
        "name": rec.name if rec else "",
        "path": rec.path if rec else "",
        "pids": rec.pids if rec else [],
        "state": st.state,
        "pinned": st.pinned,
        "gpu_memory_bytes": rec.gpu_memory_bytes if rec else 0,
        "released_bytes": st.released_bytes,
        # where it holds or held memory, and where placement put it (before its first bytes)
        "gpus": sorted(set(rec.gpu_bytes if rec else ()) | set(st.released_gpus)
                       | set(placed_gpus(getattr(controller.tracker, "km", None), kernel_id))),
        "gpu_bytes": {str(g): b for g, b in (rec.gpu_bytes.items() if rec else ())},
        "sm_utilization": rec.sm_utilization if rec else None,
        "gpu_utilization": {str(g): u for g, u in (rec.gpu_utilization.items() if rec else ())},
        "idle_seconds": round(rec.idle_seconds(now), 1) if rec else None,
        "release_in_seconds": _round(controller.release_in(kernel_id)),
        "release_policy": controller.config.release_policy,
        "idle_timeout": controller.idle_timeout(st),
        # what holds the state, else what the next release would use (auto's pick changes)
        "method": st.held.method if st.held is not None else controller.method_for(kernel_id),
        "releases": st.releases,
        "restores": st.restores,
        "last_restore_seconds": _round(st.last_restore_seconds, 3),
        "last_release_seconds": _round(st.last_release_seconds, 3),
        "restored_onto": st.restored_onto,
        "moved": controller.rebalancer.moved(kernel_id),
        "error": st.error,
        "waiting": ahead.view_waiting(
            st, f"{st.waiting}; {st.waiting_note}" if st.waiting and st.waiting_note else st.waiting),
        "restore_need": {str(g): n for g, n in controller.restore_need(kernel_id).items()},
        "execution_state": rec.execution_state if rec else "unknown",
        "release_blocked": st.release_blocked,
        "release_detail": (st.held.detail or None) if st.held is not None else None,
        "host_room_bytes": _host_room(rec),
        # the kept host copy (framework and simulated methods): bytes it holds current, and
        # bytes a release would still copy (None: the kernel's agent did not say)
        "host_copy_bytes": rec.host_copy_bytes if rec else None,
        "to_copy_bytes": rec.to_copy_bytes if rec else None,
        # its memory cap (bytes per GPU, None: uncapped) and, when the node sees it hold more
        # on a GPU, "holds 9.1 GiB of its 8 GiB cap on GPU 0"
        "memory_cap": controller.memory_cap(st),
        "over_cap": caps.over_text(rec.gpu_bytes, controller.memory_cap(st),
                                   controller.context_bytes) if rec else None,
    }


def _host_room(rec: KernelRecord | None) -> int | None:
    room = rec.host_room if rec is not None else None
    return room.available if room is not None else None


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


NODE_ENV = "JUPYTER_GPUSHARE_NODE"


def node_name() -> str:
    """The name of the machine this server's GPUs are in: ``JUPYTER_GPUSHARE_NODE`` where set
    (in a Kubernetes pod: the node's name, from the downward API's ``spec.nodeName``; a pod's
    own host name is the pod's), else the host name."""
    return (os.environ.get(NODE_ENV) or socket.gethostname() or "")[:100]


def returning_bytes(controller: Controller) -> dict[int, int]:
    """Per GPU, the bytes this server's kernels will still bring there, each kernel once (the
    room the hub service ranks GPUs and nodes by is free memory less this): a held state where
    it was released from, or what a restore waiting for memory needs there when that is more;
    and what restores in flight reserved there and has not landed yet (the bytes that landed
    are in the GPU's used memory, so a restoring kernel's held state is not counted again)."""
    out = coming_back(controller.lifecycles())
    for st in controller.lifecycles():
        for g, n in controller.restore_need(st.kernel_id).items():
            out[g] = out.get(g, 0) + max(0, n - st.released_gpus.get(g, 0))
    for g, n in controller.reservations.snapshot().items():
        out[g] = out.get(g, 0) + n
    return out


def status_view(controller: Controller, backend: str, method: str, available: bool, reason: str,
                hub: dict[str, Any] | None = None) -> dict[str, Any]:
    tracker = controller.tracker
    released_per_gpu: dict[int, int] = {}
    for st in controller.lifecycles():
        if st.held is not None:
            for g, n in st.released_gpus.items():
                released_per_gpu[g] = released_per_gpu.get(g, 0) + n
    returning = returning_bytes(controller)
    restoring = controller.reservations.snapshot()  # part of returning: restores in flight
    placed = controller.room.load.promised(clock.now())  # placed, not allocated yet: expected
    gpus = [
        {
            "index": g.info.index,
            "uuid": g.info.uuid,
            "name": g.info.name,
            "memory_total": g.info.memory_total,
            "memory_used": g.info.memory_used,
            "utilization": g.info.utilization,
            "released_bytes": released_per_gpu.get(g.info.index, 0),
            "returning_bytes": returning.get(g.info.index, 0),
            "restoring_bytes": restoring.get(g.info.index, 0),
            "placed_bytes": placed.get(g.info.index, 0),
            "mig": g.info.mig,
            # SM demand against 100 % over the window, and who shares the GPU
            "load": controller.rebalancer.contention(g.info.index).load,
            "contended": controller.rebalancer.contention(g.info.index).contended,
            "computing": list(controller.rebalancer.contention(g.info.index).computing),
        }
        for g in sorted(tracker.gpus.values(), key=lambda g: g.info.index)
    ]
    return {
        "backend": backend,
        "node": node_name(),
        "method": method,
        "available": available,
        "reason": reason,
        "idle_timeout": controller.config.idle_timeout,
        "restore_mode": controller.restore_mode,
        "gpus": gpus,
        "kernels": [kernel_view(controller, kid) for kid in list(tracker.kernels)],
        "hub": hub,
    }


def history_view(tracker: Tracker, seconds: float, poll_interval: float) -> dict[str, Any]:
    now = clock.now()
    since = now - seconds
    gpus = {}
    for index, rec in tracker.gpus.items():
        rows = [r for r in rec.history if r[0] >= since]
        gpus[str(index)] = {
            "t": [round(r[0], 3) for r in rows],
            "memory_used": [r[1] for r in rows],
            "utilization": [r[2] for r in rows],
        }
    kernels = {}
    for kid, krec in tracker.kernels.items():
        krows = [r for r in krec.history if r.t >= since]
        gpus_seen = sorted({g for r in krows for g in r.gpu_bytes})
        kernels[kid] = {
            "t": [round(r.t, 3) for r in krows],
            "gpu_memory_bytes": [r.gpu_memory_bytes for r in krows],
            "sm_utilization": [r.sm_utilization for r in krows],
            "gpu": {str(g): [r.gpu_bytes.get(g, 0) for r in krows] for g in gpus_seen},
            # null where the kernel held nothing on that GPU at that time
            "gpu_utilization": {str(g): [r.gpu_utilization.get(g) for r in krows]
                                for g in gpus_seen},
        }
    return {"now": round(now, 3), "interval": poll_interval, "gpus": gpus, "kernels": kernels}
