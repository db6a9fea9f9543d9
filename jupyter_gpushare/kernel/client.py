"""Kernel side of the agent channel: a blocking client with a reader thread.

Requests from the kernel (an allocation, "restore me") wait for their reply on the calling
thread. Requests from the server (lock, checkpoint, trim, ...) run one at a time, in
order, on a handler thread, so a handler that waits (a lock waiting for GPU work to end)
never stops replies from reaching the kernel's main thread. A request whose deadline has
passed is refused, not started: the server stopped waiting for it.

When the channel drops, the client reconnects by itself, with backoff, for as long as the
kernel lives; ``on_connect`` runs after every (re)connection, ``on_disconnect`` after every
drop (``on_hello`` first, before any other message of the new connection is read). One
bad line from the server is skipped, never a reason to drop the channel.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..protocol import (
    EXPIRED,
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

Handler = Callable[[dict[str, Any]], dict[str, Any] | None]

READ_CHUNK = 1 << 16
BACKOFF = (0.1, 5.0)  # first retry after 0.1 s, doubling up to 5 s between attempts


class Expired(Exception):
    """A request that arrived (or waited in line) past its deadline."""


def _powers_of_two(n: int) -> bool:
    return n & (n - 1) == 0


class _Waiting:
    """A request sent and not yet answered."""

    def __init__(self, client: AgentClient, op: str, msg_id: int, timeout: float | None):
        self.client, self.op, self.msg_id, self.timeout = client, op, msg_id, timeout
        self.done = threading.Event()
        self.reply: dict[str, Any] = {}
        self.error: Exception | None = None  # set when no reply can come (the channel dropped)

    def answer(self, reply: dict[str, Any]) -> None:
        if not self.done.is_set():
            self.reply = reply
            self.done.set()

    def fail(self, error: Exception) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()

    def wait(self) -> dict[str, Any]:
        try:
            if not self.done.wait(self.timeout):
                raise TimeoutError(f"the gpushare server did not answer {self.op} in {self.timeout} s")
        finally:
            self.client._pending.pop(self.msg_id, None)
        if self.error is not None:
            raise self.error
        if not self.reply.get("ok"):
            raise RemoteError(str(self.reply.get("error") or f"{self.op} failed")[:2000])
        return self.reply


class AgentClient:
    def __init__(
        self,
        path: str,
        handlers: dict[str, Handler] | None = None,
        hello: Callable[[], dict[str, Any]] | None = None,
    ):
        self.path = path  # kept: the environment variable it came from is gone
        self.handlers: dict[str, Handler] = dict(handlers or {})
        self.hello = hello or dict
        #: runs with the hello reply before any other message of that connection is read
        self.on_hello: Callable[[dict[str, Any]], None] | None = None
        #: runs after every (re)connection, once messages flow (it may make requests)
        self.on_connect: Callable[[dict[str, Any]], None] | None = None
        self.on_disconnect: Callable[[], None] | None = None
        self.backoff = BACKOFF
        self.connected = False
        self.last_error = ""  # why the last connection attempt failed
        self.bad_lines = 0
        self.reconnects = 0
        self._sock: socket.socket | None = None
        self._generation = 0  # one per connection; work and replies of an old one are dropped
        self._lock = threading.Lock()  # _sock, _generation, connected
        self._send_lock = threading.RLock()  # reentrant: a GC finalizer may free while we send
        self._ids = itertools.count(1)
        self._pending: dict[int, _Waiting] = {}
        self._work: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self._handler: threading.Thread | None = None
        self._up = threading.Event()
        self._closed = threading.Event()

    # -- connecting -------------------------------------------------------------------
    def open(self) -> bool:
        """Connect now if the server answers (``on_connect`` has run when this returns True);
        otherwise keep trying in the background and return False (``last_error`` says why)."""
        try:
            reply = self.connect()
        except (OSError, RemoteError, ProtocolError) as e:
            self.last_error = str(e) or type(e).__name__
            self._start_reconnecting()
            return False
        self._connected(reply)
        return True

    def connect(self, timeout: float = 10.0) -> dict[str, Any]:
        """One attempt: connect and say hello; the server's reply, or RemoteError/OSError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lines, ready = LineBuffer(), deque[bytes | BadLine]()
        try:
            sock.settimeout(timeout)
            sock.connect(self.path)
            sock.sendall(encode({"id": 0, "op": "hello", **self.hello()}))
            while not ready:
                data = sock.recv(READ_CHUNK)
                if not data:
                    raise RemoteError("the gpushare server closed the channel")
                ready.extend(lines.feed(data))
            first = ready.popleft()
            if isinstance(first, BadLine):
                raise ProtocolError(f"unreadable hello reply: {first.why}")
            reply = decode(first)
            if not reply.get("ok"):
                raise RemoteError(str(reply.get("error") or "refused"))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        if self.on_hello is not None:
            try:
                self.on_hello(reply)
            except Exception:
                log.exception("gpushare agent: on_hello failed")
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._sock, self.connected = sock, True
        self._up.set()
        threading.Thread(target=self._read, args=(sock, lines, ready, generation),
                         name="gpushare-reader", daemon=True).start()
        if self._handler is None:
            self._handler = threading.Thread(target=self._handle, name="gpushare-handler", daemon=True)
            self._handler.start()
        return reply

    def wait_connected(self, timeout: float | None) -> bool:
        return self._up.wait(timeout)

    def _connected(self, reply: dict[str, Any]) -> None:
        self.last_error = ""
        if self.on_connect is not None:
            try:
                self.on_connect(reply)
            except Exception:  # the channel is up; a hook's failure must not take it down
                log.exception("gpushare agent: on_connect failed")

    def _start_reconnecting(self) -> None:
        if not self._closed.is_set():
            threading.Thread(target=self._reconnect, name="gpushare-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        delay, longest = self.backoff
        attempts = 0
        while not self._closed.wait(delay):
            attempts += 1
            try:
                reply = self.connect()
            except (OSError, RemoteError, ProtocolError) as e:
                self.last_error = str(e) or type(e).__name__
                if _powers_of_two(attempts):
                    log.info("gpushare agent: reconnect attempt %d failed: %s", attempts, self.last_error)
                delay = min(delay * 2, longest)
                continue
            self.reconnects += 1
            log.info("gpushare agent: connected to the server after %d attempt(s)", attempts)
            self._connected(reply)
            return

    def _dropped(self, generation: int) -> None:
        with self._lock:
            if generation != self._generation or not self.connected:
                return
            self.connected = False
            self._up.clear()
            sock = self._sock
        if sock is not None:
            sock.close()
        for waiting in list(self._pending.values()):
            waiting.fail(ConnectionError("the gpushare server closed the channel"))
        if self.on_disconnect is not None:
            try:
                self.on_disconnect()
            except Exception:
                log.exception("gpushare agent: on_disconnect failed")
        self._start_reconnecting()

    # -- sending ------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._send_lock:
            with self._lock:
                sock = self._sock if self.connected else None
            if sock is None:
                raise ConnectionError("not connected to the gpushare server")
            sock.sendall(data)

    def send_request(self, op: str, timeout: float | None = 30.0, **args: Any) -> _Waiting:
        """Send a request now; ``.wait()`` on the result for its reply."""
        if timeout is not None and "deadline" not in args:
            args["deadline"] = time.time() + timeout
        msg_id = next(self._ids)
        waiting = _Waiting(self, op, msg_id, timeout)
        self._pending[msg_id] = waiting
        try:
            self._send({"id": msg_id, "op": op, **args})
        except MessageTooLarge as e:
            self._pending.pop(msg_id, None)
            raise RemoteError(str(e)) from None
        except BaseException:
            self._pending.pop(msg_id, None)
            raise
        return waiting

    def request(self, op: str, timeout: float | None = 30.0, **args: Any) -> dict[str, Any]:
        return self.send_request(op, timeout, **args).wait()

    def notify(self, op: str, **args: Any) -> None:
        try:
            self._send({"op": op, **args})
        except MessageTooLarge as e:
            log.warning("gpushare agent: not sent: %s", e)
        except OSError:
            pass  # the server is gone; a notification is best effort by definition

    # -- receiving ------------------------------------------------------------------------
    def _read(self, sock: socket.socket, lines: LineBuffer, ready: deque[bytes | BadLine],
              generation: int) -> None:
        try:
            while True:
                while ready:
                    self._take(ready.popleft(), generation)
                data = sock.recv(READ_CHUNK)
                if not data:
                    break
                ready.extend(lines.feed(data))
        except OSError:
            pass
        finally:
            self._dropped(generation)

    def _take(self, item: bytes | BadLine, generation: int) -> None:
        if isinstance(item, BadLine):
            self._skip(item)
            return
        try:
            msg = decode(item)
        except ProtocolError as e:
            self._skip(bad_line(item, str(e)))
            return
        if "re" in msg:
            key = msg["re"]
            waiting = self._pending.get(key) if isinstance(key, int) else None
            if waiting is not None:
                waiting.answer(msg)
        else:
            self._work.put((generation, msg))

    def _skip(self, bad: BadLine) -> None:
        """A line we cannot use: drop it, fail the request it answers (if it says), go on."""
        self.bad_lines += 1
        if _powers_of_two(self.bad_lines):
            log.warning("gpushare agent: skipped a bad message from the server: %s (%d bytes; "
                        "%d so far)", bad.why, bad.size, self.bad_lines)
        waiting = self._pending.get(bad.reply_to) if bad.reply_to is not None else None
        if waiting is not None:
            waiting.fail(RemoteError(f"the server's reply could not be read: {bad.why} "
                                     f"({bad.size} bytes)"))

    def _handle(self) -> None:
        while True:
            generation, msg = self._work.get()
            if generation != self._generation:
                continue  # from a connection that is gone: nobody waits for its answer
            op, msg_id = msg.get("op"), msg.get("id")
            try:
                if deadline_passed(msg, time.time()):
                    raise Expired(EXPIRED)
                handler = self.handlers.get(op) if isinstance(op, str) else None
                if handler is None:
                    raise LookupError(f"agent has no op {str(op)[:64]!r}")
                reply = {"ok": True, **(handler(msg) or {})}
            except Exception as e:
                reply = {"ok": False, "error": str(e) or type(e).__name__, "kind": type(e).__name__}
            if msg_id is not None:
                self._answer(generation, {"re": msg_id, **reply})

    def _answer(self, generation: int, reply: dict[str, Any]) -> None:
        data = encode(reply)  # a reply too large becomes an error reply that says so
        with self._send_lock:
            with self._lock:
                sock = self._sock if self.connected and generation == self._generation else None
            if sock is None:
                return  # asked on a connection that is gone: its asker gave up
            try:
                sock.sendall(data)
            except OSError:
                pass  # the reader notices the drop and reconnects

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            sock, self.connected = self._sock, False
            self._up.clear()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for waiting in list(self._pending.values()):
            waiting.fail(ConnectionError("the channel to the gpushare server was closed"))


class RemoteBackend:
    """simgpu accounting on the server's node, through the channel.

    It keeps its own ledger of what it told the server (bytes on each GPU, GPUs busy), so
    that after a reconnection ``sync`` sets the server's accounting to exactly that:
    frees and busy ends sent while the channel was down are not lost. Allocations wait
    for the sync (``wait_for_channel`` seconds at most) and never overlap it."""

    def __init__(self, client: AgentClient, device_count: int, wait_for_channel: float = 10.0):
        self.client = client
        self._count = device_count
        self.wait_for_channel = wait_for_channel
        self._cond = threading.Condition()  # an RLock inside: finalizers may free re-entrantly
        self._synced = False  # the server's accounting matches the ledger on this connection
        self._allocating = 0
        self._held: dict[int, int] = {}
        self._busy: dict[int, int] = {}

    def alloc(self, gpu: int, nbytes: int) -> None:
        from ..sim.node import SimOutOfMemoryError

        with self._cond:
            if not self._cond.wait_for(lambda: self._synced, self.wait_for_channel):
                raise RuntimeError("simulated GPU allocation failed: the channel to the gpushare "
                                   f"server is down ({self.client.last_error or 'reconnecting'})")
            self._allocating += 1
        done = False
        try:
            self.client.request("alloc", gpu=gpu, bytes=nbytes)
            done = True
        except RemoteError as e:
            msg = str(e)
            if "out of memory" in msg:
                raise SimOutOfMemoryError(msg) from None
            if "invalid device" in msg:
                raise ValueError(msg) from None
            raise RuntimeError(f"simulated GPU allocation failed: {msg}") from None
        except (OSError, TimeoutError) as e:
            raise RuntimeError(f"simulated GPU allocation failed: {e}") from None
        finally:
            with self._cond:
                self._allocating -= 1
                if done:
                    self._held[gpu] = self._held.get(gpu, 0) + nbytes
                self._cond.notify_all()

    def free(self, gpu: int, nbytes: int) -> None:
        with self._cond:  # sent under the ledger's lock: ordered with a sync's snapshot
            self._held[gpu] = max(0, self._held.get(gpu, 0) - nbytes)
            self.client.notify("free", gpu=gpu, bytes=nbytes)

    def busy_begin(self, gpu: int, sm: float = 100.0) -> None:
        with self._cond:
            self._busy[gpu] = self._busy.get(gpu, 0) + 1
            if sm == 100.0:  # the default: what a server that predates sm reads too
                self.client.notify("busy_begin", gpu=gpu)
            else:
                self.client.notify("busy_begin", gpu=gpu, sm=sm)

    def busy_end(self, gpu: int) -> None:
        with self._cond:
            self._busy[gpu] = max(0, self._busy.get(gpu, 0) - 1)
            self.client.notify("busy_end", gpu=gpu)

    def busy_work(self, gpu: int) -> tuple[float, float]:
        """(s of full-speed work done on ``gpu`` since busy_begin, the speed now), the node's."""
        try:
            reply = self.client.request("busy_work", gpu=gpu)
        except (RemoteError, OSError, TimeoutError) as e:
            raise RuntimeError(f"simulated GPU compute failed: {e}") from None
        return float(reply.get("work", 0.0)), float(reply.get("speed", 1.0))

    def device_count(self) -> int:
        return self._count

    def held(self) -> dict[int, int]:
        with self._cond:
            return {g: n for g, n in self._held.items() if n}

    def channel_lost(self) -> None:
        with self._cond:
            self._synced = False

    def sync(self) -> None:
        """Tell the server exactly what this process holds (after every connection)."""
        with self._cond:
            self._cond.wait_for(lambda: self._allocating == 0, 30)
            gpus = {str(g): n for g, n in self._held.items() if n}
            busy = sorted(g for g, n in self._busy.items() if n)
            try:
                waiting = self.client.send_request("sync", gpus=gpus, busy=busy)
            except OSError as e:
                log.info("gpushare agent: sync not sent (%s); the next connection sends it", e)
                return
        try:
            waiting.wait()
        except (OSError, TimeoutError) as e:  # the channel dropped again: the next one syncs
            log.info("gpushare agent: sync failed (%s); the next connection sends it", e)
            return
        except RemoteError as e:  # refused: allocations go on; the server keeps its count
            log.warning("gpushare agent: the server refused the simulated GPU sync: %s", e)
        with self._cond:
            self._synced = True
            self._cond.notify_all()
