"""GPU memory promised to restores, and one restore at a time per GPU.

A restore first takes the lock of every GPU it returns to (in index order, so two restores
never wait on each other crosswise), checks free memory, and only then reserves its bytes
and moves them. While it moves, everyone else (the policy, make-room, other restores) sees
the GPU's free memory minus what is reserved, so two restores whose states do not both fit
can never both pass the room check. With node locks (:mod:`.node_locks`), the same holds
across every Jupyter server on the machine.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from .node_locks import NodeGrant, NodeLocks


class Grant:
    """The GPU locks one restore holds, and the bytes it reserved under them."""

    def __init__(self, ledger: Reservations, gpus: list[int], node: NodeGrant | None = None):
        self._ledger = ledger
        self.gpus = gpus
        self.reserved: dict[int, int] = {}
        self._released = False
        self._node = node

    def reserve(self, need: dict[int, int]) -> None:
        for gpu, n in need.items():
            self._ledger._bytes[gpu] += n
            self.reserved[gpu] = self.reserved.get(gpu, 0) + n

    def release(self) -> None:
        """Give back the reservation and the locks (idempotent)."""
        if self._released:
            return
        self._released = True
        for gpu, n in self.reserved.items():
            self._ledger._bytes[gpu] -= n
            if not self._ledger._bytes[gpu]:
                del self._ledger._bytes[gpu]
        self.reserved = {}
        if self._node is not None:
            self._node.release()
        for gpu in reversed(self.gpus):
            self._ledger._locks[gpu].release()


class Reservations:
    def __init__(self, node_locks: NodeLocks | None = None,
                 uuid_of: Callable[[int], str | None] | None = None) -> None:
        """``node_locks``: also take each GPU's lock file, keyed by ``uuid_of(index)`` (GPUs
        without a UUID take none)."""
        self._bytes: defaultdict[int, int] = defaultdict(int)
        self._locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.node_locks = node_locks
        self.uuid_of = uuid_of or (lambda gpu: None)

    def reserved(self, gpu: int) -> int:
        return self._bytes.get(gpu, 0)

    def snapshot(self) -> dict[int, int]:
        return {g: n for g, n in self._bytes.items() if n}

    def seen_free(self, gpu: int, free: int | None) -> int | None:
        """Free memory as others must see it: minus what restores have reserved."""
        return None if free is None else free - self.reserved(gpu)

    def busy(self, gpu: int) -> bool:
        """A restore holds this GPU now."""
        return self._locks[gpu].locked()

    async def acquire(self, gpus: list[int]) -> Grant:
        """Wait for the locks of ``gpus``; cancellation leaves none of them held."""
        order = sorted(set(gpus))
        taken: list[int] = []
        try:
            for gpu in order:
                await self._locks[gpu].acquire()
                taken.append(gpu)
            node = None
            if self.node_locks is not None:
                keys = [u for u in (self.uuid_of(g) for g in order) if u]
                node = await self.node_locks.acquire(keys) if keys else None
        except BaseException:
            for gpu in reversed(taken):
                self._locks[gpu].release()
            raise
        return Grant(self, order, node)
