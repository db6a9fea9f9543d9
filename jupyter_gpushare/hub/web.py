"""The service's HTTP endpoints, under its prefix (``/services/gpushare/``).

| Path | Who | What |
|---|---|---|
| ``/`` | JupyterHub admins (Hub OAuth) | the admin page |
| ``api/status`` | admins | every GPU, person, kernel, wait and recent action (JSON) |
| ``api/actions`` | admins | ``POST {"user", "server", "kernel", "action": release/pin/unpin}`` |
| ``api/me`` | any Hub user or server token allowed to use the service | that user's share and usage (``?server=NAME``: and what other servers placed on its node's GPUs) |
| ``api/waiting`` | same (a single-user server's own token) | "a restore of mine waits": make room |
| ``api/oom`` | same | "a cell of mine ran out of memory, my own idle kernels cannot make room": make room |
| ``api/placed`` | same | "I placed a kernel": read my server now |
| ``api/place`` | same | room, load and kernels per GPU, for placing a new kernel |
| ``api/nodes`` | same (the spawner hook calls it with the new server's token) | the nodes, best first for a new server |
| ``metrics`` | admins, tokens with ``read:metrics``, or anyone if ``metrics_public`` | Prometheus |

Identity always comes from the Hub (OAuth cookie or token); a request names only the caller's
own kernels, never someone else's, except an admin's action.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated, UserNotAllowed
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tornado import web

from .coordinator import Coordinator

log = logging.getLogger(__name__)
STATIC = Path(__file__).with_name("static")
MAX_BODY = 64 * 1024


class ServiceHandler(HubOAuthenticated, web.RequestHandler):
    def initialize(self, coordinator: Coordinator, hub_auth: Any, settings: dict[str, Any]) -> None:
        self.coordinator = coordinator
        self.hub_auth = hub_auth
        self.service_settings = settings

    async def prepare(self) -> None:
        """Who is calling, asked of the Hub without blocking the loop."""
        try:
            model = await self.hub_auth.get_user(self, sync=False)
        except web.HTTPError:
            raise
        except Exception as e:  # the Hub is down or restarting: not the caller's fault, not ours
            log.warning("gpushare hub: cannot identify a caller: %s", e)
            raise web.HTTPError(502, "the Hub did not answer; try again in a moment") from None
        if model:
            try:
                model = self.check_hub_user(model)
            except UserNotAllowed:
                model = None
        self._hub_auth_user_cache = model

    def check_xsrf_cookie(self) -> None:
        if self.hub_auth.get_token(self, in_cookie=False):
            return  # a token in a header: no browser sends one on its own, so no forgery
        super().check_xsrf_cookie()

    @property
    def user(self) -> dict[str, Any] | None:
        return self.current_user

    @property
    def is_admin(self) -> bool:
        return bool(self.user and self.user.get("kind", "user") == "user" and self.user.get("admin") is True)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Say why (tornado's page says only the status)."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        why = getattr(exc, "log_message", None) or self._reason
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(f"<!doctype html><title>{status_code}</title><h1>{status_code}: "
                    f"{web.escape.xhtml_escape(self._reason)}</h1><p>{web.escape.xhtml_escape(why)}</p>")

    def refuse(self, status: int, message: str) -> None:
        self.write_json({"message": message}, status=status)

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(data))

    def body_object(self) -> dict[str, Any] | None:
        raw = self.request.body or b""
        if len(raw) > MAX_BODY:
            return None
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            return None
        return body if isinstance(body, dict) else None


class AdminPage(ServiceHandler):
    @web.authenticated
    def get(self) -> None:
        if not self.is_admin:
            raise web.HTTPError(403, "the gpushare admin page is for JupyterHub admins")
        page = (STATIC / "admin.html").read_text(encoding="utf-8")
        page = page.replace("{{xsrf}}", self.xsrf_token.decode()).replace(
            "{{user}}", web.escape.xhtml_escape(self.user["name"] if self.user else ""))
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; "
                        "style-src 'self'; script-src 'self'; frame-ancestors 'self'")
        self.finish(page)


class AdminStatus(ServiceHandler):
    def get(self) -> None:
        if not self.is_admin:
            return self.refuse(403, "admins only")
        self.write_json(self.coordinator.admin_view())


class AdminActions(ServiceHandler):
    async def post(self) -> None:
        if not self.is_admin:
            return self.refuse(403, "admins only")
        body = self.body_object()
        fields = ("user", "server", "kernel", "action")
        if body is None or set(body) != set(fields) or not all(isinstance(body[f], str) for f in fields) \
                or body["action"] not in ("release", "pin", "unpin"):
            return self.refuse(400, 'body must be {"user", "server", "kernel", "action": '
                                    '"release" | "pin" | "unpin"} (strings)')
        action = "pin" if body["action"] in ("pin", "unpin") else "release"
        log.info("gpushare hub: admin %s asks %s of %s/%s kernel %s", self.user["name"] if self.user else "?",
                 body["action"], body["user"], body["server"], body["kernel"])
        code, answer = await self.coordinator.admin_action(
            body["user"], body["server"], body["kernel"], action, pinned=body["action"] == "pin")
        self.write_json(answer, status=code if code in (200, 400, 404, 409, 502) else 502)


class Me(ServiceHandler):
    def get(self) -> None:
        if self.user is None or self.user.get("kind", "user") != "user":
            return self.refuse(403, "a Hub user's token is needed")
        server = self.get_query_argument("server", None)  # the caller's server, by its name
        if server is not None and len(server) > 255:
            return self.refuse(400, "server: a server name (at most 255 characters)")
        self.write_json(self.coordinator.me(self.user["name"], admin=self.is_admin, server=server))


class Waiting(ServiceHandler):
    async def post(self) -> None:
        if self.user is None or self.user.get("kind", "user") != "user":
            return self.refuse(403, "a Hub user's token is needed")
        body = self.body_object()
        if body is None or not isinstance(body.get("server", ""), str) \
                or not isinstance(body.get("kernels"), list) or len(body["kernels"]) > 1000 \
                or not all(isinstance(k, str) and len(k) <= 100 for k in body["kernels"]):
            return self.refuse(400, 'body must be {"server": NAME, "kernels": [KERNEL_ID, ...]}')
        answer = await self.coordinator.on_push(self.user["name"], body.get("server", ""), body["kernels"])
        answer["me"] = self.coordinator.me(self.user["name"], admin=self.is_admin,
                                           server=body.get("server", ""))
        self.write_json(answer)


class OutOfMemory(ServiceHandler):
    async def post(self) -> None:
        if self.user is None or self.user.get("kind", "user") != "user":
            return self.refuse(403, "a Hub user's token is needed")
        body = self.body_object()
        usage = ('body must be {"server": NAME, "kernel": KERNEL_ID, "gpu": GPU_UUID, "bytes": '
                 'a positive integer} (the caller\'s own server and kernel)')
        if body is None or set(body) != {"server", "kernel", "gpu", "bytes"}:
            return self.refuse(400, usage)
        server, kernel, gpu, nbytes = body["server"], body["kernel"], body["gpu"], body["bytes"]
        if not isinstance(server, str) or len(server) > 255 or not isinstance(kernel, str) \
                or not 0 < len(kernel) <= 100 or not isinstance(gpu, str) or not 0 < len(gpu) <= 100 \
                or not _whole(nbytes) or not 0 < nbytes < 2**60:
            return self.refuse(400, usage)
        answer = await self.coordinator.on_out_of_memory(self.user["name"], server, kernel, gpu, nbytes)
        answer["me"] = self.coordinator.me(self.user["name"], admin=self.is_admin, server=server)
        self.write_json(answer)


class Placed(ServiceHandler):
    async def post(self) -> None:
        if self.user is None or self.user.get("kind", "user") != "user":
            return self.refuse(403, "a Hub user's token is needed")
        body = self.body_object()
        if body is None or set(body) - {"server"} or not isinstance(body.get("server", ""), str) \
                or len(body.get("server", "")) > 255:
            return self.refuse(400, 'body must be {"server": NAME} (the caller\'s own server)')
        await self.coordinator.on_placed(self.user["name"], body.get("server", ""))
        self.write_json({"me": self.coordinator.me(self.user["name"], admin=self.is_admin,
                                                   server=body.get("server", ""))})


class Place(ServiceHandler):
    async def post(self) -> None:
        if self.user is None or self.user.get("kind", "user") != "user":
            return self.refuse(403, "a Hub user's token is needed")
        body = self.body_object()
        if body is None or not isinstance(body.get("uuids"), list) or len(body["uuids"]) > 64 \
                or not all(isinstance(u, str) and 0 < len(u) <= 100 for u in body["uuids"]):
            return self.refuse(400, 'body must be {"uuids": [GPU_UUID, ...]} (at most 64)')
        self.write_json({"gpus": await self.coordinator.rooms(self.user["name"], body["uuids"])})


class Nodes(ServiceHandler):
    async def post(self) -> None:
        if self.user is None or self.user.get("kind", "user") != "user":
            return self.refuse(403, "a Hub user's token is needed")
        body = self.body_object()
        usage = ('body must be {"gpus": 1-64, "memory": bytes or null, "spawner": NAME, '
                 '"steerable": true|false} (every field optional)')
        if body is None or set(body) - {"gpus", "memory", "spawner", "steerable"}:
            return self.refuse(400, usage)
        gpus, memory = body.get("gpus", 1), body.get("memory")
        spawner, steerable = body.get("spawner", ""), body.get("steerable", False)
        if not _whole(gpus) or not 1 <= gpus <= 64 or (memory is not None and (
                not _whole(memory) or memory < 0)) or not isinstance(spawner, str) \
                or len(spawner) > 100 or not isinstance(steerable, bool):
            return self.refuse(400, usage)
        nodes = await self.coordinator.rank_nodes(self.user["name"], gpus, memory, spawner, steerable)
        self.write_json({"nodes": nodes})


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Metrics(ServiceHandler):
    def get(self) -> None:
        scopes = set(self.user.get("scopes", [])) if self.user else set()
        if not (self.service_settings.get("metrics_public") or self.is_admin or "read:metrics" in scopes):
            return self.refuse(403, "metrics need an admin, a token with read:metrics, or "
                                    "GPUShareHub.metrics_public")
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.coordinator.metrics.registry))


class OAuthCallback(HubOAuthCallbackHandler):
    def initialize(self, hub_auth: Any) -> None:
        self.hub_auth = hub_auth


def routes(prefix: str, coordinator: Coordinator, hub_auth: Any, settings: dict[str, Any]) -> list:
    kw = {"coordinator": coordinator, "hub_auth": hub_auth, "settings": settings}
    p = prefix if prefix.endswith("/") else prefix + "/"
    return [
        (p, AdminPage, kw),
        (p + "oauth_callback", OAuthCallback, {"hub_auth": hub_auth}),
        (p + "api/status", AdminStatus, kw),
        (p + "api/actions", AdminActions, kw),
        (p + "api/me", Me, kw),
        (p + "api/waiting", Waiting, kw),
        (p + "api/oom", OutOfMemory, kw),
        (p + "api/placed", Placed, kw),
        (p + "api/place", Place, kw),
        (p + "api/nodes", Nodes, kw),
        (p + "metrics", Metrics, kw),
        (p + r"static/(admin\.js|admin\.css)", web.StaticFileHandler, {"path": str(STATIC)}),
    ]
