"""The node daemon: per-GPU restore turns owned by a trusted party, on a node whose users do not
trust each other.

Lock files (:mod:`.node_locks`) only serialize servers that can all trust one directory; a
user who can hold a lock file can also hold it for ever. The daemon is the alternative an admin
runs once per node, as root (a systemd unit) or as a DaemonSet where the hub is elsewhere
(``jupyter gpushare node-daemon --socket PATH``). Servers configured with
``GPUShareApp.node_daemon_socket`` (or the environment variable
``JUPYTER_GPUSHARE_NODE_DAEMON``) ask it for their restore turns instead of taking lock files.

Who is who: the daemon listens on a Unix socket (mode 0666 by default, in a directory only
root can write) and identifies every connection by the kernel's ``SO_PEERCRED`` (pid, uid; the
uid is named through ``pwd``), never by anything the client says; it logs each turn by user.
The servers check the daemon the same way: its process must run as root or as their own user.

What a user can do to others: take a turn on a GPU for at most ``--turn-timeout`` seconds
(then it is revoked, the holder is told, the log names the user, and the next waiter is
served); keep at most ``--max-connections-per-user`` connections. Waiters are served by user in
turn (the user served least recently first), so one user's many connections wait behind other
users, not ahead of them. Nothing a client sends can crash the daemon or change another
connection's turn.

Protocol: JSON lines (UTF-8, one object per line, at most 64 KiB). Every request gets one
reply with ``"ok"`` and the ``"op"`` it answers (an optional ``"id"`` is echoed back):

- ``{"op": "hello"}`` -> ``{"ok": true, "op": "hello", "version": ..., "uid": ..., "user":
  ..., "pid": ..., "turn_timeout": ...}``: what the daemon knows of the caller.
- ``{"op": "turn", "gpus": [uuid, ...]}`` -> ``{"ok": true, "op": "turn", "state":
  "granted", "gpus": [...]}`` once every listed GPU's turn is free (all at once, never part of
  them: two requests never wait on each other crosswise). When they are not free at once, first
  ``{"ok": true, "op": "turn", "state": "waiting", "holders": {uuid: {"pid", "user", "left"}},
  "left": s}`` (``left``: seconds until those turns are revoked at the latest), then the
  ``granted`` line. One turn request per connection at a time.
- ``{"op": "done"}`` -> ``{"ok": true, "op": "done", "released": [...]}``: the turns (or the
  wait) given back. Closing the connection does the same, at once.
- ``{"op": "free", "gpus": [uuid, ...]}`` (``gpus`` optional: all) -> ``{"ok": true, "op":
  "free", "free": {uuid: bytes or null}}``: the daemon's own reading of free memory.
- ``{"op": "placed", "server": token, "gpus": {uuid: {"bytes": n, "kernels": n, "returning":
  n}, ...}}`` -> ``{"ok": true, "op": "placed", "others": {uuid: {...}}, "ttl": s}``: the
  caller's kernels placed and not using their GPUs yet (what they are expected to take, how
  many) and its released kernels' states replace its previous claim (``{}`` withdraws it; a
  claim not renewed within ``ttl`` s is dropped), and the answer sums every other server's
  (:mod:`.placed_claims`; a server is its uid, pid and token).
- A turn held past the timeout: ``{"event": "revoked", "gpus": [...], "held_s": s,
  "reason": ...}``, unasked.
- Anything else (not JSON, not an object, an unknown op, a field of the wrong type, a line over
  64 KiB, a GPU the node does not have) -> ``{"ok": false, "error": "why"}``, and nothing
  changes.

With ``--listen HOST:PORT --secret-file PATH`` it also measures the node for a hub service that
runs elsewhere (:mod:`.daemon_service`): GPUs, each process's GPU memory, whose it is and its
host memory, by the same code the service uses on a node it runs on (:mod:`.measure`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import pwd
import re
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from .daemon_service import DEFAULT_PORT, ServiceDoor, load_secret, parse_address
from .measure import Meter, encode
from .placed_claims import (
    CLAIM_TTL,
    MAX_CLAIMS_PER_USER,
    ClaimError,
    PlacedClaims,
    parse_claim,
    parse_token,
)
from .placed_claims import encode as encode_claims

log = logging.getLogger("jupyter_gpushare.node.daemon")

MAX_LINE = 64 * 1024  # bytes of one request line
MAX_GPUS = 64  # GPUs in one request
MAX_KEY = 256  # characters of one GPU UUID
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*\Z")
DEFAULT_TURN_TIMEOUT = 60.0
DEFAULT_PER_USER = 16
MAX_CONNECTIONS = 1024  # all users together
MAX_WRITE_BUFFER = 1 << 20  # a client that does not read its replies is dropped past this
LOG_EVERY = 10.0  # s between two log lines of one kind for one user
DEVICES_EVERY = 1.0  # s between two re-reads of the node's GPU list on an unknown UUID
BACKENDS = ("nvml", "simulated", "none")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    user: str

    def __str__(self) -> str:
        return f"user {self.user} (uid {self.uid}, pid {self.pid})"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return f"uid {uid}"


def peer_of(sock: socket.socket) -> Peer:
    """Who is at the other end of a Unix socket, as the kernel recorded it at connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid, user_name(uid))


class RateLimitedLog:
    """One log line per (who, what) per ``every`` seconds; the ones left out are counted and
    said with the next one."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY):
        self.log = logger
        self.every = every
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def __call__(self, level: int, who: str, what: str, text: str) -> None:
        now = time.monotonic()
        key = (who, what)
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every:
            self._last[key] = (last[0], last[1] + 1)
            return
        left_out = last[1] if last is not None else 0
        self._last[key] = (now, 0)
        if len(self._last) > 4096:  # forget old keys: a bound on memory, not on lines
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every}
        extra = f" ({left_out} similar lines left out)" if left_out else ""
        self.log.log(level, "%s%s", text, extra)


@dataclass(eq=False)
class Request:
    """One connection's turn request: waiting, then holding."""

    conn: Connection
    gpus: tuple[str, ...]
    seq: int
    asked: float = field(default_factory=time.monotonic)
    granted: float | None = None
    timer: asyncio.TimerHandle | None = None


class Turns:
    """The turn of every GPU: who holds it, who waits, served by user in turn."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.holders: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self._seq = 0
        self._served = 0
        self._last_served: dict[int, int] = {}  # uid -> when (a grant count) it was last served

    def ask(self, conn: Connection, gpus: tuple[str, ...]) -> Request:
        self._seq += 1
        req = Request(conn, gpus, self._seq)
        self.waiting.append(req)
        self.dispatch()
        return req

    def dispatch(self) -> None:
        """Grant every waiting request whose GPUs are all free, the user served least
        recently first; a request that cannot be granted keeps its GPUs from those after it
        (a request for several GPUs is never passed over for ever)."""
        blocked = set(self.holders)
        order = sorted(self.waiting, key=lambda r: (self._last_served.get(r.conn.peer.uid, 0), r.seq))
        for req in order:
            if blocked.isdisjoint(req.gpus):
                self._grant(req)
            blocked.update(req.gpus)

    def _grant(self, req: Request) -> None:
        self.waiting.remove(req)
        self._served += 1
        self._last_served[req.conn.peer.uid] = self._served
        req.granted = time.monotonic()
        for gpu in req.gpus:
            self.holders[gpu] = req
        req.timer = asyncio.get_running_loop().call_later(self.timeout, self._revoke, req)
        waited = req.granted - req.asked
        log.info("turn of GPU %s granted to %s%s", ", ".join(req.gpus), req.conn.peer,
                 f" after waiting {waited:.1f} s" if waited >= 0.05 else "")
        req.conn.send({"ok": True, "op": "turn", "state": "granted", "gpus": list(req.gpus)})

    def _revoke(self, req: Request) -> None:
        if req.granted is None or self.holders.get(req.gpus[0]) is not req:
            return
        held = time.monotonic() - req.granted
        reason = (f"held for over {self.timeout:g} s (the node daemon's --turn-timeout); the "
                  "next waiter is served")
        log.warning("turn of GPU %s revoked from %s: %s", ", ".join(req.gpus), req.conn.peer,
                    reason)
        self._drop(req)
        req.conn.request = None
        req.conn.send({"event": "revoked", "gpus": list(req.gpus), "held_s": round(held, 3),
                       "reason": reason})
        self.dispatch()

    def give_back(self, req: Request) -> None:
        """The request's turns (or its wait) end; later waiters go on."""
        if req.granted is not None and self.holders.get(req.gpus[0]) is req:
            log.info("turn of GPU %s given back by %s after %.1f s", ", ".join(req.gpus),
                     req.conn.peer, time.monotonic() - req.granted)
        self._drop(req)
        self.dispatch()

    def _drop(self, req: Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        if req in self.waiting:
            self.waiting.remove(req)
        for gpu in req.gpus:
            if self.holders.get(gpu) is req:
                del self.holders[gpu]

    def holders_of(self, gpus: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        out = {}
        for gpu in gpus:
            req = self.holders.get(gpu)
            if req is not None and req.granted is not None:
                out[gpu] = {"pid": req.conn.peer.pid, "user": req.conn.peer.user,
                            "left": round(max(0.0, req.granted + self.timeout - now), 3)}
        return out


class Free:
    """The daemon's own reading of the node's free memory (and, for the hub service, of the
    whole node: :meth:`measure`), from a telemetry backend, read on one thread of its own
    (NVML and SQLite calls block)."""

    def __init__(self, backend: str, simulated_node: str = "", unix_user: str = "{username}",
                 context_bytes: int | None = None):
        self.backend = backend
        self.simulated_node = simulated_node
        self.unix_user = unix_user
        self.context_bytes = context_bytes
        self.meter: Meter | None = None
        self.telemetry: Any = None
        self.reason = ""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpushare-free")
        self._uuids: dict[str, int] = {}
        self._read_at = float("-inf")

    def open(self) -> str:
        """Open the backend; "" or why it is unavailable (the daemon still serves turns)."""
        if self.backend == "none":
            self.reason = "no backend (--backend none)"
            return self.reason
        if self.backend == "simulated":
            from ..sim.shared import SharedSimNode
            from ..telemetry.simulated import SimulatedTelemetry

            if not self.simulated_node or not os.path.exists(self.simulated_node):
                raise ValueError(f"--simulated-node {self.simulated_node or '(not given)'}: "
                                 "no such file (a server that uses it creates it)")
            self.telemetry = SimulatedTelemetry(SharedSimNode(self.simulated_node))
        else:
            from ..telemetry.nvml import NVMLTelemetry

            self.telemetry = NVMLTelemetry(log)
        status = self.telemetry.open()
        if not status.available:
            self.reason = status.reason or "unavailable"
        self._refresh()
        default_context = 0 if self.backend == "simulated" else 768 << 20  # as the service's
        self.meter = Meter(self.telemetry, self.backend, self.unix_user,
                           default_context if self.context_bytes is None else self.context_bytes)
        return self.reason

    async def measure(self, servers: list[tuple[str, str, list[int]]],
                      users: list[str]) -> dict[str, Any]:
        """The node and each server's pids as :meth:`Meter.read_servers` reads them, on the
        wire (the hub service's ``measure``)."""
        if self.meter is None or self.reason:
            raise RuntimeError(f"this daemon cannot measure the node: {self.reason or 'no backend'}")
        meter = self.meter
        node, each = await self._call(lambda: meter.read_servers(servers, users))
        return {"node": encode(node), "servers": [encode(m, whole=False) for m in each]}

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        self._pool.shutdown(wait=False)

    def _refresh(self) -> None:
        self._read_at = time.monotonic()
        if self.telemetry is None or self.reason:
            return
        try:
            self._uuids = {d.uuid: d.index for d in self.telemetry.devices()}
        except Exception as e:  # a backend's fault: turns go on, the GPU list stays
            log.warning("reading the node's GPUs failed: %s", e)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def unknown(self, gpus: tuple[str, ...]) -> list[str]:
        """Of ``gpus``, those this node does not have (none when its GPUs cannot be read)."""
        if self.telemetry is None or self.reason:
            return []
        missing = [g for g in gpus if g not in self._uuids]
        if missing and time.monotonic() - self._read_at >= DEVICES_EVERY:
            await self._call(self._refresh)
            missing = [g for g in gpus if g not in self._uuids]
        return missing if self._uuids else []

    async def read(self, gpus: tuple[str, ...] | None) -> dict[str, int | None]:
        if self.telemetry is None or self.reason:
            return {g: None for g in gpus or ()}
        if gpus is None or any(g not in self._uuids for g in gpus):
            await self._call(self._refresh)
        wanted = tuple(self._uuids) if gpus is None else gpus

        def read() -> dict[str, int | None]:
            out: dict[str, int | None] = {}
            for g in wanted:
                index = self._uuids.get(g)
                try:
                    out[g] = None if index is None else self.telemetry.free_bytes(index)
                except Exception:
                    out[g] = None
            return out

        return dict(await self._call(read))


class Connection:
    def __init__(self, daemon: Daemon, peer: Peer, writer: asyncio.StreamWriter):
        self.daemon = daemon
        self.peer = peer
        self.writer = writer
        self.request: Request | None = None
        self.closed = False

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            return
        transport = self.writer.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            self.daemon.say(logging.WARNING, self.peer, "unread",
                            f"{self.peer} does not read its replies: connection closed")
            self.closed = True
            transport.abort()
            return
        transport.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


class RequestError(ValueError):
    pass


class Daemon:
    def __init__(self, socket_path: str, turn_timeout: float = DEFAULT_TURN_TIMEOUT,
                 free: Free | None = None, per_user: int = DEFAULT_PER_USER,
                 socket_mode: int = 0o666, door: ServiceDoor | None = None,
                 claim_ttl: float = CLAIM_TTL):
        self.door = door
        # as many claims per uid as connections, at least MAX_CLAIMS_PER_USER: a DaemonSet
        # sees every pod as one uid and raises the connections for it
        self.claims = PlacedClaims(claim_ttl, per_user=max(MAX_CLAIMS_PER_USER, per_user))
        self.socket_path = socket_path
        self.turns = Turns(turn_timeout)
        self.free = free or Free("none")
        self.per_user = per_user
        self.socket_mode = socket_mode
        self.connections: dict[int, int] = {}  # uid -> open connections
        self.say = _Say(RateLimitedLog(log))
        self.server: asyncio.AbstractServer | None = None

    # -- the socket ------------------------------------------------------------------------
    async def start(self) -> None:
        path = self.socket_path
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o755, exist_ok=True)
            os.chmod(directory, 0o755)
        info = os.stat(directory)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            log.warning("the socket's directory %s is writable by other users: one of them could "
                        "replace the socket (servers check that the daemon runs as root or as "
                        "themselves, and refuse anyone else)", directory)
        _clear_stale(path)
        self.server = await asyncio.start_unix_server(self._serve, path, limit=MAX_LINE + 2)
        os.chmod(path, self.socket_mode)
        if self.door is not None:
            await self.door.start()
        log.info("jupyter-gpushare node daemon %s listening on %s (mode %04o), turns revoked "
                 "after %g s, at most %d connections per user; free memory: %s", __version__,
                 path, self.socket_mode, self.turns.timeout, self.per_user,
                 self.free.reason or self.free.backend)

    async def close(self) -> None:
        if self.door is not None:
            await self.door.close()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

    # -- one connection ----------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = peer_of(writer.get_extra_info("socket"))
        except OSError as e:
            log.warning("a connection without peer credentials was closed: %s", e)
            writer.close()
            return
        conn = Connection(self, peer, writer)
        if self.connections.get(peer.uid, 0) >= self.per_user or \
                sum(self.connections.values()) >= MAX_CONNECTIONS:
            self.say(logging.WARNING, peer, "too-many",
                     f"{peer} was refused a connection: too many open connections")
            conn.send({"ok": False, "error": f"too many connections of user {peer.user} "
                                             f"(at most {self.per_user})"})
            await _close(writer)
            return
        self.connections[peer.uid] = self.connections.get(peer.uid, 0) + 1
        log.debug("%s connected", peer)
        try:
            await self._lines(conn, reader)
        except (ConnectionError, OSError):
            pass
        except Exception:  # never lose the daemon to one client
            log.exception("serving %s", peer)
        finally:
            conn.closed = True
            if conn.request is not None:
                self.turns.give_back(conn.request)
                conn.request = None
            self.connections[peer.uid] -= 1
            if not self.connections[peer.uid]:
                del self.connections[peer.uid]
            await _close(writer)

    async def _lines(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        skipping = False  # the rest of a line over MAX_LINE
        while not conn.closed:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                return  # closed (a last line without its newline is not a request)
            except asyncio.LimitOverrunError as e:
                await reader.readexactly(e.consumed)  # drop what is buffered of the long line
                if not skipping:
                    skipping = True
                    self._refuse(conn, None, f"a request line is longer than {MAX_LINE} bytes")
                continue
            if skipping:
                skipping = False  # the end of the over-long line
                continue
            if len(line) > MAX_LINE + 1:
                self._refuse(conn, None, f"a request line is longer than {MAX_LINE} bytes")
                continue
            if not line.strip():
                continue
            await self._request(conn, line)

    def _refuse(self, conn: Connection, msg: dict[str, Any] | None, why: str) -> None:
        self.say(logging.WARNING, conn.peer, "refused", f"{conn.peer}: refused: {why}")
        reply: dict[str, Any] = {"ok": False, "error": why}
        if isinstance(msg, dict):
            if isinstance(msg.get("op"), str) and len(msg["op"]) <= 32:
                reply["op"] = msg["op"]
            if _echoable(msg.get("id")):
                reply["id"] = msg["id"]
        conn.send(reply)

    async def _request(self, conn: Connection, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            self._refuse(conn, None, f"not a JSON line: {e}")
            return
        if not isinstance(msg, dict):
            self._refuse(conn, None, "a request must be a JSON object with an \"op\"")
            return
        try:
            reply = await self._answer(conn, msg)
        except RequestError as e:
            self._refuse(conn, msg, str(e))
            return
        if reply is not None:
            if _echoable(msg.get("id")):
                reply["id"] = msg["id"]
            conn.send(reply)

    async def _answer(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "hello":
            return {"ok": True, "op": "hello", "version": __version__, "uid": conn.peer.uid,
                    "user": conn.peer.user, "pid": conn.peer.pid, "gid": conn.peer.gid,
                    "turn_timeout": self.turns.timeout}
        if op == "turn":
            gpus = _gpus(msg, required=True)
            assert gpus is not None
            unknown = await self.free.unknown(gpus)
            if unknown:
                raise RequestError(f"not a GPU of this node: {', '.join(unknown)}")
            if conn.request is not None:
                state = "holds" if conn.request.granted is not None else "waits for"
                raise RequestError(f"this connection already {state} a turn (GPU "
                                   f"{', '.join(conn.request.gpus)}); send done first")
            if conn.closed:
                return None
            holders = self.turns.holders_of(gpus)
            conn.request = self.turns.ask(conn, gpus)
            if conn.request.granted is None:  # the granted line went out already otherwise
                lefts = [h["left"] for h in holders.values()]
                return {"ok": True, "op": "turn", "state": "waiting", "gpus": list(gpus),
                        "holders": holders, "left": max(lefts) if lefts else self.turns.timeout}
            return None
        if op == "done":
            released: list[str] = []
            if conn.request is not None:
                req, conn.request = conn.request, None
                if req.granted is not None:
                    released = list(req.gpus)
                self.turns.give_back(req)
            return {"ok": True, "op": "done", "released": released}
        if op == "free":
            gpus = _gpus(msg, required=False)
            return {"ok": True, "op": "free", "free": await self.free.read(gpus),
                    **({"reason": self.free.reason} if self.free.reason else {})}
        if op == "placed":
            try:
                claimed = parse_claim(msg.get("gpus"), MAX_GPUS)
            except ClaimError as e:
                raise RequestError(str(e)) from None
            for uuid in claimed:
                if not 0 < len(uuid) <= MAX_KEY or not KEY.match(uuid):
                    raise RequestError(f'"gpus" must be keyed by GPU UUIDs, got {uuid[:60]!r}')
            unknown = await self.free.unknown(tuple(sorted(claimed)))
            if unknown:
                raise RequestError(f"not a GPU of this node: {', '.join(unknown)}")
            try:
                server = (conn.peer.uid, conn.peer.pid, parse_token(msg.get("server")))
                self.claims.put(server, claimed)
            except ClaimError as e:
                raise RequestError(str(e)) from None
            return {"ok": True, "op": "placed", "ttl": self.claims.ttl,
                    "others": encode_claims(self.claims.others(server))}
        if not isinstance(op, str):
            raise RequestError('a request needs "op": "hello", "turn", "done", "free" or "placed"')
        raise RequestError(f"unknown op {op[:40]!r} (known: hello, turn, done, free, placed)")


class _Say:
    def __init__(self, limited: RateLimitedLog):
        self.limited = limited

    def __call__(self, level: int, peer: Peer, what: str, text: str) -> None:
        self.limited(level, str(peer.uid), what, text)


def _echoable(value: Any) -> bool:
    return (isinstance(value, (int, str)) and not isinstance(value, bool)
            and len(str(value)) <= 64)


def _gpus(msg: dict[str, Any], required: bool) -> tuple[str, ...] | None:
    value = msg.get("gpus")
    if value is None and not required:
        return None
    if not isinstance(value, list) or not value:
        raise RequestError('"gpus" must be a non-empty list of GPU UUIDs')
    if len(value) > MAX_GPUS:
        raise RequestError(f'"gpus" lists {len(value)} GPUs (at most {MAX_GPUS})')
    for g in value:
        if not isinstance(g, str) or not 0 < len(g) <= MAX_KEY or not KEY.match(g):
            shown = json.dumps(g)[:60] if not isinstance(g, str) else repr(g[:60])
            raise RequestError(f'"gpus" must hold GPU UUIDs, got {shown}')
    return tuple(sorted(set(value)))


def _clear_stale(path: str) -> None:
    """Remove a socket file no daemon listens on; refuse anything else at ``path``."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ValueError(f"{path} exists and is not a socket: remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # a stale socket of a daemon that is gone
        return
    finally:
        probe.close()
    raise ValueError(f"another process answers on {path}: is a node daemon running already?")


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


# -- the command -----------------------------------------------------------------------------
DESCRIPTION = """\
The node daemon: per-GPU restore turns for every Jupyter server of this node, owned by a
trusted process (run it as root: a systemd unit, or a Kubernetes DaemonSet). Servers find it
through GPUShareApp.node_daemon_socket or the environment variable
JUPYTER_GPUSHARE_NODE_DAEMON; it knows each of them by the kernel's SO_PEERCRED (uid -> user).
A turn held longer than --turn-timeout is revoked and the next waiter served. Servers' room
checks read free memory from it. With --listen and --secret-file it also measures this node for
a gpushare hub service that runs elsewhere (Kubernetes), which checks servers' claims with it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--socket", required=True, metavar="PATH",
                        help="the Unix socket to listen on (e.g. /run/gpushare/node.sock); its "
                             "directory is created mode 0755 when missing")
    parser.add_argument("--turn-timeout", type=_positive, default=DEFAULT_TURN_TIMEOUT,
                        metavar="SECONDS",
                        help="seconds one restore may hold a GPU's turn before it is revoked "
                             f"(default: {DEFAULT_TURN_TIMEOUT:g})")
    parser.add_argument("--claim-ttl", type=_positive, default=CLAIM_TTL, metavar="SECONDS",
                        help="seconds a server's claim of placed kernels (the placed op) counts "
                             "without being renewed; servers renew it every poll (default: "
                             f"{CLAIM_TTL:g})")
    parser.add_argument("--backend", choices=BACKENDS, default="nvml",
                        help="where the daemon reads free memory (the free op): nvml (default), "
                             "simulated (with --simulated-node), none")
    parser.add_argument("--simulated-node", default="", metavar="PATH",
                        help="the shared simulated node's file (GPUShareApp.simulated_node), "
                             "for --backend simulated")
    parser.add_argument("--max-connections-per-user", type=_positive_int, default=DEFAULT_PER_USER,
                        metavar="N", help=f"open connections one uid may have (default: "
                                          f"{DEFAULT_PER_USER})")
    parser.add_argument("--socket-mode", type=_mode, default=0o666, metavar="OCTAL",
                        help="the socket file's mode (default: 0666: every local user's server "
                             "may connect; 0660 with a group limits it to that group)")
    parser.add_argument("--listen", default="", metavar="HOST:PORT",
                        help="also measure the node for the hub service on this TCP address "
                             f"(e.g. 0.0.0.0:{DEFAULT_PORT}; default: off), for a service that "
                             "runs off the node (Kubernetes); needs --secret-file")
    parser.add_argument("--secret-file", default="", metavar="PATH",
                        help="the secret the hub service and the daemon share (at least 16 "
                             "bytes; a file others cannot read: mode 0400 or 0440, e.g. a "
                             "Kubernetes Secret); with --listen")
    parser.add_argument("--node", default=os.environ.get("JUPYTER_GPUSHARE_NODE") or socket.gethostname(),
                        metavar="NAME",
                        help="this node's name as its servers give it (the hub service checks "
                             "it); default: $JUPYTER_GPUSHARE_NODE, else the host name")
    parser.add_argument("--unix-user", default="{username}", metavar="PATTERN",
                        help="the OS account of a Hub user's kernels, {username} the Hub's name "
                             "(as GPUShareHub.unix_user; default: {username}); processes of "
                             "other accounts are told apart by JUPYTERHUB_USER, a pod's by its "
                             "first process's")
    parser.add_argument("--context-bytes", type=int, default=None, metavar="BYTES",
                        help="how much of a restore's need may be missing from its processes' "
                             "host memory (as GPUShareHub.context_bytes; default: 768 MiB with "
                             "NVML, 0 simulated)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default: INFO")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _mode(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an octal mode such as 0666, got {text}") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"must be a mode between 0000 and 0777, got {text}")
    return value


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s gpushare-node-daemon %(levelname)s %(message)s")
    if args.backend == "simulated" and not args.simulated_node:
        parser.error("--backend simulated needs --simulated-node PATH")
    if bool(args.listen) != bool(args.secret_file):
        parser.error("--listen and --secret-file go together")
    if args.context_bytes is not None and args.context_bytes < 0:
        parser.error("--context-bytes must be >= 0")
    free = Free(args.backend, args.simulated_node, args.unix_user, args.context_bytes)
    door = None
    if args.listen:
        try:
            host, port = parse_address(args.listen)
            secret = load_secret(args.secret_file)
        except ValueError as e:
            parser.error(str(e))
        door = ServiceDoor(host, port, secret, free.measure, args.node, RateLimitedLog(log))
    try:
        why = free.open()
    except Exception as e:
        parser.error(f"cannot open the {args.backend} backend: {e}")
    if why:
        log.warning("free memory cannot be read (%s): the free op answers null; turns are "
                    "served all the same", why)
    daemon = Daemon(args.socket, args.turn_timeout, free, args.max_connections_per_user,
                    args.socket_mode, door, args.claim_ttl)
    try:
        return asyncio.run(_main(daemon))
    except ValueError as e:
        parser.error(str(e))
    finally:
        free.close()


async def _main(daemon: Daemon) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await daemon.start()
    try:
        await stop.wait()
    finally:
        log.info("stopping: every turn is given back")
        await daemon.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jupyter gpushare node-daemon")
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
