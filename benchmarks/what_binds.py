"""What keeps gpushare from serving a workload on fewer GPUs: lower bounds next to the compute
limit, and at each GPU count which criterion fails and why.

The workload and settings are ``jupyter gpushare simulate``'s (the same options after ``--``):
the default synthetic workload, ``--quick``'s, or ``--trace FILE``. From the exclusive run (no
cell waits, no SMs shared):

- compute limit: the peak of the SM % asked by the cells running at once, in GPUs (as the
  simulator's headline);
- cells above 50 % SM at once: two such cells cannot share a GPU without slowing each other,
  so at that moment as many GPUs as they span are needed (a packing bound);
- delay budget: p99 cell delay <= 1 s lets at most 1 % of cells wait > 1 s; a released state
  whose restore takes > 1 s makes its next cell wait that long (no activity is seen ahead of
  cells by default); the gaps longer than the product's ``long_idle`` before such a cell are
  releases the product made whatever the GPU count before ``long_idle_free_fraction`` (at 1 it
  still does), each a cell that waits;
- memory bound: the bytes that must be on the GPUs at once: kernels computing, and kernels
  idle between cells whose restore would take > 1 s, less the largest idle states the budget
  left lets go at that moment (with the product's ``long_idle``: idle states count until it);
  in GPUs of the workload's size.

Then gpushare at each GPU count (``--counts``): why it does not serve, the cells that waited
> 1 s by the kind of release before them (those after a long-idle release also by their GPU's
free memory just before it: where it was ample, the release made a cell wait for memory
nobody wanted), the GPU cells slowed > 1.1 x, out-of-memory cells
and the releases by reason; the kernels started where their expected need fit no GPU of
their machine, even with the released states that will come back left out (the rule then
starts them where the most room is), and how many of those went to a GPU at >= 90 % SM while
another GPU there was below it (each shares SMs with a training from its first cell), and
those for which a GPU had the need free only with those states left out (the rule starts
them there); and per machine, its users, cells that waited > 1 s and GPU
cells slowed (a machine of fewer GPUs pools memory over fewer users).

    python benchmarks/what_binds.py [--counts 5,8,13] [--smoke] [--seeds 0-4] [-- SIMULATE OPTIONS]

``--smoke``: the quick workload over one day, at one count: the whole path in seconds.
``--every-server-machine RUNS``: at each count, gpushare again with the users' servers put on
every combination of the machines their widest kernel fits on (at most RUNS runs; the product
chooses a server's machine once, at its user's first kernel, by what it sees then): how many
combinations serve, and one that does. What a better choice of machines could win, with
hindsight.
``--seeds 0-4`` (or ``0,1,2``): instead of the details, the counts at each seed of the
workload (and of the servers' poll phases), one line per seed: the smallest count that
serves, and the larger counts that do not, with why; then the smallest count at which each
criterion alone holds (out of memory: none; delay: p99 <= 1 s; SMs: p99 slowdown
<= 1.1 and no cell unfinished), and the sums over the seeds next to what 1.25x of each
seed's compute limit allows: which criterion keeps the count up. Which counts serve moves by
one or two with where a few kernels land, so a change is judged over seeds, not on seed 0
alone. With ``-- --gpu-gib 8000`` (the same workload: the generator bounds a person's kernels
by 72 GiB whatever the GPU) memory never binds, and what is left is compute sharing.
``--long-idle-share F``: the simulator's long-idle releases held to the product's rule
(``policy.long_idle_releases``: only on a GPU with less than F of its memory free) at share
F; 1 releases at ``long_idle`` whatever the room. For as long as the simulator's ``needs``
releases every kernel idle ``long_idle`` (``simulate/policies.py``, ``GPUShare.releases``)
this is how the product's rule is measured.
``--known-sizes``: with hindsight, every kernel is expected to need what it will hold at its
largest (its start and its cells' allocations) instead of what its person's kernels held
before: how much of the gap to the compute limit comes from not knowing a kernel's size
before it allocates (first allocations that fail, GPUs chosen by a need too small).
``--known-loads``: with hindsight, a new kernel is expected to add the SM % of its heaviest GPU
cell (until it computes) instead of the placement rule's ``PENDING_LOAD`` for everyone: how
much comes from placing a training beside another without knowing it is one.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
from collections import Counter
from dataclasses import replace
from typing import Any

from jupyter_gpushare.policy import placement as rule
from jupyter_gpushare.simulate import policies
from jupyter_gpushare.simulate.capacity import compute_limit, failing, why_not
from jupyter_gpushare.simulate.cli import parser as simulate_parser
from jupyter_gpushare.simulate.cli import settings_from
from jupyter_gpushare.simulate.engine import Simulation
from jupyter_gpushare.simulate.figures import figures
from jupyter_gpushare.simulate.generator import generate
from jupyter_gpushare.simulate.settings import POLICIES, Settings
from jupyter_gpushare.simulate.trace import read_trace
from jupyter_gpushare.simulate.workload import GiB, Workload


def workload_of(argv: list[str]) -> tuple[Workload, Settings, str]:
    args = simulate_parser().parse_args(argv)
    s = settings_from(args)
    if args.trace:
        w, node = read_trace(args.trace[0])
        s = replace(s, gpus=args.gpus or int(node.get("gpus", s.gpus)),
                    gpu_gib=args.gpu_gib or float(node.get("gpu_gib", s.gpu_gib)))
        return w, s, f"trace {args.trace[0]}"
    days = min(2, args.days) if args.quick else args.days
    synthetic = generate(s.max_users_per_gpu * s.total_gpus, days=days, seed=s.seed,
                         gpu_gib=s.gpu_gib)
    users = max(1, round(args.users_per_gpu * s.total_gpus))
    return synthetic.first_users(users), s, f"default workload, {days} days, {users} users"


def simulation(w: Workload, s: Settings, policy: str, total: int | None,
               observer: Any = None, run: bool = True) -> Simulation:
    sim = Simulation(w, POLICIES[policy](s), int(s.gpu_gib * GiB), s.gpus, s.transfer,
                     nodes=s.nodes, bin_seconds=s.bin_seconds, restore_mode=s.restore_mode,
                     placement=s.placement, total_gpus=total, ahead_lead=s.ahead_lead,
                     ahead_share=s.ahead_share, seed=s.seed, servers=s.servers,
                     load_window=s.load_window, release_copies=s.release_copies,
                     precopy_after=s.precopy_after, observer=observer)
    return sim.run() if run else sim


def bounds(w: Workload, s: Settings) -> list[str]:
    by_kernel: dict[int, list[tuple[float, float, int, int]]] = {}

    def seen(t: float, k: Any, what: str, data: dict) -> None:
        if what == "cell":  # (start, end, bytes per GPU held, GPUs held on)
            by_kernel.setdefault(k.index, []).append((data["start"], data["end"], k.held,
                                                      len(k.gpus)))

    ex = simulation(w, s, "exclusive", None, seen)
    cap = s.gpu_gib * GiB
    cells = sum(len(v) for v in by_kernel.values())
    budget = cells - 1 - math.ceil(0.99 * (cells - 1))  # cells that may wait > 1 s at p99 <= 1 s
    slow = lambda n: s.transfer.restore_seconds(n) > 1.0  # noqa: E731
    long_idle = s.long_idle if s.release_policy == "needs" else s.config.idle_timeout
    forced = sum(1 for cs in by_kernel.values() for a, b in zip(sorted(cs), sorted(cs)[1:], strict=False)
                 if b[0] - a[1] > long_idle and slow(min(a[2], b[2])))
    left = max(0, budget - forced)
    out = [f"cells: {cells}; p99 delay <= 1 s lets {budget} wait > 1 s; gaps over long_idle "
           f"({long_idle:g} s) before a cell of a state whose restore takes > 1 s: {forced} "
           f"(each a cell that waits if released: at long_idle_free_fraction 1 at any GPU "
           f"count, else where the GPU is short of room); left: {left}"]
    for label, allowed, cut in (("any release rule", budget, None),
                                (f"releases at long_idle {long_idle:g} s", left, long_idle)):
        events = []
        for cs in by_kernel.values():
            cs.sort()
            for i, (a, e, held, n) in enumerate(cs):
                if held:
                    events += [(a, 1, "cell", held * n, id(cs), i), (e, -1, "cell", held * n, id(cs), i)]
                if i + 1 < len(cs) and slow(min(held, cs[i + 1][2])):
                    end = cs[i + 1][0] if cut is None else min(cs[i + 1][0], e + cut)
                    if end > e:
                        b = min(held, cs[i + 1][2]) * n
                        events += [(e, 1, "gap", b, id(cs), i), (end, -1, "gap", b, id(cs), i)]
        events.sort(key=lambda x: (x[0], x[1]))
        computing, idle, peak, at = 0, {}, 0, 0.0
        for t, d, kind, b, k, i in events:
            if kind == "cell":
                computing += d * b
            elif d > 0:
                idle[(k, i)] = b
            else:
                idle.pop((k, i), None)
            if d > 0:
                held = computing + sum(idle.values()) - sum(heapq.nlargest(allowed, idle.values()))
                if held > peak:
                    peak, at = held, t
        out.append(f"memory bound ({label}): {peak / GiB:.0f} GiB on the GPUs at {at / 3600:.1f} h "
                   f"= {peak / cap:.2f} GPUs of {s.gpu_gib:g} GiB -> {math.ceil(peak / cap - 1e-9)}")
    sm = big = peak_sm = peak_big = 0.0
    at = 0.0
    edges = sorted((t, d, r.utilization * r.gpus, r.gpus if r.utilization > 50 else 0)
                   for r in ex.cells if r.end is not None and r.gpus and r.utilization > 0
                   for t, d in ((r.start, 1), (r.end, -1)))
    for t, d, u, g in edges:
        sm += d * u
        big += d * g
        peak_sm = max(peak_sm, sm)
        if big > peak_big:
            peak_big, at = big, t
    out.insert(0, f"compute limit: {math.ceil(peak_sm / 100 - 1e-9)} GPUs (peak SM demand "
                  f"{peak_sm:.0f} %); cells above 50 % SM at once: {peak_big:.0f} GPUs' worth "
                  f"at {at / 3600:.2f} h")
    return out


FREE_BUCKETS = (0.1, 0.25, 0.5)  # free shares of a GPU: below, between, at or above


def free_bucket(share: float) -> str:
    """``share`` (a GPU's free fraction) as a bucket label: "<10 %", "10-25 %", ... ">=50 %"."""
    edges = [0.0, *FREE_BUCKETS]
    for lo, hi in itertools.pairwise(edges):
        if share < hi:
            return f"<{hi:.0%}" if lo == 0 else f"{lo:.0%}-{hi:.0%}"
    return f">={FREE_BUCKETS[-1]:.0%}"


def at_count(w: Workload, s: Settings, gpus: int, policy: str = "gpushare") -> list[str]:
    released: dict[int, list[tuple[float, str, float]]] = {}
    starts: Counter[str] = Counter()  # kernels started, by how their GPU was judged
    sims: list[Simulation] = []

    def seen(t: float, k: Any, what: str, data: dict) -> None:
        if what == "placed" and k.need is not None:
            sim = sims[0]
            views = sim.views(sim.node_gpus(k.gpus[0]), exclude=k)
            if any(rule.fits(v, k.need) for v in views.values()):
                return
            if any(rule.fits_now(v, k.need) for v in views.values()):
                starts["fit now only"] += 1  # room once released states are left out
                return
            starts["fit nowhere"] += 1
            if views[k.gpus[0]].expected >= rule.CONTENDED_LOAD and any(
                    v.expected < rule.CONTENDED_LOAD for v in views.values()):
                starts["fit nowhere, started on a saturated GPU"] += 1
        if what == "released":
            reason = str(data["reason"])
            kind = ("long idle" if reason.startswith("long idle") else
                    "pressure" if "pressure" in reason or "below" in reason else
                    "rebalance" if reason.startswith("rebalance") else
                    "make-room" if "room" in reason else "idle")
            sim = sims[0]
            # the least free of its GPUs just before this release freed its bytes there
            share = min((sim.node.free(g) - k.held) / sim.node.gpus[g].capacity for g in k.gpus)
            released.setdefault(k.index, []).append((t, kind, share))

    sim = simulation(w, s, policy, gpus, seen, run=False)
    sims.append(sim)
    sim.run()
    f = figures(sim)
    waited: Counter[str] = Counter()
    machine = lambda g: f"GPUs {sim.node_gpus(g).start}-{sim.node_gpus(g).stop - 1}"  # noqa: E731
    per: dict[str, Counter[str]] = {}
    long_free: Counter[str] = Counter()  # long-idle waits by their GPU's free share at release
    for r in sim.cells:
        if r.delay > 1.0:
            before = [(kind, share) for t, kind, share in released.get(r.kernel, [])
                      if t <= r.arrival]
            kind = before[-1][0] if before else "none"
            waited[kind + (" (room)" if r.waited_for_room else "")] += 1
            if kind == "long idle":
                long_free[free_bucket(before[-1][1])] += 1
            per.setdefault(machine(r.ran_on), Counter())["waited"] += 1
    slowed = 0
    for r in sim.cells:
        if (r.end is not None and r.gpus and r.utilization > 0 and r.duration > 0
                and (r.end - r.start) / r.duration > 1.1):
            slowed += 1
            per.setdefault(machine(r.ran_on), Counter())["slowed"] += 1
    for m in sim.machine_of.values():
        per.setdefault(machine(m.start), Counter())["users"] += 1
    gpu_cells = sum(1 for r in sim.cells if r.gpus and r.utilization > 0)
    problems = why_not(f, s)
    return [f"{gpus} GPUs: {'serves' if not problems else '; '.join(problems)}",
            f"  cells waited > 1 s: {sum(waited.values())} of {len(sim.cells)}, by the release "
            f"before: {dict(waited.most_common())}",
            f"  of them after long idle, by their GPU's free memory at the release: "
            f"{dict(sorted(long_free.items()))}",
            f"  GPU cells slowed > 1.1x: {slowed} of {gpu_cells}; out of memory: "
            f"{f['oom_failures']} ({sim.counters.oom_growth} growing, the rest a kernel's first "
            f"allocation); releases {f['releases']} {f['release_reasons']}; moves "
            f"{f['moves']}; peak used {f['peak_used_pct']:.0f} %",
            f"  kernels started where their expected need fit no GPU of their machine: "
            f"{starts['fit nowhere']}, of them on a GPU at >= {rule.CONTENDED_LOAD:g} % SM "
            f"while another was below: {starts['fit nowhere, started on a saturated GPU']}; "
            f"where it fit only beside what was there, released states that will come back "
            f"left out: {starts['fit now only']}",
            "  per machine: " + "; ".join(f"{m}: {dict(c)}" for m, c in sorted(per.items()))]


def every_assignment(w: Workload, s: Settings, gpus: int, limit: int) -> list[str]:
    """gpushare at ``gpus`` with each user's server put on each machine its widest kernel fits
    on, every combination (at most ``limit`` runs), instead of where the product's rule put
    it at the user's first kernel: how many combinations serve, and one that does. A bound
    on what choosing servers' machines can win, with hindsight the rule does not have."""
    probe = simulation(w, s, "gpushare", gpus, run=False)
    machines = list(probe.machines())
    width = {i: max(k.work.gpus for k in probe.by_user[i]) for i in range(len(w.users))}
    options = [[m for m in machines if len(m) >= width[i]] for i in range(len(w.users))]
    runs = math.prod(len(o) for o in options)
    if runs > limit:
        return [f"  every server's machine: {runs} combinations, over --every-server-machine's "
                f"{limit}: not tried"]
    if runs == 1:
        return ["  every server's machine: one combination (one machine fits): the rule's"]
    served: list[dict[str, str]] = []
    for choice in itertools.product(*options):
        sim = simulation(w, s, "gpushare", gpus, run=False)
        sim.machine_of = dict(enumerate(choice))
        sim.run()
        if not why_not(figures(sim), s):
            served.append({w.users[i]: f"GPUs {m.start}-{m.stop - 1}" for i, m in enumerate(choice)
                           if len(options[i]) > 1})
    line = f"  every server's machine: {len(served)} of {runs} combinations serve"
    return [line + (f"; one: {served[0]}" if served else "")]


#: the criteria of "serves", each judged alone (``capacity.failing``'s names)
CRITERIA = ("out of memory", "delay", "SMs")


def smallest_alone(failed: dict[int, dict[str, list[str]]]) -> dict[str, int | None]:
    """Per criterion, the smallest count at which it alone holds (``failed``: per count,
    ``capacity.failing``)."""
    return {name: next((n for n in sorted(failed) if name not in failed[n]), None)
            for name in CRITERIA}


def across_seeds(argv: list[str], counts: list[int], policy: str, seeds: list[int]) -> list[str]:
    """Per seed: the smallest of ``counts`` that serves, and the larger ones that do not;
    then the smallest at which each criterion alone holds; and the sums over the seeds."""
    out = [f"{policy}, counts {','.join(map(str, counts))}: per seed, the smallest that serves; "
           "larger counts that do not, and why; the smallest at which each criterion alone holds"]
    sums: dict[str, int] = {"serves": 0, **dict.fromkeys(CRITERIA, 0), "1.25x limit": 0}
    none = counts[-1] + 1  # summed where a criterion holds at no count: "more than"
    for seed in seeds:
        w, s, _ = workload_of([*argv, "--seed", str(seed)])
        limit = compute_limit(w, s)["gpus"]
        failed = {n: failing(figures(simulation(w, s, policy, n)), s) for n in counts}
        why = {n: [r for rs in failed[n].values() for r in rs] for n in counts}
        serving = [n for n in counts if not why[n]]
        alone = smallest_alone(failed)
        sums["serves"] += serving[0] if serving else none
        for name, n in alone.items():
            sums[name] += none if n is None else n
        sums["1.25x limit"] += math.floor(1.25 * limit)
        each = "; alone: " + ", ".join(f"{name} {'>' + str(counts[-1]) if n is None else n}"
                                       for name, n in alone.items())
        head = f"seed {seed} (compute limit {limit})"
        if not serving:
            out.append(f"{head}: none of {counts[0]}-{counts[-1]}{each}")
            continue
        above = [f"{n} ({'; '.join(why[n])})" for n in counts if n > serving[0] and why[n]]
        out.append(f"{head}: {serving[0]} ({serving[0] / limit:.2f}x)"
                   + (f"; not {', '.join(above)}" if above else "") + each)
    if len(seeds) > 1:
        out.append("sums over the seeds (a count past the last tried counts as the next): "
                   + ", ".join(f"{name} {n}" for name, n in sums.items()))
    return out


def seed_list(text: str) -> list[int]:
    """``"0-4"`` or ``"0,2,5"`` -> the seeds."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def hold_long_idle_to(share: float) -> None:
    """The simulator's gpushare servers release a kernel for its long idle where the
    product's rule would at ``share`` (``--long-idle-share``; the simulator runs the rule at
    the product's default ``long_idle_free_fraction`` without it)."""
    releases = policies.GPUShare.releases

    def held(self: policies.GPUShare, sim: Simulation, kernels: list, cands: list,
             free: dict[int, int], total: dict[int, int]) -> list[tuple[str, str]]:
        self.config = replace(self.config, long_idle_free_fraction=share)
        return releases(self, sim, kernels, cands, free, total)

    policies.GPUShare.releases = held  # type: ignore[method-assign]


def expect_known(sizes: bool, loads: bool) -> None:
    """``--known-sizes``: the simulator expects each kernel to need its largest allocation;
    ``--known-loads``: to add, until it computes, the SM % of its heaviest GPU cell instead of
    the rule's ``PENDING_LOAD`` (hindsight both: the product cannot know either before the
    kernel allocates and computes)."""
    expected = Simulation.expected_need

    def known(self: Simulation, k: Any) -> rule.Need:
        said = expected(self, k)
        cells = [c for ss in k.work.sessions for c in ss.cells]
        if sizes:
            peak = max([k.work.gpu_bytes, *(c.nbytes or 0 for c in cells)])
            said = replace(said, bytes=max(peak, said.bytes))
        if loads:
            said = replace(said, load=max([c.utilization for c in cells if c.uses_gpu] or [0.0]))
        return said

    Simulation.expected_need = known  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="", help="GPU counts to run gpushare at (comma list)")
    ap.add_argument("--smoke", action="store_true", help="--quick --days 1, at 4 GPUs")
    ap.add_argument("--long-idle-share", type=float, default=None, metavar="F",
                    help="hold the simulator's long-idle releases to the product's rule at "
                         "long_idle_free_fraction F (0-1; 1: at long_idle whatever the room)")
    ap.add_argument("--every-server-machine", type=int, default=0, metavar="RUNS",
                    help="at each count, also put the users' servers on every combination of "
                         "the machines their widest kernel fits on (at most RUNS runs)")
    ap.add_argument("--policy", choices=("gpushare", "gpushare-hub"), default="gpushare",
                    help="the sharing policy run at each count (gpushare-hub: with the hub "
                         "service; default gpushare)")
    ap.add_argument("--seeds", type=seed_list, default=None, metavar="LIST",
                    help="seeds to run the counts at (0-4 or 0,1,2): one line per seed, the "
                         "smallest count that serves and the larger ones that do not")
    ap.add_argument("--known-sizes", action="store_true",
                    help="with hindsight, expect every kernel to need its largest allocation")
    ap.add_argument("--known-loads", action="store_true",
                    help="with hindsight, expect every new kernel to add the SM %% of its "
                         "heaviest GPU cell")
    ap.add_argument("simulate", nargs=argparse.REMAINDER,
                    help="after --: jupyter gpushare simulate's options")
    args = ap.parse_args()
    rest = [a for a in args.simulate if a != "--"]
    if args.smoke:
        rest, args.counts = ["--quick", "--days", "1"], "4"
    if args.long_idle_share is not None:
        hold_long_idle_to(args.long_idle_share)
    if args.known_sizes or args.known_loads:
        expect_known(args.known_sizes, args.known_loads)
    if args.seeds:
        counts = sorted(int(c) for c in args.counts.split(",") if c.strip())
        for line in across_seeds(rest, counts, args.policy, args.seeds):
            print(line)
        return
    w, s, name = workload_of(rest)
    if args.long_idle_share is not None:
        name += f"; long-idle releases below {args.long_idle_share:.0%} free"
    if args.known_sizes:
        name += "; kernels' sizes known ahead (hindsight)"
    if args.known_loads:
        name += "; kernels' SM loads known ahead (hindsight)"
    print(f"{name}: {len(w.users)} users, {len(w.kernels)} kernels; machines of {s.gpus} x "
          f"{s.gpu_gib:g} GiB; release policy {s.release_policy}; transfer model {s.transfer.name}")
    for line in bounds(w, s):
        print(line)
    for n in [int(c) for c in args.counts.split(",") if c.strip()]:
        for line in at_count(w, s, n, args.policy):
            print(line)
        if args.every_server_machine:
            for line in every_assignment(w, s, n, args.every_server_machine):
                print(line)


if __name__ == "__main__":
    main()
