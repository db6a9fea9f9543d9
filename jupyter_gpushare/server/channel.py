"""Server side of the agent channel: a Unix socket between the server and kernel agents.

Security: the socket lives in the Jupyter runtime directory with mode 0600; every peer's
uid (SO_PEERCRED) must be ours, and its pid must belong to the kernel it claims to be
(``authorize``). Anything else is refused with a reason and disconnected, and nothing is
changed on its behalf.

Robustness: one bad line (too long, not JSON) is skipped and logged, never closes the
channel; a reply that answers a request but cannot be read fails that request at once;
replies are checked (``check_reply``) before a caller sees them; the listening socket is
re-bound when its file disappears (``heal``), and agents reconnect by themselves.
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
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ..protocol import (
    BadLine,
    LineBuffer,
    MessageTooLarge,
    ProtocolError,
    RemoteError,
    bad_line,
    deadline_passed,
    decode,
    encode,
)

log = logging.getLogger(__name__)

Handler = Callable[["AgentConnection", dict[str, Any]], Any]
#: raises ValueError (why) when an agent's reply to ``op`` is malformed
ReplyCheck = Callable[[str, dict[str, Any]], None]

READ_CHUNK = 1 << 16
HELLO_TIMEOUT = 10.0
#: s: the first refused peer is logged in full, the others of each such interval as one count
REFUSAL_LOG_INTERVAL = 60.0


class Refused(Exception):
    """A peer that may not use the channel; ``str()`` is told to it."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (Linux)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


PRIVATE_NAME = "agent.sock"  # the socket's name in a directory made for it (removed with it)


def socket_path(directory: str, instance: int = 1) -> str:
    """A per-server socket path short enough for AF_UNIX (108 bytes): ``gpushare-<pid>.sock``
    (``gpushare-<pid>-<n>.sock`` for the n-th server initialized in one process)."""
    suffix = "" if instance <= 1 else f"-{instance}"
    path = os.path.join(directory, f"gpushare-{os.getpid()}{suffix}.sock")
    if len(path.encode()) < 100:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="gpushare-"), PRIVATE_NAME)


def _powers_of_two(n: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th ... occurrence: a flood costs a few log lines, not one each."""
    return n & (n - 1) == 0


class _Lines:
    """Lines (or BadLines) from a stream; None at the end."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.buffer = LineBuffer()
        self.ready: deque[bytes | BadLine] = deque()

    async def next(self) -> bytes | BadLine | None:
        while not self.ready:
            data = await self.reader.read(READ_CHUNK)
            if not data:
                return None
            self.ready.extend(self.buffer.feed(data))
        return self.ready.popleft()


class AgentConnection:
    """One connected kernel agent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int,
                 check_reply: ReplyCheck | None = None):
        self.reader = reader
        self.writer = writer
        self.pid = pid
        self.kernel_id: str = ""
        self.frameworks: list[str] = []
        self.report: dict[str, Any] = {}  # the agent's latest valid self-report (framework memory)
        self.check_reply = check_reply
        self.replaced = False  # a newer connection of the same kernel took over
        self.bad_lines = 0  # lines skipped (too long, not a message), for logs and tests
        self.refused_notes = 0  # notifications refused for bad fields
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.closed = asyncio.Event()

    async def request(self, op: str, timeout: float | None = 30.0, **args: Any) -> dict[str, Any]:
        """Ask the agent to do ``op``; its checked reply, or RemoteError / TimeoutError /
        ConnectionError. With a timeout the request carries a deadline, so the agent never
        starts it after we stopped waiting."""
        if self.closed.is_set():
            raise ConnectionError(f"agent of kernel {self.kernel_id} is disconnected")
        if timeout is not None and "deadline" not in args:
            args["deadline"] = time.time() + timeout
        msg_id = next(self._ids)
        try:
            data = encode({"id": msg_id, "op": op, **args})
        except MessageTooLarge as e:
            raise RemoteError(str(e)) from None
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        try:
            self.writer.write(data)
            await self.writer.drain()
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(msg_id, None)
        if not reply.get("ok"):
            raise RemoteError(str(reply.get("error") or f"agent refused {op}")[:2000],
                              str(reply.get("kind") or ""))
        if self.check_reply is not None:
            try:
                self.check_reply(op, reply)
            except ValueError as e:
                raise RemoteError(f"bad reply from the agent to {op}: {e}") from None
        return reply

    def notify(self, op: str, **args: Any) -> None:
        if self.closed.is_set():
            return
        try:
            self.writer.write(encode({"op": op, **args}))
        except MessageTooLarge as e:
            log.warning("gpushare: not sent to kernel %s: %s", self.kernel_id, e)

    def _resolve(self, reply: dict[str, Any]) -> None:
        key = reply.get("re")
        fut = self._pending.get(key) if isinstance(key, int) else None
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _fail(self, msg_id: int, why: str) -> None:
        fut = self._pending.get(msg_id)
        if fut is not None and not fut.done():
            fut.set_exception(RemoteError(why))

    def _close(self) -> None:
        # (waking a waiter schedules it on the loop: that fails once the loop has closed)
        with contextlib.suppress(RuntimeError):
            self.closed.set()
        for fut in self._pending.values():
            if not fut.done():
                with contextlib.suppress(RuntimeError):
                    fut.set_exception(ConnectionError("agent disconnected"))
        with contextlib.suppress(Exception):
            self.writer.close()
        transport = self.writer.transport
        loop = getattr(transport, "_loop", None)
        if loop is not None and loop.is_closed():
            # a server abandoned after its event loop ended (one left for another server in
            # this process): close() could not schedule the socket's closing, so close it
            # here, or the garbage collector does, with a ResourceWarning, at a random moment
            with contextlib.suppress(Exception):
                transport._call_connection_lost(None)  # type: ignore[attr-defined]


class AgentServer:
    """Accepts agents, checks who they are, and dispatches their requests to handlers."""

    def __init__(
        self,
        path: str,
        authorize: Callable[[str, int], Awaitable[None]],
        handlers: dict[str, Handler],
        on_connect: Callable[[AgentConnection], Any] | None = None,
        on_disconnect: Callable[[AgentConnection], Any] | None = None,
        hello_reply: Callable[[str], dict[str, Any]] | None = None,
        check_reply: ReplyCheck | None = None,
    ):
        self.path = path
        self.authorize = authorize
        self.handlers = handlers
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        #: kernel_id -> fields for that kernel's hello reply (e.g. its gpushare state)
        self.hello_reply = hello_reply
        self.check_reply = check_reply
        self.connections: dict[str, AgentConnection] = {}  # kernel_id -> newest connection
        self.refusals = 0
        self.refusal_log_interval = REFUSAL_LOG_INTERVAL
        self._unlogged: tuple[int, str] = (0, "")  # refusals since the last line, the last why
        self._refusal_timer: asyncio.TimerHandle | None = None  # an interval is open
        self.rebinds = 0  # times the socket file was found gone and bound again
        self.hello_extra: dict[str, Any] = {}  # sent to every agent in the hello reply
        self._server: asyncio.AbstractServer | None = None
        self._sock: socket.socket | None = None  # bound and listening, not yet served
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file
        self._heal_failed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def bind(self) -> None:
        """Create the socket file and listen on it, now (no event loop needed), so that a
        directory where it cannot be created fails the extension's load, not a later start."""
        if self._sock is None and self._server is None:
            self._sock = self._listening_socket()

    async def start(self) -> None:
        """Serve agents on the bound socket (bound here if ``bind`` was not called)."""
        if self._server is not None:
            return
        self.bind()
        sock, self._sock = self._sock, None
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    def _listening_socket(self) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is created 0600, never briefly wider
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
            st = os.stat(self.path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        self._bound = (st.st_dev, st.st_ino)
        return sock

    async def _bind(self) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._serve, sock=self._listening_socket())

    def owns_file(self) -> bool:
        """The socket file at ``path`` is the one this server bound (not a successor's)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._bound

    def remove_file(self) -> None:
        """Delete the socket file if it is ours (process exit without a clean stop, e.g. a
        SIGINT without a terminal; a stop). Never another server's file at the same path."""
        if self.owns_file():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if os.path.basename(self.path) == PRIVATE_NAME:  # socket_path's own directory
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(self.path))

    def close_now(self) -> None:
        """Stop listening and drop every agent at once, without the event loop running (a
        server that was abandoned for another in the same process). ``stop`` is the clean way."""
        if self._refusal_timer is not None:  # the loop may be gone: no summary line
            self._refusal_timer.cancel()
            self._refusal_timer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.connections.values()):
            conn._close()
        self.remove_file()

    async def heal(self) -> bool:
        """Listen again if our socket file was removed or replaced (an admin cleaning the
        runtime directory); True when it re-bound. Cheap: one ``stat`` when all is well.
        Connected agents are not affected; dropped ones reconnect by themselves."""
        if self._server is None:
            return False
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._bound:
                return False
        old = self._server
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            self._server = await self._bind()
        except OSError as e:
            if not self._heal_failed:
                self._heal_failed = True
                log.error("gpushare agent channel: socket %s is gone and cannot be bound again "
                          "(%s); kernel agents cannot reconnect until it can", self.path, e)
            return False
        old.close()  # the orphaned listener; connections it accepted stay open
        self._heal_failed = False
        self.rebinds += 1
        log.warning("gpushare agent channel: socket %s was removed or replaced; listening there "
                    "again", self.path)
        return True

    async def stop(self) -> None:
        """Stop listening, drop every agent, remove the socket file. Safe to call twice."""
        self._flush_refusals()
        if self._sock is not None:  # bound, never served
            self._sock.close()
            self._sock = None
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections.values()):
                conn._close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
        self.remove_file()

    def _log_refusal(self, why: str) -> None:
        """The first refused peer in full; the rest of each interval as one count (a flood of
        connections from another process must not flood the log)."""
        if self._refusal_timer is None:
            log.warning("gpushare agent channel: refused a peer: %s", why)
            self._refusal_timer = asyncio.get_running_loop().call_later(
                self.refusal_log_interval, self._refusal_summary)
        else:
            self._unlogged = (self._unlogged[0] + 1, why)

    def _refusal_summary(self, closing: bool = False) -> None:
        n, why = self._unlogged
        self._unlogged = (0, "")
        self._refusal_timer = None
        if n:
            log.warning("gpushare agent channel: refused %d more peer(s) in the last %.0f s (the "
                        "last: %s)", n, self.refusal_log_interval, why)
            if not closing:  # still refusing: the next interval is counted as well
                self._refusal_timer = asyncio.get_running_loop().call_later(
                    self.refusal_log_interval, self._refusal_summary)

    def _flush_refusals(self) -> None:
        if self._refusal_timer is not None:
            self._refusal_timer.cancel()
            self._refusal_summary(closing=True)

    async def _refuse(self, writer: asyncio.StreamWriter, reply_to: Any, why: str) -> None:
        self.refusals += 1
        self._log_refusal(why)
        if not isinstance(reply_to, (int, str)) or len(str(reply_to)) > 64:
            reply_to = None
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
        lines = _Lines(reader)
        try:
            first = await asyncio.wait_for(lines.next(), HELLO_TIMEOUT)
            if first is None:
                raise ProtocolError("the peer closed the connection")
            if isinstance(first, BadLine):
                raise ProtocolError(f"{first.why} ({first.size} bytes)")
            hello = decode(first)
        except (ProtocolError, asyncio.TimeoutError, ConnectionError) as e:
            await self._refuse(writer, None, f"no valid hello ({e or type(e).__name__})")
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
        conn = AgentConnection(reader, writer, pid, self.check_reply)
        conn.kernel_id = kernel_id
        frameworks = hello.get("frameworks")
        conn.frameworks = [str(f)[:64] for f in frameworks[:16]] if isinstance(frameworks, list) else []
        previous = self.connections.get(kernel_id)
        if previous is not None and previous.pid == pid:
            conn.report = previous.report  # the same process again: its last report still holds
        if self.on_connect:  # before the hello reply, so the state it carries is current
            try:
                await _maybe_await(self.on_connect(conn))
            except Exception:
                log.exception("gpushare: on_connect failed for kernel %s", kernel_id)
        writer.write(encode({"re": hello.get("id"), "ok": True, "server_pid": os.getpid(),
                             **self.hello_extra, **self._hello_fields(kernel_id)}))
        self.connections[kernel_id] = conn
        if previous is not None and previous is not conn:
            previous.replaced = True
            previous._close()
        try:
            await self._read_loop(conn, lines)
        finally:
            conn._close()
            if self.connections.get(kernel_id) is conn:
                del self.connections[kernel_id]
            if self.on_disconnect:
                try:
                    await _maybe_await(self.on_disconnect(conn))
                except Exception:
                    log.exception("gpushare: on_disconnect failed for kernel %s", kernel_id)

    def _hello_fields(self, kernel_id: str) -> dict[str, Any]:
        if self.hello_reply is None:
            return {}
        try:
            return dict(self.hello_reply(kernel_id))
        except Exception:  # the hello must not fail over an extra
            log.exception("gpushare: hello_reply failed for kernel %s", kernel_id)
            return {}

    async def _read_loop(self, conn: AgentConnection, lines: _Lines) -> None:
        while True:
            try:
                item = await lines.next()
            except ConnectionError:
                return
            if item is None:
                return
            if isinstance(item, BadLine):
                self._skip(conn, item)
                continue
            try:
                msg = decode(item)
            except ProtocolError as e:
                self._skip(conn, bad_line(item, str(e)))
                continue
            if "re" in msg:
                conn._resolve(msg)
                continue
            task = asyncio.ensure_future(self._dispatch(conn, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _skip(self, conn: AgentConnection, bad: BadLine) -> None:
        """A line we cannot use: drop it, fail the request it answers (if it says), go on."""
        conn.bad_lines += 1
        if _powers_of_two(conn.bad_lines):
            log.warning("gpushare: skipped a bad message from kernel %s: %s (%d bytes; %d so far)",
                        conn.kernel_id, bad.why, bad.size, conn.bad_lines)
        if bad.reply_to is not None:
            conn._fail(bad.reply_to, f"the agent's reply could not be read: {bad.why} "
                                     f"({bad.size} bytes)")

    async def _dispatch(self, conn: AgentConnection, msg: dict[str, Any]) -> None:
        op, msg_id = msg.get("op"), msg.get("id")
        result = await self._run(conn, op, msg)
        if msg_id is None:
            if not result["ok"]:
                conn.refused_notes += 1
                if _powers_of_two(conn.refused_notes):
                    log.warning("gpushare: refused %s from kernel %s: %s (%d so far)",
                                str(op)[:64], conn.kernel_id, result["error"], conn.refused_notes)
        elif not conn.closed.is_set():
            conn.writer.write(encode({"re": msg_id, **result}))

    async def _run(self, conn: AgentConnection, op: Any, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            if deadline_passed(msg, time.time()):
                return {"ok": False, "error": "expired: the agent stopped waiting", "kind": "Expired"}
        except ValueError as e:
            return {"ok": False, "error": str(e), "kind": "ValueError"}
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown op {str(op)[:64]!r}", "kind": "LookupError"}
        try:
            value = await _maybe_await(handler(conn, msg))
        except Exception as e:  # an agent's bad request must not hurt the server
            if not isinstance(e, (ValueError, LookupError, RuntimeError, MemoryError)):
                log.exception("gpushare: handler for %s failed", op)
            return {"ok": False, "error": str(e) or type(e).__name__, "kind": type(e).__name__}
        return {"ok": True, **(value or {})}


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value
