"""Runs: one policy on one workload, and the most users per GPU a policy serves.

"Serves" means: no cell failed for lack of GPU memory, and the 99th percentile of cell
delay (the wait before a cell starts, over every cell) is within ``delay_bound``. The search
assumes that more users never make things better (user ``i`` is the same person whatever the
count, so adding users only adds load): it doubles users per GPU until a count fails, then
bisects between the last that served and the first that did not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .engine import Simulation
from .figures import figures
from .settings import POLICIES, Settings
from .workload import GiB, Workload


def run(workload: Workload, policy: str, s: Settings, series: bool = False) -> dict[str, Any]:
    sim = Simulation(workload, POLICIES[policy](s), int(s.gpu_gib * GiB), s.gpus, s.transfer,
                     nodes=s.nodes, bin_seconds=s.bin_seconds)
    return figures(sim.run(), series=series)


def serves(f: dict[str, Any], s: Settings) -> bool:
    return f["oom_failures"] == 0 and f["cell_delay_p99_s"] <= s.delay_bound


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
        "users_per_gpu": best / gpus,
        "capped": policy != "exclusive" and best >= s.max_users_per_gpu * gpus,
        "figures": cache.get(best),
        "probes": sorted(probes, key=lambda p: p["users"]),
    }
