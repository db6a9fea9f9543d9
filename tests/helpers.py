"""Talk to real kernels the way JupyterLab does: REST to start, websocket messages to run."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from tornado.httpclient import HTTPClientError, HTTPResponse

from jupyter_gpushare.server import contract


@dataclass
class Execution:
    msg_id: str
    status: str = ""
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    displays: list[dict[str, Any]] = field(default_factory=list)  # display/update_display content
    results: list[dict[str, Any]] = field(default_factory=list)  # execute_result data
    #: (message type, execution_state or "") of every message for this cell, in arrival order
    sequence: list[tuple[str, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        parts = [self.stdout]
        parts += [r.get("text/plain", "") for r in self.results]
        parts += [d.get("data", {}).get("text/plain", "") for d in self.displays]
        return "\n".join(parts)


def execute_request(code: str, session: str) -> dict[str, Any]:
    msg_id = uuid.uuid4().hex
    return {
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                   "session": session, "version": "5.3",
                   "date": datetime.now(timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "buffers": [], "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
    }


class KernelConn:
    """One kernel and one websocket to it."""

    def __init__(self, kernel_id: str, ws: Any, kernel_manager: Any = None):
        self.id = kernel_id
        self.ws = ws
        self.km = kernel_manager
        self.session = uuid.uuid4().hex
        self.executions: dict[str, Execution] = {}
        self.order: list[str] = []  # msg_ids in the order the kernel answered them
        self.event_log: list[dict[str, Any]] = []

    def send(self, code: str) -> str:
        msg = execute_request(code, self.session)
        msg_id = msg["header"]["msg_id"]
        self.executions[msg_id] = Execution(msg_id)
        self.ws.write_message(json.dumps(msg))
        return msg_id

    def send_control(self, msg_type: str) -> None:
        msg = execute_request("", self.session)
        msg["header"]["msg_type"] = msg_type
        msg["channel"] = "control"
        msg["content"] = {}
        self.ws.write_message(json.dumps(msg))

    async def wait(self, msg_id: str, timeout: float = 60) -> Execution:
        """Read messages until ``msg_id`` has its reply and the kernel went idle after it."""
        ex = self.executions[msg_id]
        deadline = time.monotonic() + timeout
        idle_seen = reply_seen = False
        while not (idle_seen and reply_seen):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to {msg_id} in {timeout} s (status {ex.status!r})")
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            if raw is None:
                raise ConnectionError("websocket closed")
            msg = json.loads(raw)
            parent = (msg.get("parent_header") or {}).get("msg_id")
            target = self.executions.get(parent)
            if target is None:
                continue
            kind, content = msg["header"]["msg_type"], msg.get("content", {})
            target.sequence.append((kind, content.get("execution_state", "")))
            if kind == "execute_reply":
                target.status = content.get("status", "")
                self.order.append(parent)
                reply_seen |= parent == msg_id
            elif kind == "status" and content.get("execution_state") == "idle":
                idle_seen |= parent == msg_id
            elif kind == "stream":
                if content.get("name") == "stdout":
                    target.stdout += content.get("text", "")
                else:
                    target.stderr += content.get("text", "")
            elif kind == "error":
                target.error = content
            elif kind in ("display_data", "update_display_data"):
                target.displays.append({"type": kind, **content})
            elif kind == "execute_result":
                target.results.append(content.get("data", {}))
        return ex

    async def ready(self, timeout: float = 60) -> None:
        """After a restart: iopub messages sent before our subscription reconnects are lost,
        so retry a trivial cell until one completes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.wait(self.send("1"), timeout=5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    async def run(self, code: str, timeout: float = 60, ok: bool = True) -> Execution:
        ex = await self.wait(self.send(code), timeout)
        if self.km is not None:
            # the server's activity monitor reads iopub on its own socket: let it catch up
            await wait_for(lambda: self.km.get_kernel(self.id).execution_state != "busy",
                           what="the server to see the kernel idle")
        if ok and ex.status != "ok":
            raise AssertionError(f"cell failed: {ex.error or ex.stderr}\n--- code:\n{code}")
        return ex


class KernelFactory:
    def __init__(self, jp_fetch: Any, jp_ws_fetch: Any, app: Any):
        self.fetch = jp_fetch
        self.ws_fetch = jp_ws_fetch
        self.app = app
        self.started: list[KernelConn] = []

    async def start(self, agent: bool = True) -> KernelConn:
        r = await self.fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
        kid = json.loads(r.body)["id"]
        ws = await self.ws_fetch("api", "kernels", kid, "channels")
        conn = KernelConn(kid, ws, self.app.serverapp.kernel_manager)
        self.started.append(conn)
        await conn.run("1")  # the kernel is up and answering
        if agent:
            await wait_for(lambda: kid in self.app.channel.connections, what="the agent to connect")
        return conn

    async def close(self) -> None:
        for conn in self.started:
            conn.ws.close()
            try:
                await self.fetch("api", "kernels", conn.id, method="DELETE")
            except Exception:
                pass


async def wait_for(predicate: Any, timeout: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


API_PREFIX = contract.API_ROOT + "/"


def check_response(parts: tuple[Any, ...], method: str, code: int, raw: bytes) -> Any:
    """Check one answer from the server against the REST contract; return its JSON body.

    Paths outside ``api/gpushare/`` are not checked. A path under it that no operation of
    the contract matches must be unrouted (404, or 403 from jupyter_server's XSRF check; any
    body); a method the contract does not
    list for a path must be refused (405, or 403 when a browser request fails jupyter_server's
    XSRF check first) with jupyter_server's JSON error.
    """
    path = "/".join(str(p).strip("/") for p in parts)
    if not path.startswith(API_PREFIX):
        return None
    sub = "/" + path[len(API_PREFIX):]
    op = contract.find_operation(unquote(sub), method)
    routed = contract.find_operation(unquote(sub), None) is not None
    if op is None:
        if not routed and code in (403, 404):
            return None  # not routed: jupyter_server's answer, not ours to describe
        if routed and code in (403, 405):
            body = _json(raw, method, sub, code)
            contract.validator({"$ref": "#/components/schemas/Error"}).validate(body)
            return body
        raise contract.ContractError(f"{method} {sub} answered {code} but is not in the contract")
    body = _json(raw, method, sub, code)
    contract.validate_response(sub, method, code, body)
    return body


def _json(raw: bytes, method: str, path: str, code: int) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise contract.ContractError(f"{method} {path} {code}: the body is not JSON: {raw[:200]!r}") from None


#: seconds a test's REST request may take (pyproject's pytest timeout, 300, bounds the test)
REQUEST_TIMEOUT = 300.0


def validating(fetch: Any) -> Any:
    """``jp_fetch`` that checks every gpushare answer, success or error, against the contract."""
    if getattr(fetch, "checks_contract", False):
        return fetch

    async def fetch_checked(*parts: Any, **kw: Any) -> HTTPResponse:
        method = kw.get("method", "GET")
        # the answer is the event the test waits for: at a load of 45 on 2 cores a release of
        # 1.25 GiB took 17 s in the server, and its request ran past jp_fetch's 20 s default
        kw.setdefault("request_timeout", REQUEST_TIMEOUT)
        try:
            response = await fetch(*parts, **kw)
        except HTTPClientError as e:
            if e.response is not None:
                check_response(parts, method, e.code, e.response.body)
            raise
        check_response(parts, method, response.code, response.body)
        return response

    fetch_checked.checks_contract = True  # type: ignore[attr-defined]
    return fetch_checked


async def rest(jp_fetch: Any, method: str, *parts: Any, body: Any = None, **kw: Any) -> tuple[int, Any]:
    """One gpushare REST call: (status, JSON body), errors included, checked against the
    contract. ``parts`` follow ``api/gpushare/``; a ``body`` that is not bytes is sent as JSON."""
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    if body is None and method in ("POST", "PUT"):
        body = b""
    fetch = validating(jp_fetch)
    try:
        r = await fetch("api", "gpushare", *parts, method=method, body=body, **kw)
    except HTTPClientError as e:
        if e.response is None:
            raise
        return e.code, json.loads(e.response.body)
    return r.code, json.loads(r.body)


async def get_json(jp_fetch: Any, *path: str, **kw: Any) -> Any:
    r = await validating(jp_fetch)(*path, **kw)
    return json.loads(r.body)


async def kernel_status(jp_fetch: Any, kernel_id: str) -> dict[str, Any] | None:
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    for k in status["kernels"]:
        if k["id"] == kernel_id:
            return k
    return None


def unix_user(name: str, why: str) -> int:
    """The uid of a real second Unix user ``name``, created with useradd when missing; the
    test is skipped (saying ``why`` it needs one) where that cannot be done (not root)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip(f"needs useradd to create a second Unix user ({why})")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    return pwd.getpwnam(name).pw_uid


def a_cell(run: Any = lambda: None) -> None:
    """What a request that runs code looks like to the kernel agent's epoch (its wrapped
    request handlers bump it where the request starts and ends)."""
    from jupyter_gpushare.kernel.offload import quiet

    quiet.bump()
    try:
        run()
    finally:
        quiet.bump()
