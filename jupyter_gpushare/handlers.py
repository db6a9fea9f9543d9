"""Thin REST handlers over the controller, under ``{base_url}api/gpushare/``.

Every handler is authenticated and authorized (resource ``gpushare``). Caller errors are
4xx with a message; the mapping from controller errors to HTTP lives in one place.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from .controller import ControllerError
from .views import history_view, kernel_view

KERNEL_ID = r"(?P<kernel_id>[\w-]+)"
MAX_HISTORY_SECONDS = 7 * 24 * 3600


class GPUShareHandler(ExtensionHandlerMixin, APIHandler):
    auth_resource = "gpushare"

    @property
    def gpushare(self) -> Any:
        return self.extensionapp

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, ControllerError):  # the caller's error, never a 500
            try:  # tornado reads sys.exc_info(), so raise the HTTP form for it to see
                raise web.HTTPError(e.status, e.message.replace("%", "%%")) from e
            except web.HTTPError as http_error:
                super()._handle_request_exception(http_error)
            return
        super()._handle_request_exception(e)

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def json_body(self) -> dict[str, Any]:
        try:
            body = json.loads(self.request.body or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise web.HTTPError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "request body must be a JSON object")
        return body


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
        raw = self.get_argument("seconds", "600")
        try:
            seconds = float(raw)
        except ValueError:
            raise web.HTTPError(400, f"seconds must be a number, got {raw!r}") from None
        if not 0 < seconds <= MAX_HISTORY_SECONDS:
            raise web.HTTPError(400, f"seconds must be in (0, {MAX_HISTORY_SECONDS}]")
        await self.gpushare.ready()
        app = self.gpushare
        self.write_json(history_view(app.tracker, seconds, app.poll_interval))


class ReleaseHandler(GPUShareHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        await self.gpushare.ready()
        controller = self.gpushare.controller
        await controller.release(kernel_id, reason="requested over REST")
        self.write_json(kernel_view(controller, kernel_id))


class RestoreHandler(GPUShareHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        await self.gpushare.ready()
        controller = self.gpushare.controller
        st = controller.get(kernel_id)
        if not st.is_held:
            raise ControllerError(409, f"kernel is {st.state}, not released")
        task = asyncio.ensure_future(controller.restore(kernel_id, trigger="rest"))
        task.add_done_callback(_consume)  # after a 202 nobody awaits it: its outcome is in status
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and st.waiting:
                # waiting for memory: say so now; the restore goes on in the background
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
        if not isinstance(pinned, bool):
            raise web.HTTPError(400, 'body must be {"pinned": true|false}')
        await self.gpushare.ready()
        controller = self.gpushare.controller
        controller.set_pinned(kernel_id, pinned)
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
    ]
