"""GPU memory promised to restores, and one restore at a time per GPU.

A restore first takes the lock of every GPU it returns to (in index order, so two restores
never wait on each other crosswise), checks free memory, and only then reserves its bytes
and moves them. While it moves, everyone else (the policy, make-room, other restores) sees
the GPU's free memory minus what is reserved and has not landed yet, so two restores whose
states do not both fit can never both pass the room check. Bytes that have landed (the node
measures the restoring process holding them) count in the GPU's used memory already: reserved
as well, they would be counted twice, and an idle kernel released for pressure that is not
there. Where the process is not measured, the whole reservation counts until the restore
ends. With node locks (:mod:`.node_locks`), the same holds
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
#: what the restoring process holds per GPU as the node last measured it (None: not measured)
Holds = Callable[[], "dict[int, int] | None"]


class Grant:
    """The GPU locks one restore holds, and the bytes it reserved under them."""

    def __init__(self, ledger: Reservations, gpus: list[int], node: NodeGrant | None = None,
                 unguarded: dict[int, str] | None = None):
        self._ledger = ledger
        self.gpus = gpus
        #: GPU -> why no turn across servers was had on it (refused, or held too long elsewhere)
        self.unguarded = dict(unguarded or {})
        self.reserved: dict[int, int] = {}
        self._holds: Holds | None = None
        self._before: dict[int, int] | None = None  # what the process held when it reserved
        #: GPU released from -> GPU restored onto, for a restore that moves (empty: stays)
        self.mapping: dict[int, int] = {}
        #: why the restore goes onto ``mapping`` ("GPU 0 busy ..."), or why it stays on a busy
        #: GPU ("" = nothing to say: a restore without room moves, one with room stays)
        self.why = ""
        self._released = False
        self._node = node

    def reserve(self, need: dict[int, int], holds: Holds | None = None) -> None:
        """Reserve ``need`` bytes per GPU. ``holds``: what the restoring process holds per
        GPU at the node's last reading; what it holds beyond what it held now has landed and
        is no longer counted as reserved (see :meth:`outstanding`)."""
        for gpu, n in need.items():
            self.reserved[gpu] = self.reserved.get(gpu, 0) + n
        if holds is not None:
            self._holds, self._before = holds, holds()
        self._ledger._grants.add(self)

    def outstanding(self, gpu: int) -> int:
        """Reserved bytes on ``gpu`` that have not landed yet. Landed = what the process
        holds there now beyond what it held when it reserved, both as the node measured them:
        a reading that lags counts less as landed (more as reserved), never more; a process
        the node does not measure (now or then) counts its whole reservation."""
        n = self.reserved.get(gpu, 0)
        if not n or self._holds is None or self._before is None:
            return n
        now = self._holds()
        if now is None:
            return n
        landed = max(0, now.get(gpu, 0) - self._before.get(gpu, 0))
        return max(0, n - landed)

    def release(self) -> None:
        """Give back the reservation and the locks (idempotent)."""
        if self._released:
            return
        self._released = True
        self._ledger._grants.discard(self)
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
        self._grants: set[Grant] = set()  # grants holding a reservation
        self._locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.node_locks = node_locks
        self.uuid_of = uuid_of or (lambda gpu: None)

    def reserved(self, gpu: int) -> int:
        """Bytes restores have reserved on ``gpu`` and not landed yet."""
        return sum(grant.outstanding(gpu) for grant in list(self._grants))

    def snapshot(self) -> dict[int, int]:
        """:meth:`reserved` of every GPU with some."""
        gpus = {g for grant in list(self._grants) for g in grant.reserved}
        return {g: n for g in sorted(gpus) if (n := self.reserved(g))}

    def seen_free(self, gpu: int, free: int | None) -> int | None:
        """Free memory as others must see it: minus what restores have reserved and not
        landed yet."""
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
