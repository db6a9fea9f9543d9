"""The node daemon's door for the hub service: its reading of the node, over TCP, to a service
that runs elsewhere (a Kubernetes hub pod) and cannot measure the node itself.

Who may ask: only a party that holds the shared secret (a file only root, or the hub's pod,
reads: a Kubernetes Secret). Each side proves it to the other on every connection with an
HMAC-SHA256 over both sides' fresh nonces (the daemon's proof also over its node's name), and
every later message carries an HMAC under a key of that connection: the secret never crosses
the network, a recorded exchange cannot be replayed, a process posing as the daemon (or the
service) is believed in nothing, and one that relays another node's daemon is caught by the
node name.

Protocol: JSON lines (UTF-8, one object per line, at most ``MAX_LINE`` bytes):

- daemon: ``{"op": "challenge", "nonce": N, "node": NAME, "version": ...}`` at once;
- service: ``{"op": "auth", "nonce": M, "proof": HMAC(secret, "service:N:M")}``; daemon:
  ``{"ok": true, "op": "auth", "proof": HMAC(secret, "daemon:M:N:NAME")}``, or ``{"ok":
  false, "error": why}`` and the connection closes (no or a wrong proof: nothing is read);
- then each side sends ``{"msg": OBJECT, "mac": HMAC(HMAC(secret, "session:N:M"),
  "request:I:" or "reply:I:" + OBJECT as canonical JSON)}``, I counting the requests of the
  connection from 1 (every line the daemon reads counts), so nothing can be replayed within
  it either; the service keeps its connection for later requests;
- request ``{"op": "measure", "servers": [{"user", "server", "pids": [int]}], "users":
  [name]}``; reply ``{"ok": true, "op": "measure", "node": READING, "servers": [READING]}``
  (:func:`..measure.encode`): the node's GPUs and what each Hub user holds on each, and per
  server the facts of the pids it names, keyed by its own pids (a pod's, translated);
- anything else after the proof (not JSON, no or a wrong mac, an unknown op, a field of the
  wrong type) -> ``{"ok": false, "error": why}`` and nothing changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from typing import Any

from .._version import __version__

log = logging.getLogger("jupyter_gpushare.node.daemon")

MAX_LINE = 1 << 20  # bytes of one request line (a measure names every server's pids)
MAX_REPLY = 16 << 20  # bytes of one reply the service reads
MAX_SERVERS = 4096
MAX_PIDS = 65536  # in one request, all servers together
MAX_CONNECTIONS = 64
AUTH_TIMEOUT = 5.0  # s a connection may take to prove it holds the secret
IDLE_TIMEOUT = 60.0  # s a proven connection may stay silent
DEFAULT_PORT = 10102

Measure = Callable[[list[tuple[str, str, list[int]]], list[str]], Awaitable[dict[str, Any]]]


def load_secret(path: str) -> bytes:
    """The shared secret from ``path``; ValueError when it is missing, empty, shorter than 16
    bytes, or a file others could read or anyone but its owner could write."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ValueError(f"the secret file {path}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the secret file {path} is not a regular file")
        if info.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
            raise ValueError(f"the secret file {path} has mode {stat.S_IMODE(info.st_mode):04o}: "
                             "others may read it or others than its owner write it (use 0400 or 0440)")
        raw = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(raw) < 16:
        raise ValueError(f"the secret file {path} holds {len(raw)} bytes: at least 16 are needed "
                         "(e.g. openssl rand -hex 32)")
    return raw


def proof(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, ":".join(parts).encode(), hashlib.sha256).hexdigest()


def canonical(msg: Any) -> bytes:
    return json.dumps(msg, sort_keys=True, separators=(",", ":")).encode()


def sealed(key: bytes, kind: str, msg: dict[str, Any]) -> dict[str, Any]:
    return {"msg": msg, "mac": hmac.new(key, kind.encode() + b":" + canonical(msg), hashlib.sha256).hexdigest()}


def unsealed(key: bytes, kind: str, envelope: Any) -> dict[str, Any]:
    """The message of a sealed envelope; ValueError when its mac is missing or wrong."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("msg"), dict) \
            or not isinstance(envelope.get("mac"), str):
        raise ValueError('a message must be {"msg": OBJECT, "mac": HEX}')
    want = sealed(key, kind, envelope["msg"])["mac"]
    if not hmac.compare_digest(envelope["mac"], want):
        raise ValueError("the message's mac is wrong")
    return envelope["msg"]


def parse_address(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``HOST`` -> (host, port); ValueError when malformed."""
    text = text.strip()
    host, port = text, default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), text)
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = _port(p, text)
    if not host:
        raise ValueError(f"{text!r}: no host")
    return host, port


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{whole!r}: the port must be 1-65535")
    return int(text)


class Refused(ValueError):
    pass


class ServiceDoor:
    """The daemon's TCP listener for the hub service."""

    def __init__(self, host: str, port: int, secret: bytes, measure: Measure, node: str,
                 say: Callable[[int, str, str, str], None] | None = None):
        """say(level, who, what, text): the daemon's rate-limited log (one line per peer and
        kind of refusal per interval)."""
        self.host, self.port = host, port
        self.node = node
        self.say = say or (lambda level, who, what, text: log.log(level, "%s", text))
        self.secret = secret
        self.measure = measure
        self.server: asyncio.AbstractServer | None = None
        self.open = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.host or None, self.port,
                                                 limit=MAX_LINE + 2)
        log.info("serving the hub service on %s:%d (shared secret; each side proves it)",
                 self.host or "*", self.port)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a peer"
        if self.open >= MAX_CONNECTIONS:
            await _reply(writer, {"ok": False, "error": "too many connections"})
            await _close(writer)
            return
        self.open += 1
        try:
            nonce = secrets.token_hex(16)
            await _reply(writer, {"op": "challenge", "nonce": nonce, "node": self.node,
                                  "version": __version__})
            try:
                first = await asyncio.wait_for(_line(reader), AUTH_TIMEOUT)
                answer, key = self._auth(first, nonce)
            except Refused as e:
                self.say(logging.WARNING, who.rsplit(":", 1)[0], "refused",
                         f"hub service channel: {who} refused: {e}")
                await _reply(writer, {"ok": False, "error": str(e)})
                return
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            await _reply(writer, answer)
            seq = 0
            while True:
                try:
                    line = await asyncio.wait_for(_line(reader), IDLE_TIMEOUT)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                except Refused as e:  # the rest of that line cannot be told from a request
                    await _reply(writer, {"ok": False, "error": f"{e}; connection closed"})
                    return
                seq += 1
                await _reply(writer, sealed(key, f"reply:{seq}", await self._answer(key, f"request:{seq}", line)))
        except asyncio.CancelledError:  # the daemon stops: the service's kept connection ends
            pass
        except Exception:  # never lose the daemon to one peer
            log.exception("hub service channel: serving %s", who)
        finally:
            self.open -= 1
            await _close(writer)

    def _auth(self, line: bytes, nonce: str) -> tuple[dict[str, Any], bytes]:
        try:
            msg = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise Refused("not a JSON line; the first request must be auth") from None
        if not isinstance(msg, dict) or msg.get("op") != "auth":
            raise Refused("the first request must be auth, with the proof of the shared secret")
        given, theirs = msg.get("proof"), msg.get("nonce")
        if not isinstance(theirs, str) or not 16 <= len(theirs) <= 128:
            raise Refused('"nonce" must be a string of 16 to 128 characters')
        if not isinstance(given, str) or \
                not hmac.compare_digest(given, proof(self.secret, "service", nonce, theirs)):
            raise Refused("wrong or missing proof of the shared secret")
        key = bytes.fromhex(proof(self.secret, "session", nonce, theirs))
        return {"ok": True, "op": "auth", "proof": proof(self.secret, "daemon", theirs, nonce, self.node)}, key

    async def _answer(self, key: bytes, kind: str, line: bytes) -> dict[str, Any]:
        try:
            msg = unsealed(key, kind, json.loads(line))
        except (ValueError, UnicodeDecodeError) as e:
            return {"ok": False, "error": f"refused: {e}"}
        if msg.get("op") != "measure":
            return {"ok": False, "op": str(msg.get("op"))[:32], "error": "unknown op (known: measure)"}
        try:
            servers, users = _servers(msg)
        except ValueError as e:
            return {"ok": False, "op": "measure", "error": str(e)}
        try:
            return {"ok": True, "op": "measure", **await self.measure(servers, users)}
        except Exception as e:  # the backend's fault: said, and the service keeps its weaker mode
            log.warning("hub service channel: measuring the node failed: %s", e)
            return {"ok": False, "op": "measure", "error": f"measuring the node failed: {e}"[:300]}


def _servers(msg: dict[str, Any]) -> tuple[list[tuple[str, str, list[int]]], list[str]]:
    servers, users = msg.get("servers", []), msg.get("users", [])
    if not isinstance(servers, list) or len(servers) > MAX_SERVERS:
        raise ValueError(f'"servers" must be a list of at most {MAX_SERVERS} objects')
    if not isinstance(users, list) or len(users) > MAX_SERVERS or \
            not all(isinstance(u, str) and 0 < len(u) <= 256 for u in users):
        raise ValueError('"users" must be a list of user names')
    out, n = [], 0
    for s in servers:
        if not isinstance(s, dict):
            raise ValueError('each of "servers" must be {"user", "server", "pids"}')
        user, name, pids = s.get("user"), s.get("server", ""), s.get("pids", [])
        if not isinstance(user, str) or not 0 < len(user) <= 256 or not isinstance(name, str) \
                or len(name) > 256:
            raise ValueError('a server needs "user" (a name) and "server" (its name, "" by default)')
        if not isinstance(pids, list) or not all(isinstance(p, int) and not isinstance(p, bool)
                                                 and 0 < p < 1 << 31 for p in pids):
            raise ValueError('"pids" must be a list of process ids')
        n += len(pids)
        if n > MAX_PIDS:
            raise ValueError(f"at most {MAX_PIDS} pids in one request")
        out.append((user, name, pids))
    return out, users


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise Refused(f"a request line is longer than {MAX_LINE} bytes") from None


async def _reply(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


# -- the service's side --------------------------------------------------------------------------
class Unreachable(Exception):
    """The daemon did not answer, or did not prove it holds the secret: why."""


class Session:
    """One proven connection to a node daemon, kept for later requests (one at a time)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes,
                 where: str):
        self.reader, self.writer, self.key, self.where = reader, writer, key, where
        self.seq = 0
        self.lock = asyncio.Lock()

    @classmethod
    async def open(cls, host: str, port: int, secret: bytes, node: str) -> Session:
        """Connect to the node daemon of ``node`` and prove both sides; the caller bounds it
        in time."""
        where = f"{host}:{port}"
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=MAX_REPLY)
        except OSError as e:
            raise Unreachable(f"cannot connect to {where}: {e.strerror or e}") from None
        try:
            hello = await _read(reader)
            nonce = hello.get("nonce")
            if hello.get("op") != "challenge" or not isinstance(nonce, str):
                raise Unreachable(f"{where} is not a node daemon: {str(hello)[:100]}")
            if hello.get("node") != node:
                raise Unreachable(f"{where} is the node daemon of {str(hello.get('node'))[:100]!r}, "
                                  f"not of {node!r}")
            mine = secrets.token_hex(16)
            await _reply(writer, {"op": "auth", "proof": proof(secret, "service", nonce, mine), "nonce": mine})
            answer = await _read(reader)
            if not answer.get("ok"):
                raise Unreachable(f"the node daemon refused the service: {str(answer.get('error'))[:200]}")
            given = answer.get("proof")
            if not isinstance(given, str) or \
                    not hmac.compare_digest(given, proof(secret, "daemon", mine, nonce, node)):
                raise Unreachable(f"{where} did not prove it holds the shared secret")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            await _close(writer)
            raise Unreachable(f"{where}: the connection failed: {e}") from None
        except BaseException:
            await _close(writer)
            raise
        return cls(reader, writer, bytes.fromhex(proof(secret, "session", nonce, mine)), where)

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The daemon's answer to ``msg`` (Unreachable: it failed or said no). A request
        cancelled half way leaves the session unusable: close it."""
        async with self.lock:
            self.seq += 1
            try:
                await _reply(self.writer, sealed(self.key, f"request:{self.seq}", msg))
                reply = unsealed(self.key, f"reply:{self.seq}", await _read(self.reader))
            except ValueError as e:
                raise Unreachable(f"the node daemon's answer: {e}") from None
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                raise Closed(f"{self.where}: the connection failed: {e or type(e).__name__}") from None
        if not reply.get("ok"):
            raise Unreachable(f"the node daemon: {str(reply.get('error'))[:300]}")
        return reply

    async def close(self) -> None:
        await _close(self.writer)


class Closed(Unreachable):
    """The connection ended (the daemon restarted, or closed it idle): a new one may do."""


async def ask(host: str, port: int, secret: bytes, node: str, request: dict[str, Any]) -> dict[str, Any]:
    """One request to the node daemon of ``node`` on a connection of its own."""
    session = await Session.open(host, port, secret, node)
    try:
        return await session.request(request)
    finally:
        await session.close()


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    line = await reader.readuntil(b"\n")
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise Unreachable("the node daemon's answer is not JSON") from None
    if not isinstance(msg, dict):
        raise Unreachable("the node daemon's answer is not an object")
    return msg
