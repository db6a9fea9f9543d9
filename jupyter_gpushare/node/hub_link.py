"""A single-user server's link to the node-wide gpushare service of its JupyterHub.

Under JupyterHub, when ``GPUShareHubLink.url`` names the service, this server

- **pushes** to the service the moment a restore starts waiting for GPU memory, so that the
  service can release other users' idle kernels at once (about a second) instead of at its
  next poll; the service's answer says what it released and, when it could not make room,
  why ("GPU 0 is full; the other kernels on it are active"): that shows in the kernel's
  ``waiting`` text. When it released something this server polls at once, and the waiting
  restore, which re-checks after every poll, goes on. While the restore still waits it is
  pushed again every ``push_interval`` seconds: the service decides again on live numbers, and
  the waiting text follows its current reason;
- **asks**, when a cell ran out of GPU memory and this server's own idle kernels cannot
  make room for its next try, that the service make it from other people's idle kernels on
  that GPU (``POST api/oom``, :meth:`HubLink.out_of_memory`): the answer, what it released
  or why nothing, is said under the error;
- **tells** the service, the moment its tracker lists a kernel it placed and that has not
  used its GPUs yet, to read this server now (``POST api/placed``): a kernel placed next on
  the node, by any server, then counts it (the service's room and pending), instead of after
  the service's next poll of this server (``GPUShareHub.poll_interval``, 10 s), when two
  people's kernels started seconds apart would both land on the GPU that looked emptiest;
- **asks**, when it places a new kernel, how much room each GPU has as the service sees
  the node (other users' released kernels and waiting restores included) and whether the user
  is within their share there (:meth:`HubLink.rooms`);
- **learns** its user's share and usage, and whether the user may open the admin page, for
  the status API (``hub``), the lab panel and ``%gpushare``; and what other servers' kernels
  placed on this node's GPUs and not using them yet are expected to take there
  (:meth:`HubLink.placed_elsewhere`), which the release policy counts as wanted memory.

Requests carry the server's own Hub token (``JUPYTERHUB_API_TOKEN``); the Hub lets the service
accept it only when the server's role has ``access:services!service=gpushare``. Failures
are logged and shown (``hub.error``), never raised: a server works alone as before, and the
service's polling remains the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Float, TraitError, Unicode, default, validate
from traitlets.config import Configurable

from .. import clock
from ..events import KERNEL_SCHEMA_ID

log = logging.getLogger(__name__)

URL_ENV = "JUPYTER_GPUSHARE_HUB_URL"
PUSH_ANSWER_WITHIN = 600.0  # s: releases of tens of GB run at a few GB/s
PLACE_ANSWER_WITHIN = 2.0  # s a kernel's start waits for the service's view of the node
PLACED_KEPT = 3  # refresh intervals the service's word on others' placements is kept unanswered


class GPUShareHubLink(Configurable):
    """Options of a single-user server's link to the gpushare hub service
    (``c.GPUShareHubLink.NAME`` in jupyter_server_config.py)."""

    url = Unicode(
        help="""URL of the gpushare hub service as this server reaches it, e.g.
        http://127.0.0.1:10101/services/gpushare/ (with a trailing slash). Default: the
        environment variable JUPYTER_GPUSHARE_HUB_URL, else "" = no service: the server
        manages its own kernels only. Needs JUPYTERHUB_API_TOKEN (set by JupyterHub).""",
    ).tag(config=True)

    @default("url")
    def _default_url(self) -> str:
        return os.environ.get(URL_ENV, "")

    refresh_interval = Float(
        30.0,
        help="""Seconds between two updates of the user's share and usage, and of what other
        servers' placed kernels are expected to take on this node's GPUs (kept 3 intervals
        without an answer), from the service. Default 30. Must be > 0. (A waiting restore is
        pushed at once, whatever this is.)""",
    ).tag(config=True)

    timeout = Float(
        10.0,
        help="""Seconds a request to the service may take before it counts as failed.
        Default 10. Must be > 0.""",
    ).tag(config=True)

    push_interval = Float(
        5.0,
        help="""Seconds between two pushes of a restore that still waits for GPU memory. The
        first push goes at once; each later one has the service decide again on live numbers
        and brings back its current reason, which the cell's waiting line shows (so it never
        keeps a reason that no longer holds, e.g. "active" after the other person stopped).
        Default 5. Must be > 0.""",
    ).tag(config=True)

    @validate("refresh_interval", "timeout", "push_interval")
    def _positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:  # also NaN
            raise TraitError(f"GPUShareHubLink.{proposal['trait'].name} must be > 0 seconds, "
                             f"not {value!r}")
        return value


class HubLink:
    """The link itself; built by :func:`connect`, started and stopped by the extension."""

    def __init__(self, options: GPUShareHubLink, token: str, user: str, server_name: str,
                 controller: Any, refresh: Callable[[], Awaitable[None]]):
        self.url = options.url if options.url.endswith("/") else options.url + "/"
        self.options = options
        self.token = token
        self.user = user
        self.server_name = server_name
        self.controller = controller
        self.refresh = refresh
        self.connected = False
        self.error: str | None = "not contacted yet"
        self.me: dict[str, Any] = {}
        #: per GPU UUID of the last place answer: kernels placed there that have not computed
        #: yet, by any server of the node (the service's ``pending``; placement weighs them)
        self.pending: dict[str, int] = {}
        #: per GPU UUID of the last place answer: its room without the released states that
        #: will come back there (``room_now``; a service before it gives none)
        self.rooms_now: dict[str, int] = {}
        #: per GPU UUID of the last ``me`` answer: bytes other servers' kernels placed there and
        #: not using it yet are expected to take, and when it came (clock.now())
        self.placed_others: dict[str, int] = {}
        self.placed_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._pushes: set[asyncio.Task[Any]] = set()
        self._following: set[str] = set()  # kernels whose waiting restore is pushed again
        self._told_placed: set[str] = set()  # placed, listed, not using their GPUs: told
        self._telling: asyncio.Task[None] | None = None
        self._tell_again = False  # a kernel was placed while the last telling was on its way
        self._said: set[str] = set()  # failures logged since the service last answered
        self._event_logger: Any = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, event_logger: Any) -> None:
        event_logger.add_listener(schema_id=KERNEL_SCHEMA_ID, listener=self._on_event)
        self._event_logger = event_logger
        self._task = asyncio.ensure_future(self._refresh_loop())

    def stop_now(self) -> list[asyncio.Task[Any]]:
        """Stop listening and cancel the link's tasks (without waiting); returns them."""
        if self._event_logger is not None:
            with contextlib.suppress(Exception):  # removed already
                self._event_logger.remove_listener(schema_id=KERNEL_SCHEMA_ID,
                                                   listener=self._on_event)
            self._event_logger = None
        tasks = [t for t in (self._task, *self._pushes) if t is not None]
        for task in tasks:
            task.cancel()
        return tasks

    async def stop(self) -> None:
        await asyncio.gather(*self.stop_now(), return_exceptions=True)

    async def _on_event(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if data.get("action") != "restore_waiting":
            return
        kernel_id = str(data.get("kernel_id", ""))
        if kernel_id in self._following:  # a new wait before the last one's follower saw it end
            task = asyncio.ensure_future(self.push([kernel_id]))
        else:
            self._following.add(kernel_id)
            task = asyncio.ensure_future(self._follow(kernel_id))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)

    async def _follow(self, kernel_id: str) -> None:
        """Push a waiting restore at once, then every ``push_interval`` while it waits."""
        try:
            while True:
                await self.push([kernel_id])
                await asyncio.sleep(self.options.push_interval)
                st = self.controller.find(kernel_id)
                if st is None or not st.waiting:
                    return
        finally:
            self._following.discard(kernel_id)

    def placed(self, kernel_ids: Iterable[str]) -> None:
        """After a poll: the kernels this server placed that its tracker lists and that have
        not used their GPUs yet. When one is new, the service is told at once (one request on
        its way at a time; kernels placed meanwhile are told by one more)."""
        current = set(kernel_ids)
        new = current - self._told_placed
        self._told_placed = current  # a kernel that used its GPUs or ended is dropped
        if not new:
            return
        if self._telling is not None and not self._telling.done():
            self._tell_again = True
            return
        self._telling = asyncio.ensure_future(self._tell_placed())
        self._pushes.add(self._telling)
        self._telling.add_done_callback(self._pushes.discard)

    async def _tell_placed(self) -> None:
        while True:
            self._tell_again = False
            answer = await self._call("POST", "api/placed", {"server": self.server_name})
            if answer is not None and isinstance(answer.get("me"), dict):
                self._take_me(answer["me"])
            if not self._tell_again:
                return

    async def _refresh_loop(self) -> None:
        while True:
            await self.fetch_me()
            await asyncio.sleep(self.options.refresh_interval)

    # -- requests ---------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any = None,
                    answer_within: float | None = None) -> dict[str, Any] | None:
        request = HTTPRequest(
            self.url + path, method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=None if body is None else json.dumps(body),
            request_timeout=answer_within or self.options.timeout, connect_timeout=self.options.timeout,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
            answer = json.loads(response.body)
            if not isinstance(answer, dict):
                raise ValueError("the answer is not a JSON object")
        except Exception as e:
            error = f"{method} {path.split('?')[0]}: {e}"[:300]
            # each failure once until the service answers again: the refresh and the pushes
            # of a waiting restore ask every few seconds
            (log.debug if error in self._said else log.warning)(
                "gpushare: the hub service did not answer: %s", error)
            self._said.add(error)
            self.connected, self.error = False, error
            return None
        if self._said:
            log.info("gpushare: the hub service answers again")
            self._said.clear()
        self.connected, self.error = True, None
        return answer

    async def fetch_me(self) -> None:
        answer = await self._call("GET", "api/me?server=" + quote(self.server_name, safe=""))
        if answer is not None:
            self._take_me(answer)

    def _take_me(self, me: dict[str, Any]) -> None:
        """Keep the service's ``me`` answer; of its ``placed_elsewhere``, byte counts on GPUs
        this server knows, nothing else."""
        self.me = me
        raw = me.get("placed_elsewhere")
        known = {g.info.uuid for g in self.controller.tracker.gpus.values() if g.info.uuid}
        self.placed_others = {u: n for u, n in raw.items() if u in known and _count(n) and n > 0} \
            if isinstance(raw, dict) else {}
        self.placed_at = clock.now()

    def placed_elsewhere(self) -> dict[int, int]:
        """Per GPU index, the bytes other servers' kernels placed there and not using it yet are
        expected to take, as the service last said; nothing once it has not said for
        :data:`PLACED_KEPT` refresh intervals (those kernels have allocated by then, or not)."""
        at = self.placed_at
        if at is None or clock.now() - at > PLACED_KEPT * self.options.refresh_interval:
            return {}
        by_uuid = {g.info.uuid: g.info.index for g in self.controller.tracker.gpus.values() if g.info.uuid}
        return {by_uuid[u]: n for u, n in self.placed_others.items() if u in by_uuid}

    async def push(self, kernel_ids: list[str]) -> dict[str, Any] | None:
        """Tell the service that restores of ``kernel_ids`` wait; note its answer."""
        # the service answers once its releases are done: moving a big state takes a while
        answer = await self._call("POST", "api/waiting",
                                  {"server": self.server_name, "kernels": kernel_ids},
                                  answer_within=max(self.options.timeout, PUSH_ANSWER_WITHIN))
        if answer is None:
            return None
        waits: dict[str, Any] = answer["waits"] if isinstance(answer.get("waits"), dict) else {}
        for kid in kernel_ids:
            note = waits.get(kid)
            self.controller.note_waiting(kid, note[:300] if isinstance(note, str) else None)
        if isinstance(answer.get("me"), dict):
            self._take_me(answer["me"])
        if answer.get("released"):
            await self.refresh()  # see the freed memory now: the waiting restore goes on
        return answer

    async def rooms(self, uuids: list[str]) -> dict[str, tuple[int | None, bool]] | None:
        """The service's view of the room on each GPU of ``uuids`` for a new kernel of this
        user: {uuid: (bytes or None, within the user's share)}; None when it does not answer
        within a couple of seconds (placement then goes by this server's own view)."""
        answer = await self._call("POST", "api/place", {"uuids": uuids},
                                  answer_within=min(self.options.timeout, PLACE_ANSWER_WITHIN))
        gpus = answer.get("gpus") if answer is not None else None
        if not isinstance(gpus, dict):
            return None
        out: dict[str, tuple[int | None, bool]] = {}
        pending: dict[str, int] = {}
        now: dict[str, int] = {}
        for uuid, row in gpus.items():
            if not isinstance(row, dict) or uuid not in uuids:
                continue
            room = row.get("room")
            if room is not None and (not isinstance(room, int) or isinstance(room, bool)):
                continue
            out[uuid] = (room, row.get("within_share") is not False)
            n = row.get("pending")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                pending[uuid] = n
            r = row.get("room_now")  # a service before it says none: the room alone counts
            if isinstance(r, int) and not isinstance(r, bool):
                now[uuid] = r
        self.pending, self.rooms_now = pending, now
        return out

    async def out_of_memory(self, kernel_id: str, gpu: int, nbytes: int) -> dict[str, Any] | None:
        """Ask the service to make room for the next try of ``kernel_id``'s cell, which failed
        to allocate ``nbytes`` on the node's ``gpu``, from other people's idle kernels:
        {"released": number of kernels, "bytes": their bytes, "why_not": text or None}; None
        without an answer (or where the GPU's UUID is not known)."""
        rec = self.controller.tracker.gpus.get(gpu)
        uuid = rec.info.uuid if rec is not None else None
        if not uuid:
            return None
        answer = await self._call("POST", "api/oom",
                                  {"server": self.server_name, "kernel": kernel_id, "gpu": uuid,
                                   "bytes": int(nbytes)},
                                  answer_within=max(self.options.timeout, PUSH_ANSWER_WITHIN))
        if answer is None:
            return None
        said = answer.get("released")
        released: list[Any] = said if isinstance(said, list) else []
        freed = sum(r["bytes"] for r in released if isinstance(r, dict)
                    and isinstance(r.get("bytes"), int) and not isinstance(r.get("bytes"), bool))
        why = answer.get("why_not")
        if isinstance(answer.get("me"), dict):
            self._take_me(answer["me"])
        if released:
            await self.refresh()  # the freed memory, seen now
        return {"released": len(released), "bytes": freed,
                "why_not": why[:300] if isinstance(why, str) and why else None}

    # -- what status shows ---------------------------------------------------------------------
    def cap(self) -> int | None:
        """The admin's memory cap for this user's kernels, bytes per GPU (the service's
        ``caps`` table, by user or group); None: none, or no answer yet."""
        cap = self.me.get("cap")
        return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None

    def view(self) -> dict[str, Any]:
        me = self.me
        by_uuid = {g.info.uuid: g.info.index for g in self.controller.tracker.gpus.values()}
        usage: dict[str, Any] = me["usage"] if isinstance(me.get("usage"), dict) else {}
        guaranteed: dict[str, Any] = me["guaranteed"] if isinstance(me.get("guaranteed"), dict) else {}
        rows = []
        for uuid, index in sorted(by_uuid.items(), key=lambda kv: kv[1]):
            used = usage.get(uuid, 0)
            limit = guaranteed.get(uuid)
            rows.append({"index": index, "bytes": used if _count(used) else 0,
                         "guaranteed": limit if _count(limit) else None})
        share = me.get("share")
        admin_url = me.get("admin_url")
        return {
            "service_url": self.url,
            "connected": self.connected,
            "error": self.error,
            "user": self.user,
            "admin_url": admin_url if isinstance(admin_url, str) and me.get("admin") is True else None,
            "share": share if isinstance(share, str) else None,
            "usage": rows,
            "over_share": me.get("over_share") is True,
            "cap": self.cap(),
        }


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def connect(config: Any, controller: Any, refresh: Callable[[], Awaitable[None]]) -> HubLink | None:
    """The link when this server runs under JupyterHub with the service configured, else None."""
    options = GPUShareHubLink(config=config)
    token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not options.url:
        return None
    if not token:
        log.warning("gpushare: GPUShareHubLink.url is set but JUPYTERHUB_API_TOKEN is not "
                    "(not started by JupyterHub?): no link to the hub service")
        return None
    log.info("gpushare: linked to the hub service at %s", options.url)
    return HubLink(options, token, os.environ.get("JUPYTERHUB_USER", ""),
                   os.environ.get("JUPYTERHUB_SERVER_NAME", ""), controller, refresh)
