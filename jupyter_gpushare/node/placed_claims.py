"""Kernels placed and not using their GPU yet, shared by the servers of one node through the
node daemon.

A server places a new kernel on the GPU(s) with room and the least load, but until the kernel
allocates, neither free memory nor SM load shows it: another user's server placing a kernel a
minute later sees the same GPU as empty and puts its kernel there too; nor do they show the
states of another server's released kernels, which come back to that GPU at their restores.
With the hub service the servers learn of both from it; with the node daemon they tell each
other at once: each server sends the daemon what its placed kernels are expected to take per
GPU and what its released kernels' states will take back there (``{"op": "placed", "gpus":
{uuid: {"bytes": B, "kernels": n, "returning": R}}}``, every poll and right after a placement)
and hears back the other servers' sums (``"others"``).

:class:`PlacedClaims` is the daemon's book: one claim per server, replaced by its next
``placed`` request, dropped when not renewed for ``ttl`` seconds (a server that died or stopped
placing). A server is the connection's ``SO_PEERCRED`` uid and pid, and the random token it
sends (``"server"``): the pid alone does not tell servers apart where the daemon runs in
another pid namespace (a Kubernetes DaemonSet sees pid 0 for every pod's process), and a token
nobody else sees keeps another user of the same uid (every pod's ``jovyan``) from replacing
it.
A user can make others' servers think a GPU is more wanted than it is, never less; each
claim's bytes are bounded by :data:`MAX_BYTES` and the reader caps the sum at the GPU's memory,
and one user holds at most :data:`MAX_CLAIMS_PER_USER` claims.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: s a claim lives without being renewed (servers renew theirs every poll: seconds)
CLAIM_TTL = 60.0
MAX_BYTES = 1 << 50  # bytes one claim may name on one GPU (1 PiB: larger is no GPU's)
MAX_KERNELS = 1024  # kernels one claim may name on one GPU
MAX_CLAIMS_PER_USER = 64  # live claims (servers) of one uid, at least
MAX_TOKEN = 64  # characters of a server's token

#: GPU UUID -> (bytes, kernels, returning): placed kernels' expected bytes, how many they are,
#: and the bytes released kernels' states take back at their restores
Claimed = dict[str, tuple[int, int, int]]


class ClaimError(ValueError):
    """A ``placed`` request the daemon refuses; the message says why."""


def parse_claim(value: Any, max_gpus: int) -> Claimed:
    """The ``gpus`` of a ``placed`` request, checked: an object of GPU UUID -> {"bytes": int,
    "kernels": int, "returning": int} (each optional, default 0), >= 0 and bounded. Raises
    :class:`ClaimError`."""
    if not isinstance(value, dict):
        raise ClaimError('"gpus" must be an object of GPU UUID -> {"bytes": n, "kernels": n, '
                         '"returning": n}')
    if len(value) > max_gpus:
        raise ClaimError(f'"gpus" names {len(value)} GPUs (at most {max_gpus})')
    out: Claimed = {}
    for uuid, entry in value.items():
        if not isinstance(entry, dict) or set(entry) - {"bytes", "kernels", "returning"}:
            raise ClaimError(f'"gpus" entry {uuid[:60]!r} must be {{"bytes": n, "kernels": n, '
                             '"returning": n}')
        n = _count(entry.get("bytes", 0), MAX_BYTES, "bytes", uuid)
        k = _count(entry.get("kernels", 0), MAX_KERNELS, "kernels", uuid)
        r = _count(entry.get("returning", 0), MAX_BYTES, "returning", uuid)
        if n or k or r:
            out[uuid] = (n, k, r)
    return out


def parse_others(value: Any) -> Claimed:
    """The ``others`` of the daemon's answer: sums, so unbounded; entries that are not
    counts are left out."""
    out: Claimed = {}
    if not isinstance(value, dict):
        raise ClaimError("the answer has no others map")
    for uuid, entry in value.items():
        if not isinstance(uuid, str) or not isinstance(entry, dict):
            continue
        counts = (entry.get("bytes", 0), entry.get("kernels", 0), entry.get("returning", 0))
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts):
            out[uuid] = (int(counts[0]), int(counts[1]), int(counts[2]))
    return out


def _count(value: Any, most: int, name: str, uuid: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ClaimError(f'"{name}" of GPU {uuid[:60]!r} must be an integer from 0 to {most}, '
                         f"got {str(value)[:40]}")
    return value


@dataclass
class Claim:
    uid: int
    gpus: Claimed
    at: float


#: who a claim is: (uid, pid, the server's token)
Server = tuple[int, int, str]


def parse_token(value: Any) -> str:
    """A ``placed`` request's ``server`` token: letters, digits, ``-`` and ``_``, at most
    :data:`MAX_TOKEN`; "" when not sent."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TOKEN or \
            not all(ch.isascii() and (ch.isalnum() or ch in "-_") for ch in value):
        raise ClaimError(f'"server" must be a token of at most {MAX_TOKEN} letters, digits, - '
                         "or _")
    return value


class PlacedClaims:
    """The daemon's book of claims: per server, what its placed kernels take."""

    def __init__(self, ttl: float = CLAIM_TTL, now: Callable[[], float] = time.monotonic,
                 per_user: int = MAX_CLAIMS_PER_USER):
        """per_user: live claims one uid may hold (where every pod runs as one uid, every
        server of the node's)."""
        self.ttl = ttl
        self.now = now
        self.per_user = per_user
        self.claims: dict[Server, Claim] = {}  # server -> its latest claim

    def put(self, server: Server, gpus: Claimed) -> None:
        """``server``'s claim is ``gpus`` from now on (empty: it has none). Raises
        :class:`ClaimError` when its user holds too many claims already."""
        self._expire()
        if not gpus:
            self.claims.pop(server, None)
            return
        uid = server[0]
        if server not in self.claims and \
                sum(c.uid == uid for c in self.claims.values()) >= self.per_user:
            raise ClaimError(f"uid {uid} holds {self.per_user} claims already (one per "
                             "server): withdraw one first")
        self.claims[server] = Claim(uid, dict(gpus), self.now())

    def others(self, server: Server) -> Claimed:
        """The live claims of every server but ``server``, summed per GPU."""
        self._expire()
        out: Claimed = {}
        for who, claim in self.claims.items():
            if who == server:
                continue
            for uuid, (n, k, r) in claim.gpus.items():
                b, c, t = out.get(uuid, (0, 0, 0))
                out[uuid] = (b + n, c + k, t + r)
        return out

    def _expire(self) -> None:
        cutoff = self.now() - self.ttl
        for who in [w for w, c in self.claims.items() if c.at < cutoff]:
            del self.claims[who]


def encode(claimed: Claimed) -> dict[str, dict[str, int]]:
    return {uuid: {"bytes": n, "kernels": k, "returning": r}
            for uuid, (n, k, r) in sorted(claimed.items())}
