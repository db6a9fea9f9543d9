"""Server side of the agent channel: a Unix socket between the server and kernel agents.

Security: the socket lives in the Jupyter runtime directory with mode 0600; every peer's
uid (SO_PEERCRED) must be ours, and its pid must belong to the kernel it claims to be
(``authorize``). Anything else is refused with a reason and disconnected, and nothing is
changed on its behalf.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from .protocol import MAX_LINE, ProtocolError, RemoteError, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[["AgentConnection", dict[str, Any]], Any]


class Refused(Exception):
    """A peer that may not use the channel; ``str()`` is told to it."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (Linux)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def socket_path(runtime_dir: str) -> str:
    """A per-server socket path short enough for AF_UNIX (108 bytes)."""
    path = os.path.join(runtime_dir, f"gpushare-{os.getpid()}.sock")
    if len(path.encode()) < 100:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="gpushare-"), "agent.sock")


class AgentConnection:
    """One connected kernel agent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int):
        self.reader = reader
        self.writer = writer
        self.pid = pid
        self.kernel_id: str = ""
        self.frameworks: list[str] = []
        self.report: dict[str, Any] = {}  # the agent's latest self-report (framework memory)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.closed = asyncio.Event()

    async def request(self, op: str, timeout: float | None = 30.0, **args: Any) -> dict[str, Any]:
        """Ask the agent to do ``op``; its reply, or RemoteError / TimeoutError / ConnectionError."""
        if self.closed.is_set():
            raise ConnectionError(f"agent of kernel {self.kernel_id} is disconnected")
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        try:
            self.writer.write(encode({"id": msg_id, "op": op, **args}))
            await self.writer.drain()
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(msg_id, None)
        if not reply.get("ok"):
            raise RemoteError(str(reply.get("error") or f"agent refused {op}"), str(reply.get("kind") or ""))
        return reply

    def notify(self, op: str, **args: Any) -> None:
        if not self.closed.is_set():
            self.writer.write(encode({"op": op, **args}))

    def _resolve(self, reply: dict[str, Any]) -> None:
        fut = self._pending.get(reply.get("re"))  # type: ignore[arg-type]
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _close(self) -> None:
        self.closed.set()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("agent disconnected"))
        with contextlib.suppress(Exception):
            self.writer.close()


class AgentServer:
    """Accepts agents, checks who they are, and dispatches their requests to handlers."""

    def __init__(
        self,
        path: str,
        authorize: Callable[[str, int], Awaitable[None]],
        handlers: dict[str, Handler],
        on_connect: Callable[[AgentConnection], Any] | None = None,
        on_disconnect: Callable[[AgentConnection], Any] | None = None,
    ):
        self.path = path
        self.authorize = authorize
        self.handlers = handlers
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self.connections: dict[str, AgentConnection] = {}  # kernel_id -> newest connection
        self.refusals = 0
        self.hello_extra: dict[str, Any] = {}  # sent to every agent in the hello reply
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        old_umask = os.umask(0o177)  # the socket is created 0600, never briefly wider
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=self.path, limit=MAX_LINE
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections.values()):
                conn._close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _refuse(self, writer: asyncio.StreamWriter, reply_to: Any, why: str) -> None:
        self.refusals += 1
        log.warning("gpushare agent channel: refused a peer: %s", why)
        with contextlib.suppress(Exception):
            writer.write(encode({"re": reply_to, "ok": False, "error": f"refused: {why}"}))
            await writer.drain()
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _ = peer_credentials(sock)
        except OSError as e:
            await self._refuse(writer, None, f"cannot read peer credentials ({e})")
            return
        if uid != os.getuid():
            await self._refuse(writer, None, f"peer uid {uid} is not the server's uid {os.getuid()}")
            return
        try:
            hello = decode(await asyncio.wait_for(reader.readline(), 10))
        except (ProtocolError, asyncio.TimeoutError, ValueError, ConnectionError) as e:
            await self._refuse(writer, None, f"no valid hello ({e})")
            return
        kernel_id = hello.get("kernel_id")
        if hello.get("op") != "hello" or not isinstance(kernel_id, str) or not kernel_id:
            await self._refuse(writer, hello.get("id"), "the first message must be a hello with a kernel_id")
            return
        try:
            await self.authorize(kernel_id, pid)
        except Refused as e:
            await self._refuse(writer, hello.get("id"), str(e))
            return
        conn = AgentConnection(reader, writer, pid)
        conn.kernel_id = kernel_id
        frameworks = hello.get("frameworks")
        conn.frameworks = [str(f) for f in frameworks] if isinstance(frameworks, list) else []
        previous = self.connections.get(kernel_id)
        self.connections[kernel_id] = conn
        writer.write(encode({"re": hello.get("id"), "ok": True, "server_pid": os.getpid(),
                             **self.hello_extra}))
        if previous is not None and previous is not conn:
            previous._close()
        if self.on_connect:
            await _maybe_await(self.on_connect(conn))
        try:
            await self._read_loop(conn)
        finally:
            conn._close()
            if self.connections.get(kernel_id) is conn:
                del self.connections[kernel_id]
            if self.on_disconnect:
                with contextlib.suppress(Exception):
                    await _maybe_await(self.on_disconnect(conn))

    async def _read_loop(self, conn: AgentConnection) -> None:
        while True:
            try:
                line = await conn.reader.readline()
            except (ConnectionError, ValueError):  # ValueError: line over the limit
                return
            if not line:
                return
            try:
                msg = decode(line)
            except ProtocolError as e:
                log.warning("gpushare: bad message from kernel %s: %s", conn.kernel_id, e)
                return
            if "re" in msg:
                conn._resolve(msg)
                continue
            task = asyncio.ensure_future(self._dispatch(conn, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, conn: AgentConnection, msg: dict[str, Any]) -> None:
        op, msg_id = msg.get("op"), msg.get("id")
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            result: dict[str, Any] = {"ok": False, "error": f"unknown op {op!r}"}
        else:
            try:
                value = await _maybe_await(handler(conn, msg))
                result = {"ok": True, **(value or {})}
            except Exception as e:  # an agent's bad request must not hurt the server
                if not isinstance(e, (ValueError, LookupError, RuntimeError, MemoryError)):
                    log.exception("gpushare: handler for %s failed", op)
                result = {"ok": False, "error": str(e) or type(e).__name__,
                          "kind": type(e).__name__}
        if msg_id is not None and not conn.closed.is_set():
            conn.writer.write(encode({"re": msg_id, **result}))


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value
