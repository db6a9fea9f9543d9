"""Making room for one person's restore from other people's idle kernels. Pure.

The rules are :mod:`.policy`'s, applied across users, plus fair shares (:mod:`.fairshare`):

- only kernels :func:`policy.eligible` allows are taken (resident, not busy, not pinned,
  quiet on the GPU, not opted out, big enough, releasable): a person working is never
  evicted, exactly as on one server;
- a kernel must have been idle for ``pressure_idle_timeout``, or for the shorter
  ``over_share_idle_timeout`` when its owner holds more than their share;
- kernels of people over their share go first, then longest idle first;
- nobody within their share is released for someone over theirs;
- the requester's own kernels are left to their own server (it makes room among them first).

The same rules make room for the next try of a cell that ran out of memory, when its own
server's idle kernels could not (:func:`room_after_oom`).

No I/O and no clock: the hub service and the simulator both call :func:`make_room` and
:func:`room_after_oom`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from .. import policy
from .fairshare import Ledger
from .placement import pressure_floor


@dataclass(frozen=True)
class HubPolicy:
    base: policy.PolicyConfig  # idle_utilization, min_release_bytes, pressure_idle_timeout
    over_share_idle_timeout: float = 30.0  # s idle before an over-share person's kernel may go


@dataclass(frozen=True)
class Holding:
    """One kernel of one person, as the policy sees it (GPU keys are node-wide GPU ids)."""

    user: str
    candidate: policy.Candidate


@dataclass(frozen=True)
class Victim:
    user: str
    kernel_id: str
    reason: str
    bytes: dict[int, int]  # per GPU, what the release frees
    idle_for: float  # the idle time the rule required of it (its server checks it again)


@dataclass(frozen=True)
class Plan:
    victims: list[Victim]
    enough: bool  # releasing ``victims`` makes the room; False: nothing is to be released
    why_not: str = ""  # when not enough: why, for the person who waits


def make_room(
    requester: str,
    need: Mapping[int, int],
    free: Mapping[int, int],
    holdings: list[Holding],
    ledger: Ledger,
    cfg: HubPolicy,
    gpu_names: Mapping[int, str] | None = None,
    landing: Mapping[int, int] | None = None,
    purpose: str = "restore",
) -> Plan:
    """Other people's kernels to release so ``need`` bytes fit on each GPU (all or nothing).

    ``free`` is each GPU's free memory seen now; ``landing`` what other restores will still
    take there although ``free`` does not show it yet (in flight, their bytes reserved and not
    landed; or room already made for them): the room is ``free`` less that; ``ledger`` each
    person's memory and share (it is not changed); ``purpose``: what the room is for, in the
    victims' reasons ("restore": a restore's; "cell": a cell's next try after it ran out of
    memory)."""
    names = gpu_names or {}
    room = {g: free.get(g, 0) - (landing or {}).get(g, 0) for g in need}
    short = {g: n - room[g] for g, n in need.items() if n > room[g]}
    if not short:
        return Plan([], True)
    requester_within = all(ledger.within(requester, g, n) for g, n in need.items())
    usage = {u: dict(per) for u, per in ledger.usage.items()}
    sim = Ledger(ledger.gpu_total, ledger.node_of, usage, ledger.shares, ledger.enabled)

    def over(h: Holding) -> bool:
        return any(sim.over(h.user, g) for g in short if h.candidate.gpu_bytes.get(g))

    on_short = [h for h in holdings if h.user != requester
                and any(h.candidate.gpu_bytes.get(g) for g in short)]
    skipped: Counter[str] = Counter()
    # over-share owners first, then kernels over their memory cap, then longest idle, then
    # biggest; re-checked as releases add up
    order = sorted(on_short, key=lambda h: (not over(h), not h.candidate.over_cap,
                                            -h.candidate.idle_seconds, -h.candidate.bytes,
                                            h.user, h.candidate.kernel_id))
    victims: list[Victim] = []
    for h in order:
        c = h.candidate
        why = _not_taken(h, over(h), requester_within, cfg)
        if why:
            skipped[why] += 1
            continue
        was_over = over(h)
        victims.append(Victim(h.user, c.kernel_id, _reason(requester, c, was_over, purpose),
                              dict(c.gpu_bytes),
                              cfg.over_share_idle_timeout if was_over else cfg.base.pressure_idle_timeout))
        for g, n in c.gpu_bytes.items():
            sim.take(h.user, g, n)
            if g in short:
                short[g] -= n
                if short[g] <= 0:
                    del short[g]
        if not short:
            return Plan(victims, True)
    return Plan([], False, _why_not(short, on_short, skipped, names))


def _not_taken(h: Holding, owner_over: bool, requester_within: bool, cfg: HubPolicy) -> str:
    """Why this kernel stays ("" = it may go)."""
    c = h.candidate
    if c.pinned:
        return "pinned"
    if not c.resident:
        return "not resident"
    if not policy.eligible(c, cfg.base):
        if c.busy or c.max_utilization > cfg.base.idle_utilization:
            return "active"
        return "not releasable"
    if not owner_over and not requester_within:
        return "within share"
    wait = cfg.over_share_idle_timeout if owner_over else cfg.base.pressure_idle_timeout
    if c.idle_seconds < wait:
        return "recent"
    return ""


def room_after_oom(
    requester: str,
    need: Mapping[int, int],
    free: Mapping[int, int],
    total: Mapping[int, int],
    holdings: list[Holding],
    ledger: Ledger,
    cfg: HubPolicy,
    gpu_names: Mapping[int, str] | None = None,
    landing: Mapping[int, int] | None = None,
) -> Plan:
    """Other people's kernels to release so that the next try of ``requester``'s cell, which
    failed to allocate ``need`` bytes per GPU, fits: room for those bytes plus the pressure
    threshold's share of each GPU (``total`` its memory), so that the retry leaves the GPU out
    of pressure, else for the bytes alone; as the server's own make-room after such an error
    (:func:`.oom.plan`) does among its own kernels, by :func:`make_room`'s rules across
    users."""
    floor = pressure_floor({g: total.get(g, 0) for g in need}, cfg.base.pressure_free_fraction)
    with_floor = make_room(requester, {g: n + floor[g] for g, n in need.items()}, free, holdings,
                           ledger, cfg, gpu_names, landing, purpose="cell")
    if with_floor.enough:
        return with_floor
    return make_room(requester, need, free, holdings, ledger, cfg, gpu_names, landing,
                     purpose="cell")


def _reason(requester: str, c: policy.Candidate, owner_over: bool, purpose: str) -> str:
    owner = "its owner is over their share, " if owner_over else ""
    what = "cell, which ran out of memory" if purpose == "cell" else "restore"
    return f"making room for {requester}'s {what}: {owner}idle for {c.idle_seconds:.0f} s"


_SAID = {
    "active": ("is active", "are active"),
    "recent": ("was used in the last few minutes", "were used in the last few minutes"),
    "pinned": ("is pinned", "are pinned"),
    "within share": ("is within its owner's share (and yours is used up)",
                     "are within their owners' shares (and yours is used up)"),
    "not releasable": ("cannot be released (no method, or its state would not fit in host memory)",
                       "cannot be released (no method, or their state would not fit in host memory)"),
    "not resident": ("is already released", "are already released"),
}


def _why_not(short: dict[int, int], on_short: list[Holding], skipped: Counter[str],
             names: Mapping[int, str]) -> str:
    """"GPU 0 is full; the other kernels on it are active", and the like."""
    gpus = ", ".join(names.get(g, f"GPU {g}") for g in sorted(short))
    full = f"{gpus} {'is' if len(short) == 1 else 'are'} full"
    if not on_short:
        return f"{full}; no other person's kernel holds memory there"
    if not skipped:
        return f"{full}; releasing every idle kernel of other people there would not free enough"
    if len(skipped) == 1:
        (what, count), = skipped.items()
        said = _SAID[what][1 if count > 1 else 0]
        return f"{full}; the other {'kernels' if count > 1 else 'kernel'} on it {said}"
    parts = [f"{n} {_SAID[w][1 if n > 1 else 0]}" for w, n in skipped.most_common()]
    return f"{full}; of the other kernels on it, " + ", ".join(parts)
