"""Restore turns from the node daemon (:mod:`.daemon`) instead of lock files.

:class:`NodeDaemonTurns` is what the controller's reservations use when
``GPUShareApp.node_daemon_socket`` is set: the same interface as :class:`.NodeLocks`
(``acquire(keys, on_wait) -> grant`` with ``unguarded``, ``refusal()``), so nothing above it
changes. A turn is one connection to the daemon: ``{"op": "turn", "gpus": [...]}``, then the
turn is held until the grant is released (the connection closes; a server that dies gives its
turns back the same way, at once).

The daemon is trusted only when the kernel says its process runs as root or as this server's
user (``SO_PEERCRED`` of the socket's other end): another user who put a socket of theirs at
the path could otherwise hand out turns. A daemon that cannot be reached, is not trusted, does
not answer within :data:`ANSWER_TIMEOUT`, refuses the request, or does not grant the turn
within ``timeout`` leaves the restore *without a turn* (``unguarded``, with why), exactly as a
refused lock directory: the caller then asks for room for twice the state, seen twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from typing import Any

from .daemon import MAX_LINE, peer_of
from .node_locks import WAIT_NOTICE, NodeGrant, NodeLocks, OnWait
from .placed_claims import Claimed, ClaimError, parse_others
from .placed_claims import encode as encode_claims

log = logging.getLogger(__name__)

#: the environment variable a server reads its node_daemon_socket default from
NODE_DAEMON_ENV = "JUPYTER_GPUSHARE_NODE_DAEMON"
#: s to connect and hear the daemon's first answer (it answers at once: granted or waiting)
ANSWER_TIMEOUT = 5.0
#: s a restore waits for a turn the daemon has not granted (its holders are revoked after the
#: daemon's --turn-timeout, so this is reached only behind many users, or a stuck daemon)
WAIT_BOUND = 300.0


class DaemonGrant(NodeGrant):
    """The turns one restore holds from the daemon: its connection, closed by :meth:`release`."""

    def __init__(self, writer: asyncio.StreamWriter | None, watcher: asyncio.Task[None] | None,
                 unguarded: dict[str, str] | None = None):
        super().__init__([], unguarded)
        self._writer = writer
        self._watcher = watcher

    def release(self) -> None:
        writer, self._writer = self._writer, None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if writer is not None:
            writer.close()  # the daemon gives the turns back when it sees the connection end


class DaemonRefused(Exception):
    """The daemon cannot be used for this turn; the message says why."""


class NodeDaemonTurns(NodeLocks):
    """Restore turns per GPU from the node daemon listening on ``socket_path``."""

    def __init__(self, socket_path: str, timeout: float = WAIT_BOUND):
        super().__init__("", timeout)
        self.socket_path = socket_path
        self._reachable: bool | None = None
        # this server's name in its placed claims, which nobody else sees (the daemon may not
        # tell servers apart by pid: another pid namespace sees 0 for all)
        self.server_token = secrets.token_hex(16)

    def covers_every_user(self) -> bool:
        return True  # the daemon runs the turns of every server on the node, whoever runs it

    # -- checks ------------------------------------------------------------------------------
    def _trusted(self, sock: socket.socket) -> None:
        peer = peer_of(sock)
        if peer.uid not in (0, os.geteuid()):
            raise DaemonRefused(
                f"the process at {self.socket_path} (pid {peer.pid}) runs as {peer.user} (uid "
                f"{peer.uid}), neither root nor this server's user, so its turns are not trusted")

    def refusal(self) -> str | None:
        """Why the daemon cannot be used now (None: it answers and is trusted). Blocks for at
        most :data:`ANSWER_TIMEOUT` (called once, at the server's start)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ANSWER_TIMEOUT)
        try:
            sock.connect(self.socket_path)
            self._trusted(sock)
            sock.sendall(b'{"op": "hello"}\n')
            data = b""
            while not data.endswith(b"\n") and len(data) <= MAX_LINE:
                chunk = sock.recv(65536)
                if not chunk:
                    raise DaemonRefused("it closed the connection without an answer")
                data += chunk
            reply = json.loads(data.splitlines()[0])
            if not isinstance(reply, dict) or reply.get("ok") is not True:
                raise DaemonRefused(f"it refused the hello: {_error(reply)}")
        except (OSError, ValueError, DaemonRefused) as e:
            return self._unreachable(e)
        finally:
            sock.close()
        return None

    def _unreachable(self, e: BaseException) -> str:
        if isinstance(e, DaemonRefused):
            text = str(e)
        elif isinstance(e, (TimeoutError, asyncio.TimeoutError, socket.timeout)):
            text = f"it did not answer within {ANSWER_TIMEOUT:g} s"
        elif isinstance(e, OSError):
            text = e.strerror or str(e)
        else:
            text = f"{type(e).__name__}: {e}"
        return f"the node daemon at {self.socket_path} cannot be used: {text}"

    def _answers(self) -> None:
        if self._reachable is False:
            log.info("gpushare: the node daemon at %s answers again: restores take their turns "
                     "there", self.socket_path)
        self._reachable = True

    def _down(self, why: str) -> None:
        if self._reachable is not False:
            log.warning("gpushare: %s; restores go on without a turn across servers, with a "
                        "stricter room check (room for twice their state, read twice), until it "
                        "answers (see GPUShareApp.node_daemon_socket)", why)
        self._reachable = False

    # -- turns -------------------------------------------------------------------------------
    async def acquire(self, keys: list[str], on_wait: OnWait | None = None) -> NodeGrant:
        """The turn of every key at once, from the daemon. Keys without a turn (the daemon
        unusable, or no grant within ``timeout``) are in the grant's ``unguarded``.
        Cancellation leaves none of them held."""
        wanted = sorted(set(keys))
        if not wanted:
            return NodeGrant([])
        writer: asyncio.StreamWriter | None = None
        try:
            reader, connected = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE + 2), ANSWER_TIMEOUT)
            writer = connected
            self._trusted(connected.get_extra_info("socket"))
            connected.write(json.dumps({"op": "turn", "gpus": wanted}).encode() + b"\n")
            await connected.drain()
            reply = await self._read(reader, ANSWER_TIMEOUT)
            if reply.get("state") == "waiting":
                self._answers()
                reply = await self._wait(reader, reply, wanted, on_wait)
            if reply.get("state") != "granted":
                raise DaemonRefused(f"it answered {json.dumps(reply)[:200]}")
        except asyncio.CancelledError:
            if writer is not None:
                writer.close()
            raise
        except (OSError, ValueError, DaemonRefused, asyncio.TimeoutError,
                asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            if writer is not None:
                writer.close()
            if isinstance(e, _NotGranted):
                why = str(e)
                self._warn(why, f"{why}; the restore goes on without a turn, with a stricter "
                                "room check")
            else:
                why = self._unreachable(e)
                self._down(why)
            return NodeGrant([], {key: why for key in wanted})
        self._answers()
        watcher = asyncio.ensure_future(self._watch(reader, wanted))
        return DaemonGrant(writer, watcher)

    async def _read(self, reader: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise DaemonRefused("it answered something other than a JSON object")
        if reply.get("ok") is False:
            raise DaemonRefused(f"it refused the turn: {_error(reply)}")
        return reply

    async def _wait(self, reader: asyncio.StreamReader, waiting: dict[str, Any],
                    wanted: list[str], on_wait: OnWait | None) -> dict[str, Any]:
        """Wait for the granted line; ``on_wait`` hears of it after ``WAIT_NOTICE`` s."""
        began = time.monotonic()
        notice = min(WAIT_NOTICE, self.timeout / 2)
        told = False
        while True:
            left = began + self.timeout - time.monotonic()
            if left <= 0:
                raise _NotGranted(f"the node daemon at {self.socket_path} did not grant the turn "
                                  f"of GPU {', '.join(wanted)} within {self.timeout:g} s")
            until_notice = began + notice - time.monotonic()
            step = left if told or on_wait is None else max(0.0, min(left, until_notice))
            try:
                reply = await self._read(reader, step)
            except asyncio.TimeoutError:
                if not told and on_wait is not None and time.monotonic() - began >= notice:
                    told = True
                    self._tell(on_wait, waiting, wanted)
                continue
            if reply.get("state") == "granted" or reply.get("ok") is True:
                return reply

    def _tell(self, on_wait: OnWait, waiting: dict[str, Any], wanted: list[str]) -> None:
        holders = waiting.get("holders")
        holders = holders if isinstance(holders, dict) else {}
        told = False
        for key in wanted:
            holder = holders.get(key)
            if isinstance(holder, dict):
                pid = holder.get("pid")
                left = holder.get("left")
                try:
                    on_wait(key, pid if isinstance(pid, int) else None,
                            float(left) if isinstance(left, (int, float)) else self.timeout)
                except Exception:
                    log.exception("gpushare: reporting a wait for a restore turn")
                told = True
        if not told:
            try:
                on_wait(wanted[0], None, self.timeout)
            except Exception:
                log.exception("gpushare: reporting a wait for a restore turn")

    async def _watch(self, reader: asyncio.StreamReader, wanted: list[str]) -> None:
        """While the turn is held: say so when the daemon revokes it."""
        with contextlib.suppress(Exception):
            while True:
                line = await reader.readuntil(b"\n")
                msg = json.loads(line)
                if isinstance(msg, dict) and msg.get("event") == "revoked":
                    log.warning("gpushare: the node daemon revoked this server's restore turn "
                                "of GPU %s after %s s: %s", ", ".join(wanted), msg.get("held_s"),
                                msg.get("reason"))

    async def free(self, keys: list[str] | None = None) -> dict[str, int | None]:
        """The daemon's own reading of free bytes per GPU (all of its GPUs without ``keys``).
        Raises OSError / ValueError when it cannot be had."""
        ask: dict[str, Any] = {"op": "free"}
        if keys is not None:
            ask["gpus"] = keys
        free = (await self._ask(ask)).get("free")
        if not isinstance(free, dict):
            raise ValueError("the node daemon's free reply has no free map")
        return {str(k): v if isinstance(v, int) else None for k, v in free.items()}

    async def placed(self, mine: Claimed, timeout: float = ANSWER_TIMEOUT) -> Claimed:
        """Tell the daemon what this server's placed kernels not using their GPUs yet are
        expected to take (GPU UUID -> (bytes, kernels); this server's claim from now on) and
        hear the other servers' claims, summed per GPU. Raises OSError / ValueError when it
        cannot be had (a daemon of an older version refuses the op)."""
        answer = await self._ask({"op": "placed", "server": self.server_token,
                                  "gpus": encode_claims(mine)}, timeout)
        try:
            return parse_others(answer.get("others"))
        except ClaimError as e:
            raise ValueError(f"the node daemon's placed reply: {e}") from None

    async def _ask(self, msg: dict[str, Any], timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
        """One request on a connection of its own, and its reply."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE + 2), timeout)
        try:
            self._trusted(writer.get_extra_info("socket"))
            writer.write(json.dumps(msg).encode() + b"\n")
            return await self._read(reader, timeout)
        except DaemonRefused as e:
            raise ValueError(str(e)) from None
        finally:
            writer.close()


class _NotGranted(DaemonRefused):
    pass


def _error(reply: Any) -> str:
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        return reply["error"][:300]
    return json.dumps(reply)[:200]
