"""GPU memory promised to restores, and one restore at a time per GPU.

A restore first takes the lock of every GPU it returns to (in index order, so two restores
never wait on each other crosswise), checks free memory, and only then reserves its bytes
and moves them. While it moves, everyone else (the policy, make-room, other restores) sees
the GPU's free memory minus what is reserved, so two restores whose states do not both fit
can never both pass the room check. With node locks (:mod:`.node_locks`), the same holds
across the Jupyter servers of the machine; a GPU whose node lock could not be had is named in
:attr:`Grant.unguarded` (the caller then checks room more strictly).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from ..node.node_locks import NodeGrant, NodeLocks

#: on_turn_wait(gpu, holder pid or None, seconds it may still wait)
OnTurnWait = Callable[[int, "int | None", float], None]


class Grant:
    """The GPU locks one restore holds, and the bytes it reserved under them."""

    def __init__(self, ledger: Reservations, gpus: list[int], node: NodeGrant | None = None,
                 unguarded: dict[int, str] | None = None):
        self._ledger = ledger
        self.gpus = gpus
        #: GPU -> why no turn across servers was had on it (refused, or held too long elsewhere)
        self.unguarded = dict(unguarded or {})
        self.reserved: dict[int, int] = {}
        #: GPU released from -> GPU restored onto, for a restore that moves (empty: stays)
        self.mapping: dict[int, int] = {}
        #: why the restore goes onto ``mapping`` ("GPU 0 busy ..."), or why it stays on a busy
        #: GPU ("" = nothing to say: a restore without room moves, one with room stays)
        self.why = ""
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

    async def acquire(self, gpus: list[int], on_turn_wait: OnTurnWait | None = None) -> Grant:
        """Wait for the locks of ``gpus``; cancellation leaves none of them held.
        ``on_turn_wait`` hears when a GPU's turn is held by another server's restore."""
        order = sorted(set(gpus))
        taken: list[int] = []
        try:
            for gpu in order:
                await self._locks[gpu].acquire()
                taken.append(gpu)
            node = None
            unguarded: dict[int, str] = {}
            if self.node_locks is not None:
                by_key = {u: g for g, u in ((g, self.uuid_of(g)) for g in order) if u}

                def waits(key: str, holder: int | None, left: float) -> None:
                    if on_turn_wait is not None:
                        on_turn_wait(by_key[key], holder, left)

                node = await self.node_locks.acquire(list(by_key), waits) if by_key else None
                if node is not None:
                    unguarded = {by_key[k]: why for k, why in node.unguarded.items()}
        except BaseException:
            for gpu in reversed(taken):
                self._locks[gpu].release()
            raise
        return Grant(self, order, node, unguarded)
