"""Bytes on their way into host memory, counted while releases run: every claim's undo, in
any order, leaves the count of the claims still running; a release that copies nothing (its
kept host copies are all current) claims nothing and never breaks another's undo.

Found by the load benchmark's smoke run: two releases at once, one with nothing left to copy;
the other's undo deleted the scope's entry and the first's undo failed the release with
``KeyError: 'machine'``."""

from __future__ import annotations

from itertools import permutations

from jupyter_gpushare.core.hostmem import HostRoom

from .test_room import GiB, controller

CLAIMS = [("machine", 0), ("machine", 5 * GiB), ("cgroup:/u", 3 * GiB), ("machine", 0),
          ("machine", 2 * GiB)]


def test_every_order_of_undos_leaves_the_claims_still_running():
    for order in permutations(range(len(CLAIMS))):
        c = controller()
        undos = [c._host_claim(scope, n) for scope, n in CLAIMS]
        running = set(range(len(CLAIMS)))
        for i in order:
            undos[i]()
            undos[i]()  # an undo runs once, however often it is called
            running.discard(i)
            want: dict[str, int] = {}
            for j in running:
                scope, n = CLAIMS[j]
                if n:
                    want[scope] = want.get(scope, 0) + n
            assert c.host_inflight == want, (order, i)
        assert c.host_inflight == {}


def test_claims_in_flight_count_against_the_host_room_and_nothing_claims_nothing():
    c = controller()
    c.host_memory_reserve = 0
    room = HostRoom(10 * GiB, "machine", "the machine has 10 GiB available")
    nothing = c._host_claim("machine", 0)
    assert c.host_inflight == {}
    six = c._host_claim("machine", 6 * GiB)
    refusal = c._host_refusal(room, 5 * GiB)
    assert refusal is not None and "6.0 GiB of other releases in flight" in refusal
    six()
    nothing()
    assert c._host_refusal(room, 5 * GiB) is None
