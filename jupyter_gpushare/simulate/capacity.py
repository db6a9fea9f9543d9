"""Runs: one policy on one workload; the fewest GPUs that serve a workload's users (the
headline); and the most users per GPU a policy serves on a given node (the second table).

"Serves" means all of: no cell failed for lack of GPU memory; the 99th percentile of cell
delay (the wait before a cell starts, over every cell) is within ``delay_bound``; the 99th
percentile of GPU cells' slowdown (run time over the time alone on the GPU, from sharing
SMs) is within ``slowdown_bound``; and no cell was left unfinished at the trace's end because
sharing SMs slowed it. Both searches assume more load never makes things better (more users
on a node, or fewer GPUs for the same users); the probes each tried are kept, so where that
does not hold (round-robin placement can jump) it shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .defaults import MOVE_AFTER
from .engine import Simulation
from .figures import figures
from .policies import RELEASE_POLICIES
from .settings import POLICIES, Settings
from .transfer import PRESETS, TransferModel
from .workload import GiB, Workload

AHEAD_LEADS = (0.0, 2.0, 5.0, 10.0, 30.0)  # s: the sensitivity table's leads
DEFAULT_MOVE_AFTER = MOVE_AFTER  # s: the product's restore_move_after, where the settings say 0


def placements(s: Settings) -> list[tuple[str, dict[str, Any]]]:
    """The placement table's configurations: (name, settings): round-robin (servers too)
    without and with moves (``s.move_after``, or the product's default where it is 0); the
    product's placement without moves, with them, and with rebalance too (the product)."""
    after = s.move_after if s.move_after > 0 else DEFAULT_MOVE_AFTER
    rr = {"placement": "round-robin", "servers": "round-robin", "rebalance": False}
    room = {"placement": "room", "servers": "rule", "rebalance": False}
    move = f" + move {after:g} s"
    return [("round-robin", {**rr, "move_after": 0.0}),
            (f"round-robin{move}", {**rr, "move_after": after}),
            ("room", {**room, "move_after": 0.0}),
            (f"room{move}", {**room, "move_after": after}),
            ("room + move + rebalance", {**room, "move_after": after, "rebalance": True})]


def run(workload: Workload, policy: str, s: Settings, series: bool = False,
        total_gpus: int | None = None) -> dict[str, Any]:
    """One run; ``total_gpus``: that many GPUs (machines of ``s.gpus``) instead of the node."""
    sim = Simulation(workload, POLICIES[policy](s), int(s.gpu_gib * GiB), s.gpus, s.transfer,
                     nodes=s.nodes, bin_seconds=s.bin_seconds, restore_mode=s.restore_mode,
                     placement=s.placement, total_gpus=total_gpus, ahead_lead=s.ahead_lead,
                     ahead_share=s.ahead_share, seed=s.seed, servers=s.servers,
                     load_window=s.load_window, release_copies=s.release_copies,
                     precopy_after=s.precopy_after)
    return figures(sim.run(), series=series)


def compute_limit(workload: Workload, s: Settings) -> dict[str, Any]:
    """The fewest GPUs compute alone allows: the peak of the SM % asked by the cells running
    at once (summed over GPUs, each cell its SM % on each of its GPUs), as each user's own
    GPUs run them (``exclusive``: no cell waits), in GPUs: ceil(peak / 100). No placement
    can serve every user on fewer without slowing cells down."""
    peak = run(workload, "exclusive", s)["peak_sm_demand_pct"]
    return {"gpus": max(1, math.ceil(peak / 100.0 - 1e-9)), "peak_sm_demand_pct": peak}


def failing(f: dict[str, Any], s: Settings) -> dict[str, list[str]]:
    """What keeps a run from serving, by criterion (``out of memory``, ``delay``, ``SMs``:
    a slowdown or cells left unfinished by sharing SMs); only the criteria that fail."""
    out: dict[str, list[str]] = {}
    if f["oom_failures"]:
        n = f["oom_failures"]
        out["out of memory"] = [f"{n} cell{'' if n == 1 else 's'} out of memory"]
    if f["cell_delay_p99_s"] > s.delay_bound:
        out["delay"] = [f"p99 delay {f['cell_delay_p99_s']:.2f} s > {s.delay_bound:g} s"]
    sms = []
    if f["gpu_cell_slowdown_p99"] > s.slowdown_bound:
        sms.append(f"p99 slowdown {f['gpu_cell_slowdown_p99']:.2f} > {s.slowdown_bound:g}")
    if f["cells_unfinished_contention"]:
        n = f["cells_unfinished_contention"]
        sms.append(f"{n} cell{'' if n == 1 else 's'} unfinished (SMs shared)")
    if sms:
        out["SMs"] = sms
    return out


def why_not(f: dict[str, Any], s: Settings) -> list[str]:
    """What keeps a run from serving; empty when it serves."""
    return [reason for reasons in failing(f, s).values() for reason in reasons]


def serves(f: dict[str, Any], s: Settings) -> bool:
    return not why_not(f, s)


def fewest_gpus(policy: str, workload: Workload, s: Settings, every: bool = False,
                from_gpus: int | None = None) -> dict[str, Any]:
    """The fewest GPUs (in machines of ``s.gpus``) on which ``policy`` serves every user of
    ``workload``, with that run's figures; ``exclusive``: its own count, by definition.

    Bisects between the widest kernel's GPUs and exclusive's count (which serves unless a
    user's own kernels do not fit a GPU); None where not even that serves. ``every``: then
    tries each count below the one found too (placement can make fewer GPUs serve where
    more do not); ``from_gpus``: the same from that count up (the compute limit: fewer
    cannot serve without slowing cells); ``fails_above``: the counts above the fewest tried
    that do not serve."""
    probes: list[dict[str, Any]] = []
    cache: dict[int, dict[str, Any]] = {}
    top = sum(workload.user_gpus().values())
    low = max((k.gpus for k in workload.kernels), default=1)

    def ok(gpus: int) -> bool:
        if gpus not in cache:
            cache[gpus] = run(workload, policy, s, total_gpus=gpus)
            f = cache[gpus]
            probes.append({"gpus": gpus, "serves": serves(f, s), "why_not": why_not(f, s)})
        return serves(cache[gpus], s)

    if policy == "exclusive":
        best: int | None = top if ok(top) else None
    else:
        best = None
        lo, hi = low - 1, top  # lo fails (or is below what a kernel needs), hi is to check
        if ok(hi):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if ok(mid) else (mid, hi)
            best = hi
            if every or from_gpus is not None:
                start = low if every else min(best, max(low, from_gpus or low))
                best = next(g for g in range(start, best + 1) if ok(g))
    f = cache.get(best) if best is not None else None
    hours = workload.duration / 3600.0
    reserved = workload.reserved_gpu_seconds() / 3600.0
    paid = None if f is None else f["gpu_hours"]
    return {
        "gpus": best,
        "users": len(workload.users),
        "gpu_hours": paid,
        "reserved_gpu_hours": reserved,
        "vs_reserved": None if paid is None or not reserved else paid / reserved,
        "hours": hours,
        "figures": f,
        "probes": sorted(probes, key=lambda p: p["gpus"]),
        "fails_above": sorted(p["gpus"] for p in probes
                              if best is not None and p["gpus"] > best and not p["serves"]),
    }


def most_users(policy: str, workload_for: Callable[[int], Workload], s: Settings) -> dict[str, Any]:
    gpus = s.total_gpus
    probes: list[dict[str, Any]] = []
    cache: dict[int, dict[str, Any]] = {}

    def ok(users: int) -> bool:
        if users not in cache:
            cache[users] = run(workload_for(users), policy, s)
            f = cache[users]
            probes.append({"users": users, "serves": serves(f, s), "oom_failures": f["oom_failures"],
                           "cell_delay_p99_s": f["cell_delay_p99_s"]})
        return serves(cache[users], s)

    if policy == "exclusive":  # one GPU per user, by definition
        best = gpus if ok(gpus) else 0
    else:
        cap = s.max_users_per_gpu * gpus
        lo, hi = 0, 0  # lo serves (0 users trivially), hi fails (0: none found yet)
        users = gpus
        while users <= cap:
            if not ok(users):
                hi = users
                break
            lo, users = users, users * 2
        if not hi and lo < cap:
            if ok(cap):
                lo = cap
            else:
                hi = cap
        while hi and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        best = lo
    return {
        "users": best,
        # exclusive: its users over the GPUs it gave them (more than one each for wide kernels)
        "users_per_gpu": (cache[best]["users_per_gpu"] if policy == "exclusive" and best
                          else best / gpus),
        "capped": policy != "exclusive" and best >= s.max_users_per_gpu * gpus,
        "figures": cache.get(best),
        "probes": sorted(probes, key=lambda p: p["users"]),
    }


def ahead_sensitivity(policy: str, workload: Workload, s: Settings,
                      models: list[TransferModel]) -> list[dict[str, Any]]:
    """``policy`` on ``workload`` for each lead of ``AHEAD_LEADS`` under each release policy
    (``s.release_policy``'s first): at the node's GPUs, the delays and restores ahead; and the
    fewest GPUs that serve every user under each of ``models``, with the delays there."""
    rows = []
    for release in sorted(RELEASE_POLICIES, key=lambda r: r != s.release_policy):
        for lead in AHEAD_LEADS:
            at = replace(s, ahead_lead=lead, release_policy=release)
            f = run(workload, policy, at)
            fewest = {}
            for m in models:
                c = fewest_gpus(policy, workload, replace(at, transfer=m))
                there = c["figures"] or {}
                fewest[m.name] = {"gpus": c["gpus"], "cell_delay_p99_s": there.get("cell_delay_p99_s"),
                                  "delay_max_s": there.get("delay_max_s"),
                                  "cells_delayed_pct": there.get("cells_delayed_pct")}
            rows.append({"release_policy": release, "ahead_lead_s": lead, "gpus": f["gpus"],
                         **{k: f[k] for k in ("cell_delay_p99_s", "delay_max_s", "cells_delayed_pct",
                                              "releases", "restores", "ahead_requests",
                                              "ahead_restores", "ahead_released_again",
                                              "ahead_cancelled")},
                         "fewest_gpus": fewest})
    return rows


RELEASE_MODELS = ("driver", "pinned", "sim")  # the release table's transfer models


def release_comparison(policy: str, workload: Workload, s: Settings) -> list[dict[str, Any]]:
    """``policy`` on ``workload`` under each transfer model (``s.transfer`` first, then
    ``RELEASE_MODELS``), releases that copy everything (the baseline) against those that copy
    what changed since the host copy (the product's): at the node's GPUs, the cells whose
    restore found no room at once (their p99 and worst delay), every cell's p99, the bytes
    copied; and the fewest GPUs that serve every user."""
    models = [s.transfer] + [PRESETS[m] for m in RELEASE_MODELS if m != s.transfer.name]
    rows = []
    for m in models:
        for copies in ("all", "changed"):
            at = replace(s, transfer=m, release_copies=copies)
            f = run(workload, policy, at)
            c = fewest_gpus(policy, workload, at)
            rows.append({"model": m.name, "incremental": m.incremental, "release_copies": copies,
                         "gpus": f["gpus"],
                         **{k: f[k] for k in ("room_waits", "room_wait_p99_s", "room_wait_max_s",
                                              "cell_delay_p99_s", "delay_max_s", "releases",
                                              "release_gib_copied")},
                         "fewest_gpus": c["gpus"]})
    return rows


def placement_comparison(policy: str, workload: Workload, s: Settings,
                         models: list[TransferModel]) -> list[dict[str, Any]]:
    """``policy`` on ``workload`` under each of :func:`placements`: round-robin and the
    product's placement, without and with restores that move and rebalance. At the node's GPUs: the delays and moves; and the fewest GPUs that serve
    every user under each of ``models`` (every count below the bisection's tried: placement
    is not monotonic), with the delays and moves there and the larger counts that fail."""
    rows = []
    for name, config in placements(s):
        at = replace(s, **config)
        f = run(workload, policy, at)
        fewest = {}
        for m in models:
            c = fewest_gpus(policy, workload, replace(at, transfer=m), every=True)
            there = c["figures"] or {}
            fewest[m.name] = {"gpus": c["gpus"], "cell_delay_p99_s": there.get("cell_delay_p99_s"),
                              "delay_max_s": there.get("delay_max_s"),
                              "cells_delayed_pct": there.get("cells_delayed_pct"),
                              "moves": there.get("moves"), "fails_above": c["fails_above"],
                              "probes": c["probes"]}
        rows.append({"configuration": name, "placement": at.placement, "servers": at.servers,
                     "move_after_s": at.move_after, "rebalance": at.rebalance, "gpus": f["gpus"],
                     **{k: f[k] for k in ("cell_delay_p99_s", "delay_max_s", "cells_delayed_pct",
                                          "cells_still_waiting_at_end", "releases", "restores",
                                          "moves")},
                     "fewest_gpus": fewest})
    return rows
