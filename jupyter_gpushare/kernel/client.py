"""Kernel side of the agent channel: a blocking client with a reader thread.

Requests from the kernel (an allocation, "restore me") wait for their reply on the calling
thread. Requests from the server (lock, checkpoint, trim, ...) run one at a time, in
order, on a handler thread, so a handler that waits (a lock waiting for GPU work to end)
never stops replies from reaching the kernel's main thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from ..protocol import MAX_LINE, ProtocolError, RemoteError, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any] | None]


class AgentClient:
    def __init__(self, path: str, handlers: dict[str, Handler] | None = None):
        self.path = path
        self.handlers: dict[str, Handler] = dict(handlers or {})
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._work: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.connected = False
        self.on_disconnect: Callable[[], None] | None = None

    def connect(self, hello: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Connect and say hello; returns the server's reply or raises RemoteError/OSError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(self.path)
        sock.sendall(encode({"id": 0, "op": "hello", **hello}))
        reader = sock.makefile("rb")
        line = reader.readline(MAX_LINE + 1)
        reply = decode(line) if line else {"ok": False, "error": "server closed the channel"}
        if not reply.get("ok"):
            sock.close()
            raise RemoteError(str(reply.get("error", "refused")))
        sock.settimeout(None)
        self._sock = sock
        self.connected = True
        threading.Thread(target=self._read, args=(reader,), name="gpushare-reader", daemon=True).start()
        threading.Thread(target=self._handle, name="gpushare-handler", daemon=True).start()
        return reply

    def _send(self, message: dict[str, Any]) -> None:
        if self._sock is None or not self.connected:
            raise ConnectionError("not connected to the gpushare server")
        data = encode(message)
        with self._send_lock:
            self._sock.sendall(data)

    def request(self, op: str, timeout: float | None = 30.0, **args: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        done = threading.Event()
        box: list[dict[str, Any]] = []
        self._pending[msg_id] = (done, box)
        try:
            self._send({"id": msg_id, "op": op, **args})
            if not done.wait(timeout):
                raise TimeoutError(f"the gpushare server did not answer {op} in {timeout} s")
        finally:
            self._pending.pop(msg_id, None)
        reply = box[0]
        if not reply.get("ok"):
            raise RemoteError(reply.get("error") or f"{op} failed")
        return reply

    def notify(self, op: str, **args: Any) -> None:
        try:
            self._send({"op": op, **args})
        except OSError:
            pass  # the server is gone; a notification is best effort by definition

    def _read(self, reader) -> None:
        try:
            while True:
                line = reader.readline(MAX_LINE + 1)
                if not line:
                    break
                try:
                    msg = decode(line)
                except ProtocolError:
                    break
                if "re" in msg:
                    pending = self._pending.get(msg["re"])
                    if pending:
                        pending[1].append(msg)
                        pending[0].set()
                else:
                    self._work.put(msg)
        except OSError:
            pass
        finally:
            self.connected = False
            for done, box in list(self._pending.values()):
                box.append({"ok": False, "error": "the gpushare server closed the channel"})
                done.set()
            self._work.put(None)
            if self.on_disconnect:
                self.on_disconnect()

    def _handle(self) -> None:
        while True:
            msg = self._work.get()
            if msg is None:
                return
            op, msg_id = msg.get("op"), msg.get("id")
            handler = self.handlers.get(op) if isinstance(op, str) else None
            try:
                if handler is None:
                    raise LookupError(f"agent has no op {op!r}")
                reply = {"ok": True, **(handler(msg) or {})}
            except Exception as e:
                reply = {"ok": False, "error": str(e) or type(e).__name__, "kind": type(e).__name__}
            if msg_id is not None:
                try:
                    self._send({"re": msg_id, **reply})
                except OSError:
                    return

    def close(self) -> None:
        self.connected = False
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


class RemoteBackend:
    """simgpu accounting on the server's node, through the channel."""

    def __init__(self, client: AgentClient, device_count: int):
        self.client = client
        self._count = device_count

    def alloc(self, gpu: int, nbytes: int) -> None:
        from ..sim.node import SimOutOfMemoryError

        try:
            self.client.request("alloc", gpu=gpu, bytes=nbytes)
        except RemoteError as e:
            msg = str(e)
            if "out of memory" in msg:
                raise SimOutOfMemoryError(msg) from None
            if "invalid device" in msg:
                raise ValueError(msg) from None
            raise RuntimeError(f"simulated GPU allocation failed: {msg}") from None

    def free(self, gpu: int, nbytes: int) -> None:
        self.client.notify("free", gpu=gpu, bytes=nbytes)

    def busy_begin(self, gpu: int) -> None:
        self.client.notify("busy_begin", gpu=gpu)

    def busy_end(self, gpu: int) -> None:
        self.client.notify("busy_end", gpu=gpu)

    def device_count(self) -> int:
        return self._count
