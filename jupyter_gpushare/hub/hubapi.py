"""The service's HTTP: the Hub's REST API, and each user server's gpushare REST through the
proxy, always with the service's own token (its role grants what it may do there).

Requests are bounded (``concurrency`` at once, ``timeout`` each), so one slow server never
holds the others up.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from .view import ServerRef

MAX_BODY = 32 << 20  # a status of thousands of kernels is a few MB


class HubAPIError(Exception):
    """A request that did not give a usable answer; ``code`` is the HTTP status (0: none)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class HubAPI:
    def __init__(self, api_url: str, proxy_url: str, token: str, timeout: float = 10.0,
                 concurrency: int = 10):
        self.api_url = api_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._client = AsyncHTTPClient(max_body_size=MAX_BODY)

    async def fetch(self, url: str, method: str = "GET", body: Any = None,
                    headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        request = HTTPRequest(
            url, method=method, body=None if body is None and method == "GET" else (body or b""),
            headers={"Authorization": f"token {self.token}", **(headers or {})},
            request_timeout=self.timeout, connect_timeout=self.timeout, follow_redirects=False,
            allow_nonstandard_methods=True,
        )
        async with self._slots:
            try:
                response = await self._client.fetch(request, raise_error=False)
            except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
                raise HubAPIError(f"{method} {url}: {e}") from None
        if response.code == 599:
            raise HubAPIError(f"{method} {url}: {response.error}")
        return response.code, response.body or b""

    # -- the Hub -------------------------------------------------------------------------------
    async def ready_servers(self) -> list[ServerRef]:
        """Every ready server of every user (the Hub's paginated user list)."""
        out: list[ServerRef] = []
        url: str | None = f"{self.api_url}/users?" + urlencode({"state": "ready", "limit": 200})
        while url:
            code, raw = await self.fetch(url, headers={"Accept": "application/jupyterhub-pagination+json"})
            if code != 200:
                raise HubAPIError(f"GET {url}: {code} {raw[:200]!r}", code)
            page = json.loads(raw)
            items = page["items"] if isinstance(page, dict) else page
            for user in items:
                groups = [g for g in user.get("groups") or [] if isinstance(g, str)]
                for name, server in (user.get("servers") or {}).items():
                    if server.get("ready") and isinstance(server.get("url"), str):
                        out.append(ServerRef(user["name"], name, server["url"], groups))
            nxt = (page.get("_pagination") or {}).get("next") if isinstance(page, dict) else None
            url = nxt.get("url") if isinstance(nxt, dict) else None
        return out

    # -- user servers ------------------------------------------------------------------------------
    def _server(self, ref: ServerRef, path: str) -> str:
        return f"{self.proxy_url}{ref.url.rstrip('/')}/api/gpushare/{path}"

    async def status(self, ref: ServerRef) -> bytes:
        code, raw = await self.fetch(self._server(ref, "status"))
        if code != 200:
            raise HubAPIError(f"status answered {code}", code)
        return raw

    async def release(self, ref: ServerRef, kernel_id: str, if_idle_for: float | None) -> tuple[int, dict]:
        query = "" if if_idle_for is None else "?" + urlencode({"if_idle_for": f"{if_idle_for:g}"})
        code, raw = await self.fetch(self._server(ref, f"kernels/{quote(kernel_id)}/release{query}"),
                                     method="POST", body=b"")
        return code, _json_object(raw)

    async def pin(self, ref: ServerRef, kernel_id: str, pinned: bool) -> tuple[int, dict]:
        code, raw = await self.fetch(self._server(ref, f"kernels/{quote(kernel_id)}/pin"), method="PUT",
                                     body=json.dumps({"pinned": pinned}).encode(),
                                     headers={"Content-Type": "application/json"})
        return code, _json_object(raw)


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {"message": raw[:200].decode("utf-8", "replace")}
    return body if isinstance(body, dict) else {"message": str(body)[:200]}
