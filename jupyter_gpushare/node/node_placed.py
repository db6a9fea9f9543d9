"""This server's side of the placements shared through the node daemon (:mod:`.placed_claims`).

Every poll, and right after the server places a kernel, :meth:`NodePlaced.exchange` tells the
daemon what this server's placed kernels that have not used their GPUs yet are expected to take
and what its released kernels' states will take back, and keeps what the daemon says of the
other servers'. Placement counts the others' as taken room (both) and pending load, as it
counts this server's own; the release policy counts their placed bytes as wanted memory. An answer older than ``keep`` seconds counts for nothing (those kernels have
allocated by then, or not); a daemon that does not answer is said once in the log, and the
server places by its own view until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from .. import clock
from .placed_claims import Claimed

#: s one exchange may take: it runs in the poll and before a kernel's placement
EXCHANGE_TIMEOUT = 1.0

Ask = Callable[[Claimed, float], Awaitable[Claimed]]


class GPU(Protocol):
    index: int
    uuid: str
    memory_total: int | None


class NodePlaced:
    def __init__(self, ask: Ask, gpus: Callable[[], Iterable[GPU]],
                 mine: Callable[[], Mapping[int, tuple[int, int, int]]], keep: Callable[[], float],
                 where: str = "the node daemon", log: logging.Logger | Any = None):
        """ask: one exchange with the daemon (this server's claim -> the others');
        gpus: the GPUs polled; mine: per GPU index, (bytes, kernels, returning): what this
        server's placed kernels not using it yet are expected to take, how many they are, and
        what its released kernels' states will take back; keep: seconds an answer counts."""
        self.ask = ask
        self.gpus = gpus
        self.mine = mine
        self.keep = keep
        self.where = where
        self.log = log or logging.getLogger(__name__)
        self.others: Claimed = {}
        # one exchange at a time: a claim read before a placement must not reach the daemon
        # after the one read after it
        self._one = asyncio.Lock()
        self.at: float | None = None  # clock.now() of the last answer
        self.error: str | None = None
        self._telling: set[asyncio.Task[None]] = set()  # exchanges started, kept referenced

    async def exchange(self, timeout: float = EXCHANGE_TIMEOUT) -> None:
        """Tell the daemon this server's claim, keep the others'. Never raises."""
        async with self._one:
            await self._exchange(timeout)

    def tell_soon(self) -> None:
        """Start an exchange now, not at the next poll (a kernel was placed, or ran out of
        memory: another server may place one, or weigh its releases, in between)."""
        task = asyncio.ensure_future(self.exchange())
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def told(self) -> None:
        """Wait for the exchanges :meth:`tell_soon` started."""
        await asyncio.gather(*self._telling)

    async def _exchange(self, timeout: float) -> None:
        uuids = {g.index: g.uuid for g in self.gpus() if g.uuid}
        claim = {uuids[g]: v for g, v in self.mine().items() if g in uuids and any(v)}
        try:
            others = await self.ask(claim, timeout)
        except Exception as e:
            why = str(e) or type(e).__name__
            if self.error is None:
                self.log.warning("gpushare: %s did not share the node's placements (%s): kernels "
                                 "other servers placed and that have not allocated yet are not "
                                 "counted until it does", self.where, why)
            self.error = why
            return
        if self.error is not None:
            self.log.info("gpushare: %s shares the node's placements again", self.where)
        self.error = None
        self.others = others
        self.at = clock.now()

    def by_gpu(self) -> dict[int, tuple[int, int, int]]:
        """Per GPU index: (bytes, kernels, returning) of the other servers; bytes at most the
        GPU's memory."""
        if self.at is None or clock.now() - self.at > self.keep():
            return {}
        out = {}
        for g in self.gpus():
            n, k, r = self.others.get(g.uuid, (0, 0, 0)) if g.uuid else (0, 0, 0)
            if n or k or r:
                cap = g.memory_total
                out[g.index] = (n if cap is None else min(n, cap), k, r if cap is None else min(r, cap))
        return out

    def placed_elsewhere(self) -> dict[int, int]:
        """Per GPU index, the bytes other servers' placed kernels are expected to take."""
        return {g: n for g, (n, _, _) in self.by_gpu().items() if n}

    def pending(self) -> dict[int, int]:
        """Per GPU index, how many kernels other servers placed there have not used it yet."""
        return {g: k for g, (_, k, _) in self.by_gpu().items() if k}
