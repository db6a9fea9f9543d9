"""Thin REST handlers over the controller, under ``{base_url}api/gpushare/``.

The contract they keep is ``openapi.yaml`` beside this module. Every handler is
authenticated and authorized (resource ``gpushare``). Caller errors are 4xx with a message
and change nothing: handlers raise :class:`BadRequest` (or the controller a
``ControllerError``), and ``GPUShareHandler`` alone turns them into the HTTP answer.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, NoReturn

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from ..core.ahead import AHEAD
from ..core.controller import ControllerError
from ..policy.caps import CapError, parse_cap
from .views import history_view, kernel_view

KERNEL_ID = r"(?P<kernel_id>[\w-]+)"
MAX_HISTORY_SECONDS = 7 * 24 * 3600
MAX_BODY_BYTES = 4096  # every body the API takes is a few bytes; parse nothing large
# a JSON number, ASCII only: float() alone also takes " 5", "1_000", "nan", "inf", non-ASCII digits
JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")


class BadRequest(Exception):
    """Input the endpoint does not accept (400); raised before anything changes."""

    status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _caller_error(e: BaseException) -> tuple[int, str] | None:
    """(status, message) when ``e`` is the caller's error, else None (a server fault)."""
    if isinstance(e, (BadRequest, ControllerError)):
        return e.status, e.message
    return None


def _no_constants(name: str) -> NoReturn:
    raise BadRequest(f"request body is not valid JSON: {name} is not a JSON value")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise BadRequest("request body is not valid JSON: an object repeats a key")
    return obj


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object: strict JSON (no NaN/Infinity, no repeated keys),
    at most ``MAX_BODY_BYTES``, nesting never deeper than the parser can take."""
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constants,
                          object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: deep nesting
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def parse_seconds(raw: str, name: str = "seconds", low_open: bool = True) -> float:
    """``history?seconds=``: a JSON number in (0, MAX_HISTORY_SECONDS] (``[0, ...]`` when
    ``low_open`` is false)."""
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    if not JSON_NUMBER.match(raw):
        raise BadRequest(f"{name} must be a number, got {shown!r}")
    seconds = float(raw)
    low_ok = 0 < seconds if low_open else 0 <= seconds
    if not (low_ok and seconds <= MAX_HISTORY_SECONDS):  # also refuses 1e999 (inf)
        bracket = "(" if low_open else "["
        raise BadRequest(f"{name} must be in {bracket}0, {MAX_HISTORY_SECONDS}], got {shown}")
    return seconds


def _log_background_failure(task: asyncio.Task[Any]) -> None:
    """A restore that answered 202 goes on alone: its outcome shows in the kernel's state;
    retrieve the exception so it is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


class GPUShareHandler(ExtensionHandlerMixin, APIHandler):
    auth_resource = "gpushare"

    @property
    def gpushare(self) -> Any:
        return self.extensionapp

    def _handle_request_exception(self, e: BaseException) -> None:
        """The one place caller errors become 4xx answers (never a 500)."""
        caller = _caller_error(e)
        if caller is None:
            super()._handle_request_exception(e)
            return
        status, message = caller
        self.log.info("gpushare: %s %s: %d %s", self.request.method, self.request.path,
                      status, message)
        if self._finished:
            return
        self.send_error(status, message=message)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        message = kwargs.get("message")
        if message is None:  # jupyter_server's own errors (403, 405, ...)
            super().write_error(status_code, **kwargs)
            return
        # jupyter_server's error body; written here so a message is never %-formatted
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"message": message, "reason": None}))

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def json_body(self) -> dict[str, Any]:
        return parse_json_object(self.request.body or b"{}")


class StatusHandler(GPUShareHandler):
    _track_activity = False  # polling must not keep an idle server alive

    @web.authenticated
    @authorized
    async def get(self) -> None:
        await self.gpushare.ready()
        self.write_json(self.gpushare.status())


class HistoryHandler(GPUShareHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        seconds = parse_seconds(self.get_argument("seconds", "600", strip=False))
        await self.gpushare.ready()
        app = self.gpushare
        self.write_json(history_view(app.tracker, seconds, app.poll_interval))


#: who may say they ask for a release or restore (the optional body's ``trigger``), and the
#: release reason each gives; no trigger: ``rest``
CLIENT_TRIGGERS = {"panel": "requested from the panel"}
ACTION_BODY = 'body must be empty, {} or {"trigger": "panel"}'
#: a restore may also be asked ahead of a person's next cell (:mod:`.ahead`)
RESTORE_TRIGGERS = (AHEAD, *CLIENT_TRIGGERS)
RESTORE_BODY = 'body must be empty, {}, {"trigger": "activity"} or {"trigger": "panel"}'


def parse_action_body(raw: bytes, triggers: tuple[str, ...] = tuple(CLIENT_TRIGGERS),
                      refusal: str = ACTION_BODY) -> str:
    """The optional body of a release or restore: who asks (``rest`` without one)."""
    if not raw:
        return "rest"
    body = parse_json_object(raw)
    if set(body) - {"trigger"}:
        raise BadRequest(refusal)
    if "trigger" not in body:
        return "rest"
    trigger = body["trigger"]
    if not isinstance(trigger, str) or trigger not in triggers:
        raise BadRequest(refusal)
    return trigger


class ReleaseHandler(GPUShareHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        raw = self.get_argument("if_idle_for", None, strip=False)
        idle_for = None if raw is None else parse_seconds(raw, "if_idle_for", low_open=False)
        trigger = parse_action_body(self.request.body or b"")
        await self.gpushare.ready()
        controller = self.gpushare.controller
        if idle_for is None:
            await controller.release(kernel_id, reason=CLIENT_TRIGGERS.get(trigger, "requested over REST"))
        else:  # the node-wide service making room: only what an automatic release may take
            await controller.release_if_idle(kernel_id, idle_for, reason="requested by the "
                                             "gpushare service to make room for another user")
        self.write_json(kernel_view(controller, kernel_id))


class RestoreHandler(GPUShareHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        trigger = parse_action_body(self.request.body or b"", RESTORE_TRIGGERS, RESTORE_BODY)
        await self.gpushare.ready()
        controller = self.gpushare.controller
        st = controller.get(kernel_id)
        if trigger == AHEAD:  # a hint: answered at once, the restore goes on in the background
            self.gpushare.ahead.request(kernel_id)
            self.write_json(kernel_view(controller, kernel_id), status=202 if st.is_held else 200)
            return
        if not st.is_held:
            raise ControllerError(409, f"kernel is {st.state}, not released")
        task = asyncio.ensure_future(controller.restore(kernel_id, trigger=trigger))
        task.add_done_callback(_consume)  # after a 202 nobody awaits it: its outcome is in status
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and st.waiting:
                # waiting for memory: say so now; the restore goes on in the background
                task.add_done_callback(_log_background_failure)
                self.write_json(kernel_view(controller, kernel_id), status=202)
                return
        task.result()
        self.write_json(kernel_view(controller, kernel_id))


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class PinHandler(GPUShareHandler):
    @web.authenticated
    @authorized
    async def put(self, kernel_id: str) -> None:
        body = self.json_body()
        pinned = body.get("pinned")
        if not isinstance(pinned, bool) or len(body) != 1:
            raise BadRequest('body must be {"pinned": true} or {"pinned": false}')
        await self.gpushare.ready()
        controller = self.gpushare.controller
        controller.set_pinned(kernel_id, pinned)
        self.write_json(kernel_view(controller, kernel_id))


class CapHandler(GPUShareHandler):
    @web.authenticated
    @authorized
    async def put(self, kernel_id: str) -> None:
        body = self.json_body()
        value = body.get("memory_cap", "")
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON's 8589934592.0 is a whole number too
        if set(body) != {"memory_cap"} or not (value is None or (isinstance(value, int)
                                                                 and not isinstance(value, bool))):
            raise BadRequest('body must be {"memory_cap": BYTES} (bytes per GPU, a whole number '
                             'such as 8589934592) or {"memory_cap": null} (back to the default)')
        try:
            cap = None if value is None else parse_cap(value, "memory_cap")
        except CapError as e:
            raise BadRequest(str(e)) from None
        await self.gpushare.ready()
        controller = self.gpushare.controller
        controller.set_memory_cap(kernel_id, cap)
        self.gpushare.tell_cap(kernel_id)  # the kernel's frameworks follow
        self.write_json(kernel_view(controller, kernel_id))


def handlers() -> list[tuple[str, type]]:
    """Routes relative to the server's base_url (ExtensionApp prefixes it)."""
    root = "/api/gpushare"
    return [
        (f"{root}/status", StatusHandler),
        (f"{root}/history", HistoryHandler),
        (f"{root}/kernels/{KERNEL_ID}/release", ReleaseHandler),
        (f"{root}/kernels/{KERNEL_ID}/restore", RestoreHandler),
        (f"{root}/kernels/{KERNEL_ID}/pin", PinHandler),
        (f"{root}/kernels/{KERNEL_ID}/cap", CapHandler),
    ]
