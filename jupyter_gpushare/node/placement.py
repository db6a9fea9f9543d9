"""Which GPU(s) a kernel gets when the server starts it (``placement = "room"``).

The gpushare provisioner asks :class:`Placer` before it launches a kernel and sets the
kernel's ``CUDA_VISIBLE_DEVICES`` to the answer. The GPUs are judged by the placement rule
(:mod:`..policy.placement`): a GPU qualifies when its room covers what the kernel is expected
to need; qualifying GPUs rank by SM load, then by kernels there, then by room, then index.

- room = free memory read now (on the shared node or from NVML, so other servers' kernels
  count) less the bytes this server's released kernels will take back and the bytes its
  restores have reserved and not landed yet (a restoring kernel counts once: landed bytes
  are in the used memory, the rest reserved);
- the kernel's expected need per GPU: its kernelspec's ``metadata.gpushare.memory``, else the
  most its kernelspec's recent kernels on this server held on one GPU, else ``min_room``;
- load (:mod:`.gpu_load`): SM busy over ``load_window`` seconds from the tracker's history,
  plus the expected load of kernels this server placed there that have not used the GPU
  yet, so two kernels started back to back land on different GPUs;
- with the node daemon (``node_daemon_socket``), kernels other servers of the node placed and
  that have not used their GPUs yet, and their released kernels' states: their expected bytes
  and the states are out of the room and their expected load is pending, as for this
  server's own (asked before the placement; this server's placements are told right after);
- with the hub service (``GPUShareHubLink.url``), the service's view of each GPU counts too:
  what other users' released kernels will take back and what waiting restores need there
  (the smaller room of the two views counts), kernels other servers placed there and that
  have not used it yet (their expected load, as for this server's own), and GPUs where the
  user is over their share rank after those where they are within it. A service that does
  not answer within a couple of seconds is left out (logged): the kernel is placed by this
  server's view;
- the candidates are the GPUs the kernel's environment allows (an existing
  ``CUDA_VISIBLE_DEVICES``, the kernel's or the server's), else every GPU;
- how many: the kernelspec's ``metadata.gpushare.gpus``, else ``placement_gpus``. A
  kernelspec that asks for more GPUs than there are is refused (:class:`PlacementError`);
  the option's count is capped at the GPUs there are.

A kernel placed where no GPU has room (less than ``min_room``) starts anyway, on the GPUs
with the most, and carries a note its agent prints before its first cell.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tornado.web import HTTPError

from ..policy import caps
from ..policy.fairshare import parse_share
from ..policy.placement import PENDING_LOAD, choose, expected_need
from ..policy.room import narrow
from ..telemetry import GPUInfo
from ..units import format_bytes
from .gpu_load import GpuLoad, coming_back
from .node_placed import NodePlaced

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
SAMPLE_WAIT = 10.0  # s a kernel start waits for a reading of the GPUs before the first poll

ReadFree = Callable[[list[int]], Awaitable[dict[int, "int | None"]]]
#: the hub service's view: GPU UUIDs -> {uuid: (room in bytes or None, within the user's share)}
ServiceRoom = Callable[[list[str]], Awaitable["dict[str, tuple[int | None, bool]] | None"]]


class PlacementError(HTTPError):
    """A kernel that cannot start as asked (400, with the reason as the message)."""

    def __init__(self, message: str):
        super().__init__(400, message, reason="Bad Request")  # APIHandler shows log_message
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class Placement:
    """Where one kernel was placed."""

    gpus: list[int]  # the node's indices, best first (the kernel's device 0 first)
    value: str  # what CUDA_VISIBLE_DEVICES was set to
    room: dict[int, int | None] = field(default_factory=dict)  # bytes per candidate GPU
    note: str = ""  # said before the kernel's first cell ("" = nothing to say)


def requested_gpus(kernel_spec: Any) -> int | None:
    """``metadata.gpushare.gpus`` of a kernelspec: None when it does not say;
    :class:`PlacementError` when it is not a count."""
    metadata = getattr(kernel_spec, "metadata", None) or {}
    meta = metadata.get("gpushare") if isinstance(metadata, dict) else None
    if not isinstance(meta, dict) or "gpus" not in meta:
        return None
    value = meta["gpus"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlacementError(f"kernelspec {_spec_name(kernel_spec)}: metadata.gpushare.gpus must be "
                             f"a whole number of GPUs >= 0, got {value!r}")
    return value


def requested_memory(kernel_spec: Any) -> int | None:
    """``metadata.gpushare.memory`` of a kernelspec, in bytes per GPU (a whole number, or a
    string like ``"8GiB"``): None when it does not say; :class:`PlacementError` when it is
    not an amount of memory."""
    metadata = getattr(kernel_spec, "metadata", None) or {}
    meta = metadata.get("gpushare") if isinstance(metadata, dict) else None
    if not isinstance(meta, dict) or "memory" not in meta:
        return None
    value = meta["memory"]
    try:  # the fair-share table's amounts, less its percentages and "per node"
        share = None if isinstance(value, str) and ("per" in value or "/" in value) \
            else parse_share(value)
    except ValueError:
        share = None
    if share is None or share.amount is None:
        raise PlacementError(f"kernelspec {_spec_name(kernel_spec)}: metadata.gpushare.memory "
                             f'must be bytes per GPU, a whole number or an amount like "8GiB", '
                             f"got {value!r}")
    return share.amount


def requested_cap(kernel_spec: Any) -> int | None:
    """``metadata.gpushare.memory_limit`` of a kernelspec, bytes per GPU (None: none);
    :class:`PlacementError` when it is not an amount of memory (the kernel does not start)."""
    try:
        return caps.of_kernelspec(getattr(kernel_spec, "metadata", None) or {})
    except caps.CapError as e:
        raise PlacementError(f"kernelspec {_spec_name(kernel_spec)}: {e}") from None


def spec_name(kernel_spec: Any) -> str:
    """The kernelspec's name, as the kernel manager (and so the tracker) knows it: a spec
    jupyter_client loaded from its folder leaves ``name`` empty, its folder is the name."""
    name = getattr(kernel_spec, "name", "") or ""
    folder = getattr(kernel_spec, "resource_dir", "") or ""
    return name or (os.path.basename(os.path.normpath(folder)) if folder else "")


def _spec_name(kernel_spec: Any) -> str:
    return repr(getattr(kernel_spec, "display_name", None) or getattr(kernel_spec, "name", "?"))


def allowed(value: str | None, gpus: list[GPUInfo]) -> tuple[list[tuple[GPUInfo, str]], str]:
    """The GPUs an existing ``CUDA_VISIBLE_DEVICES`` allows, each with its entry (kept as
    written), and why some could not be matched ("" when all were). Entries are indices or
    UUIDs; as CUDA does, the list ends at the first entry that names no GPU."""
    if value is None:
        return [(g, "") for g in gpus], ""
    by_index = {str(g.index): g for g in gpus}
    by_uuid = {g.uuid: g for g in gpus if g.uuid}
    out: list[tuple[GPUInfo, str]] = []
    for part in value.split(","):
        token = part.strip()
        gpu = by_index.get(token) or by_uuid.get(token)
        if gpu is None or any(gpu is seen for seen, _ in out):
            why = f"{VISIBLE_ENV}={value!r}: {token!r} names no GPU this server sees" if token else ""
            return out, why
        out.append((gpu, token))
    return out, ""


class Placer:
    """Chooses a kernel's GPUs from what the server knows (see the module's docstring)."""

    def __init__(
        self,
        devices: Callable[[], list[GPUInfo]],
        read_free: ReadFree,
        held: Callable[[], dict[int, int]],
        reserved: Callable[[], dict[int, int]],
        kernel_ids: Callable[[], list[str]],
        default_gpus: int = 1,
        min_room: int = 1,
        sample: Callable[[], Awaitable[list[GPUInfo]]] | None = None,
        log: logging.Logger | None = None,
        service_room: ServiceRoom | None = None,
        load: GpuLoad | None = None,
        recent: Callable[[str], list[int]] | None = None,
        default_cap: Callable[[], int | None] | None = None,
        service_pending: Callable[[], Mapping[str, int]] | None = None,
        node_placed: NodePlaced | None = None,
        service_room_now: Callable[[], Mapping[str, int]] | None = None,
    ):
        """load: the GPUs' load and this server's placements (shared with the restore room;
        default: the last sample's SM utilization of ``devices``); recent(kernelspec name):
        the most bytes per GPU its recent kernels held; service_pending: per GPU UUID, the
        kernels the hub service saw placed there by any server of the node and not computing
        yet (asked with ``service_room``); node_placed: the other servers' placed kernels as
        the node daemon tells them (asked before each placement, told after it);
        service_room_now: per GPU UUID, the service's room without released states (asked with
        ``service_room`` too)."""
        self.devices = devices
        self.read_free = read_free
        self.held = held
        self.reserved = reserved
        self.kernel_ids = kernel_ids
        self.default_gpus = default_gpus
        self.min_room = max(1, min_room)
        self.sample = sample
        self.service_room = service_room
        self.service_pending = service_pending
        self.service_room_now = service_room_now or (lambda: {})
        self.node_placed = node_placed
        self.recent = recent or (lambda name: [])
        self.default_cap = default_cap or (lambda: None)  # the admin's cap per GPU
        self.log = log or logging.getLogger(__name__)
        self.load = load if load is not None else GpuLoad(
            lambda: {g.index: _LastSample(g.utilization) for g in self.devices()}, dict, window=0)

    @property
    def placed(self) -> dict[str, Any]:
        """kernel id -> where this server placed it and what it was expected to need."""
        return self.load.placed

    @classmethod
    def from_app(cls, app: Any) -> Placer:
        """The placer of a loaded :class:`~jupyter_gpushare.server.app.GPUShareApp`."""

        return cls(
            devices=lambda: [rec.info for rec in list(app.tracker.gpus.values())],
            read_free=app.node_room.read_free,
            held=lambda: coming_back(app.controller.lifecycles()),
            reserved=lambda: app.controller.reservations.snapshot(),
            kernel_ids=lambda: list(app.server.kernel_manager.list_kernel_ids()),
            default_gpus=app.placement_gpus,
            min_room=app.context_bytes,
            # the GPUs read now, when the server's first poll is not in yet: waiting for that
            # poll could wait on this very kernel's start (a server started with a kernel)
            sample=lambda: app.tracker.off_loop(app.tracker.telemetry.devices, SAMPLE_WAIT),
            log=app.log,
            service_room=app.service_room,
            load=app.controller.room.load,
            recent=app.tracker.recent_peaks_of,
            default_cap=app.default_cap,
            service_pending=lambda: app.hub_link.pending if app.hub_link is not None else {},
            node_placed=app.node_placed,
            service_room_now=lambda: app.hub_link.rooms_now if app.hub_link is not None else {},
        )

    async def place(self, kernel_id: str, kernel_spec: Any, env: dict[str, str]) -> Placement | None:
        """The GPUs for a kernel about to start with ``env``; None to leave its environment as
        it is. Raises :class:`PlacementError` for a kernelspec that asks for more GPUs than
        there are, or for memory that is not an amount."""
        asked = requested_gpus(kernel_spec)
        memory = requested_memory(kernel_spec)
        count = self.default_gpus if asked is None else asked
        gpus = await self._devices()
        if any(g.mig for g in gpus):
            self.log.info("gpushare: kernel %s: MIG instances on this node; placement leaves its "
                          "GPUs to the environment", kernel_id)
            return None
        existing = env.get(VISIBLE_ENV)
        candidates, why = allowed(existing, gpus)
        if why:
            self.log.warning("gpushare: kernel %s: %s; placement chooses among the GPUs before it",
                             kernel_id, why)
        if count > len(candidates):
            where = (f"{VISIBLE_ENV}={existing!r} in its environment allows {len(candidates)}"
                     if existing is not None else f"this node has {len(candidates)}")
            if asked is not None:
                raise PlacementError(
                    f"kernelspec {_spec_name(kernel_spec)} asks for {asked} GPU(s) "
                    f"(metadata.gpushare.gpus) and {where}: it cannot start here")
            count = len(candidates)
            if not candidates:
                return None  # no GPU to choose: the environment decides
        if count == 0:
            return Placement([], "", {})  # a kernel that asked for no GPU sees none
        others = await self._node_others()
        room, room_now = await self._room(gpus, [g.index for g, _ in candidates])
        for g, (n, _, back) in others.items():
            r, now_r = room.get(g), room_now.get(g)
            if r is not None and now_r is not None:
                room[g], room_now[g] = r - n - back, now_r - n
        ours = dict(room)
        within = await self._service_view([g for g, _ in candidates], room, kernel_id)
        if within:
            self._service_now([g for g, _ in candidates], room, ours, room_now)
        # a capped kernel can hold no more than its cap: that is what it is expected to need
        cap = caps.ceiling(requested_cap(kernel_spec), self.default_cap())
        need = expected_need(memory, cap, self.recent(spec_name(kernel_spec)), self.min_room)
        self.load.forget(self.kernel_ids())
        views = self.load.views(room, within, seen_pending=self._service_pending(
            [g for g, _ in candidates]) if within else None,
            others_pending={g: k * PENDING_LOAD for g, (_, k, _) in others.items()},
            room_now=room_now)
        by_index = {g.index: (g, token) for g, token in candidates}
        chosen = [by_index[v.gpu] for v in choose(views.values(), need, count)]  # type: ignore[index]
        # real GPUs: an entry as written where there was one, else the UUID (CUDA's own
        # numbering can differ from NVML's); simulated ones by index (all the simulator reads)
        value = ",".join((token or g.uuid) if g.uuid.startswith("GPU-") else str(g.index)
                         for g, token in chosen)
        indices = [g.index for g, _ in chosen]
        # said where its first allocations lack room: released states coming back are left
        # out (they restore by their own rules when they come)
        short = [g for g in indices if (r := room_now.get(g)) is not None and r < self.min_room]
        note = ""
        if short:
            note = _no_room_note(indices, short, room)
        self.load.place(kernel_id, indices, need)
        self._tell_node()
        self.log.info("gpushare: kernel %s placed on GPU %s (%s=%s; expected %s per GPU; %s%s)%s",
                      kernel_id, ", ".join(map(str, indices)), VISIBLE_ENV, value,
                      format_bytes(need.bytes), _views(views),
                      ", with the hub service's view" if within else "",
                      "; no GPU had room" if short else "")
        return Placement(indices, value, room, note)

    async def _service_view(self, gpus: list[GPUInfo], room: dict[int, int | None],
                            kernel_id: str) -> dict[int, bool]:
        """Fold the hub service's view into ``room`` (the smaller of the two counts); returns,
        per GPU it answered for, whether the user is within their share there."""
        by_uuid = {g.uuid: g.index for g in gpus if g.uuid}
        if self.service_room is None or not by_uuid:
            return {}
        try:
            seen = await self.service_room(list(by_uuid))
        except Exception as e:  # a kernel must start: placed by this server's view
            self.log.warning("gpushare: kernel %s: the hub service's view of the GPUs could not "
                             "be read (%s); placed by this server's", kernel_id, e or type(e).__name__)
            seen = None
        return narrow(room, {by_uuid[u]: v for u, v in (seen or {}).items() if u in by_uuid})

    def _service_now(self, gpus: list[GPUInfo], room: dict[int, int | None],
                     ours: dict[int, int | None], room_now: dict[int, int | None]) -> None:
        """Fold the service's room now (its room without every server's released states) into
        ``room_now``, in place: the smaller counts. Where it gave none (a service before it),
        what it counted beyond this server's own room counts as taken now too."""
        theirs = self.service_room_now()
        for g in gpus:
            now_r, r, own = room_now.get(g.index), room.get(g.index), ours.get(g.index)
            if now_r is None:
                continue
            seen = theirs.get(g.uuid) if g.uuid else None
            if seen is not None:
                room_now[g.index] = min(now_r, seen)
            elif r is not None and own is not None and r < own:
                room_now[g.index] = now_r - (own - r)

    async def _node_others(self) -> dict[int, tuple[int, int, int]]:
        """Per GPU, (bytes, kernels, returning) of other servers' placed kernels and released
        states, as the node daemon says now (none without it, or when it does not answer:
        placed by this server's view)."""
        if self.node_placed is None:
            return {}
        await self.node_placed.exchange()
        return self.node_placed.by_gpu()

    def _tell_node(self) -> None:
        """Tell the node daemon of the placement at once, not at the next poll: another
        server may place a kernel in between."""
        if self.node_placed is not None:
            self.node_placed.tell_soon()

    def _service_pending(self, gpus: list[GPUInfo]) -> dict[int, float]:
        """Per GPU, the load the hub service's placed-not-computing kernels are expected to
        add (every server's: this server sees only its own)."""
        counts = self.service_pending() if self.service_pending is not None else {}
        return {g.index: counts[g.uuid] * PENDING_LOAD for g in gpus if counts.get(g.uuid)}

    async def _devices(self) -> list[GPUInfo]:
        gpus = self.devices()
        if not gpus and self.sample is not None:  # the server's first poll is not in yet
            try:
                gpus = await self.sample()
            except Exception as e:  # a kernel must start: unplaced, and say why
                self.log.warning("gpushare: the GPUs could not be read for placement (%s); a "
                                 "kernel starts unplaced", e or type(e).__name__)
                gpus = []
        return sorted(gpus, key=lambda g: g.index)

    async def _room(self, gpus: list[GPUInfo], indices: list[int],
                    ) -> tuple[dict[int, int | None], dict[int, int | None]]:
        """Room per GPU of ``indices``, then the same without this server's released states
        that will come back there (room now); where free memory cannot be read now, the last
        sample's (``gpus``: the polled GPUs, or those just sampled before the first poll)."""
        free = await self.read_free(indices)
        held, reserved = self.held(), self.reserved()
        known = {g.index: g for g in gpus}
        room: dict[int, int | None] = {}
        room_now: dict[int, int | None] = {}
        for g in indices:
            n = free.get(g)
            info = known.get(g)
            if n is None and info is not None and info.memory_total is not None \
                    and info.memory_used is not None:
                n = info.memory_total - info.memory_used  # the last sample's
            room_now[g] = None if n is None else n - reserved.get(g, 0)
            room[g] = None if n is None else n - held.get(g, 0) - reserved.get(g, 0)
        return room, room_now


@dataclass(frozen=True)
class _LastSample:
    """A GPU's load when no history is kept: its last sample's SM utilization."""

    utilization: float | None

    def recent_load(self, window: float) -> float:
        return float(self.utilization or 0.0)


def _views(views: dict[Any, Any]) -> str:
    return ", ".join(
        f"GPU {v.gpu}: room {'unknown' if v.room is None else format_bytes(max(0, v.room))}"
        + (f" ({format_bytes(max(0, v.room_now))} before released kernels come back)"
           if v.room is not None and v.room_now is not None and v.room_now > v.room else "")
        + f", load {v.load:.0f} %" + (f" + {v.pending:.0f} % placed" if v.pending else "")
        for v in views.values())


def _rooms(room: dict[int, int | None]) -> str:
    return ", ".join(f"GPU {g}: {'unknown' if n is None else format_bytes(max(0, n))}"
                     for g, n in sorted(room.items()))


def _no_room_note(indices: list[int], short: list[int], room: dict[int, int | None]) -> str:
    where = ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(map(str, indices))
    full = ("GPU " if len(short) == 1 else "GPUs ") + ", ".join(map(str, short))
    return (f"gpushare: no GPU had room for this kernel when it started (room = free memory "
            f"less what released kernels will take back: {_rooms(room)}). It runs on {where}, "
            f"the most there was; its allocations on {full} may fail with out-of-memory until "
            "other kernels free memory or are released. Restart the kernel later to place it "
            "again.")


def placed_gpus(kernel_manager: Any, kernel_id: str) -> list[int]:
    """The GPUs the gpushare provisioner placed a running kernel on ([] when it did not)."""
    try:
        provisioner = kernel_manager.get_kernel(kernel_id).provisioner
    except Exception:  # gone, or not a kernel this manager knows
        return []
    placement = getattr(provisioner, "gpushare_placement", None)
    return list(placement.gpus) if isinstance(placement, Placement) else []
