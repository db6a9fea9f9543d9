"""The node daemons the service asks about the GPUs it does not measure itself (a hub that runs
off the GPU nodes, as in Zero to JupyterHub).

Each GPU node's daemon (``jupyter gpushare node-daemon --listen``) measures its node with the
same code the service uses on a node it runs on (:mod:`..node.measure`). For every server whose
GPUs the service does not measure, the service asks that node's daemon, over a channel both
sides prove with a shared secret (:mod:`..node.daemon_service`), bounded by
``node_daemon_timeout``: the node's GPUs, what each user holds there, and the facts of the pids
the server names (translated from its pod's numbering). The coordinator then checks the
server's claims against that, as on a node it measures.

Which daemon: the one that measured the server's GPUs before (GPU UUIDs are unique across
nodes), else the one of the node the server names; a server naming another node than its GPUs'
is asked about again at the daemon that measures them. A daemon answers for its own node only
(its name is part of its proof), so a server that names a wrong node gains nothing.

A daemon that does not answer in time leaves its GPUs in the weaker mode (the servers' word,
bounded by shares and what unused claims cost): said once in the log, on the admin page and
in ``gpushare_hub_gpu_checked``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from .. import clock
from ..node.daemon_service import Closed, Session, Unreachable, load_secret, parse_address
from ..node.measure import Measured, decode

log = logging.getLogger(__name__)


@dataclass
class DaemonState:
    """One node's daemon as the service last found it."""

    node: str
    address: str
    error: str | None = "not asked yet"
    answered: float | None = None  # clock.monotonic() of its last answer
    seconds: float | None = None  # its last round trip
    uuids: set[str] = field(default_factory=set)  # the GPUs it measures


@dataclass
class Ask:
    """One server whose GPUs the service does not measure."""

    key: tuple[str, str]  # (user, server name)
    node: str  # the node it names
    uuids: set[str]  # its GPUs
    pids: list[int]  # the pids its kernels name


class NodeDaemons:
    def __init__(self, addresses: str | dict[str, str], secret_file: str, timeout: float):
        self.addresses = addresses
        self.timeout = timeout
        self.secret: bytes | None = None
        self.off = ""  # why no daemon is asked ("" when they are)
        if not addresses:
            self.off = "no node daemon is configured (GPUShareHub.node_daemons)"
        elif not secret_file:
            self.off = "no shared secret (GPUShareHub.node_daemon_secret_file)"
        else:
            try:
                self.secret = load_secret(secret_file)
            except ValueError as e:
                self.off = f"no shared secret: {e}"
        self.nodes: dict[str, DaemonState] = {}
        self.sessions: dict[str, Session] = {}  # node -> its daemon's proven connection, kept
        self.by_uuid: dict[str, str] = {}  # GPU uuid -> the node whose daemon measured it

    def address(self, node: str) -> str:
        if isinstance(self.addresses, dict):
            template = self.addresses.get(node) or self.addresses.get("*", "")
        else:
            template = self.addresses
        return template.replace("{node}", node)

    async def read(self, asks: list[Ask], users: list[str]) -> tuple[dict[tuple[str, str], Measured],
                                                                      dict[str, Measured]]:
        """Each server's reading (by server key) and each GPU's node reading (by uuid), from
        the daemons that answered."""
        per_server: dict[tuple[str, str], Measured] = {}
        per_gpu: dict[str, Measured] = {}
        if self.secret is None or not asks:
            return per_server, per_gpu
        route: dict[str, list[Ask]] = {}
        for a in asks:
            node = next((self.by_uuid[u] for u in sorted(a.uuids) if u in self.by_uuid), a.node)
            if node and _node_name_ok(node):
                route.setdefault(node, []).append(a)
        for _ in range(2):  # a second round for servers whose GPUs another daemon measures
            answers = await asyncio.gather(*(self._ask(node, group, users)
                                             for node, group in route.items()))
            again: dict[str, list[Ask]] = {}
            for node, answer in zip(route, answers, strict=True):
                if answer is not None:  # every answer's GPUs first: a server may be routed by them
                    for uuid in answer[0].gpus:
                        self.by_uuid[uuid] = node
                        per_gpu[uuid] = answer[0]
            for (node, group), answer in zip(route.items(), answers, strict=True):
                if answer is None:
                    continue
                whole, each = answer
                for a, m in zip(group, each, strict=True):
                    if a.uuids & whole.gpus.keys():
                        per_server[a.key] = m
                        continue
                    other = next((self.by_uuid[u] for u in sorted(a.uuids)
                                  if self.by_uuid.get(u, node) != node), None)
                    if other is not None and other not in route:
                        again.setdefault(other, []).append(a)
            if not again:
                break
            route = again
        return per_server, per_gpu

    async def _ask(self, node: str, group: list[Ask], users: list[str]) -> tuple[Measured, list[Measured]] | None:
        address = self.address(node)
        state = self.nodes.get(node)
        if state is None or state.address != address:
            state = self.nodes[node] = DaemonState(node, address)
        started = clock.monotonic()
        request = {"op": "measure", "users": users,
                   "servers": [{"user": a.key[0], "server": a.key[1], "pids": a.pids} for a in group]}
        try:
            reply = await asyncio.wait_for(self._request(node, address, request), self.timeout)
            whole = decode(reply.get("node"), clock.now(), node)
            each = reply.get("servers")
            if not isinstance(each, list) or len(each) != len(group):
                raise ValueError("its answer does not list every server asked about")
            readings = [decode(d, whole.at, node, base=whole) for d in each]
        except asyncio.TimeoutError:
            await self._drop(node)  # an answer may still come: never read as the next one's
            self._failed(state, f"no answer within {self.timeout:g} s (GPUShareHub.node_daemon_timeout)")
            return None
        except (Unreachable, ValueError, OSError) as e:
            await self._drop(node)
            self._failed(state, str(e)[:300])
            return None
        if state.error is not None and state.answered is not None:
            log.info("gpushare hub: the node daemon of %s answers again: claims on its GPUs are "
                     "checked against its measurement", node)
        state.error, state.answered = None, clock.monotonic()
        state.seconds = clock.monotonic() - started
        state.uuids = set(whole.gpus)
        return whole, readings

    async def _request(self, node: str, address: str, request: dict) -> dict:
        """On the node's kept connection, or a new one (when there is none, or it closed)."""
        host, port = parse_address(address)
        session = self.sessions.get(node)
        if session is not None and session.where != f"{host}:{port}":
            await self._drop(node)
            session = None
        if session is not None:
            try:
                return await session.request(request)
            except Closed:
                await self._drop(node)
        assert self.secret is not None
        session = self.sessions[node] = await Session.open(host, port, self.secret, node)
        try:
            return await session.request(request)
        except Closed:
            await self._drop(node)
            raise

    async def _drop(self, node: str) -> None:
        session = self.sessions.pop(node, None)
        if session is not None:
            await session.close()

    def _failed(self, state: DaemonState, why: str) -> None:
        if state.error != why:
            log.warning("gpushare hub: the node daemon of %s (%s): %s; servers' claims on its GPUs "
                        "are taken as they are, bounded by shares", state.node, state.address, why)
        state.error = why

    def why_not(self, uuid: str, node: str) -> str:
        """Why GPU ``uuid`` (of ``node``, as its servers say) is not checked by a daemon."""
        if self.off:
            return self.off
        known = self.by_uuid.get(uuid, node)
        state = self.nodes.get(known)
        if state is None:
            return f"no node daemon was asked for node {node!r}" if node else "its servers name no node"
        if state.error:
            return f"the node daemon of {known} ({state.address}): {state.error}"
        return f"the node daemon of {known} does not measure this GPU"


def _node_name_ok(node: str) -> bool:
    """A node name as Kubernetes allows them (DNS subdomain), so that a server cannot steer the
    service to an address of its choosing through the template."""
    return 0 < len(node) <= 253 and all(c.isalnum() or c in "-." for c in node) and node[0].isalnum()
