"""``jupyter gpushare simulate``: compare sharing policies on a workload, print and save it.

Without ``--replay`` or ``--trace``: the synthetic default workload and the shipped example
replay. With ``--replay PATH`` (repeatable): an exported history of your own installation
instead (a directory of ``NAME.history.json`` and ``NAME.events.jsonl`` files; see
docs/admin-guide.md). With ``--trace FILE`` (repeatable): a trace in the documented format
(JSON or CSV; docs/trace-format.md), written from any source.

gpushare runs as the product ships, by default: release_policy ``needs``, kernels placed by
the product's placement rule (room, then SM load over a window), restores that move after
``--move-after`` s, idle kernels moved off contended GPUs (rebalance; ``--move-before-cell``
also moves a heavy kernel off a busy GPU before its cell, the product's
``rebalance_before_cell``, off by default as there); the baselines are named options (``--release-policy proactive``, ``--placement round-robin``, ``--servers
round-robin``, ``--move-after 0``, ``--no-rebalance``, ``--release-copies all``).

The headline: for each policy, the fewest GPUs that serve all the workload's users, and the
GPU-hours they cost against reserving GPUs for each user's sessions; under the transfer
model chosen and the other of ``driver`` / ``pinned``; with the compute limit (the peak SM
demand of the cells running at once, in GPUs) and the fewest GPUs as a multiple of it. Then
the most users per GPU on the node, as a second table. ``--ahead-sensitivity``: gpushare's
delays and fewest GPUs for leads of 0-30 s between a person's first activity and their cell
(restores ahead), under both release policies. ``--placement-table``: gpushare's delays,
moves and fewest GPUs with the product's placement and round-robin, each without and with
restores that move onto other GPUs after ``--move-after`` s and rebalance.
``--release-table``: gpushare's cells that waited for room (p99, worst) and fewest GPUs with
releases that copy everything and with releases that copy only what changed, per restore model.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..policy import PolicyConfig
from . import defaults, report
from .calibration import trace_statistics
from .capacity import (
    AHEAD_LEADS,
    ahead_sensitivity,
    compute_limit,
    fewest_gpus,
    most_users,
    placement_comparison,
    release_comparison,
    run,
)
from .engine import PLACEMENTS, RELEASE_COPIES, RESTORE_MODES, SERVERS
from .generator import generate
from .policies import RELEASE_POLICIES, GPUShare
from .replay import read_replay
from .settings import POLICIES, Settings
from .trace import TraceError, read_trace
from .transfer import GB, PRESETS, TransferModel
from .workload import Workload, with_users

COMPARED_MODELS = ("driver", "pinned")  # the headline is shown under both (and the chosen one)

EXAMPLE = Path(__file__).parent / "example_trace"
MULTI_GPU_EXAMPLE = Path(__file__).parent / "example_multigpu.json"  # docs/trace-format.md


def plain(text: str | None) -> str:
    """``text`` as a terminal shows it: without the docstring's literal markup."""
    return re.sub(r"``(.+?)``", r"\1", text or "", flags=re.S)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jupyter gpushare simulate", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smaller default workload (4 GPUs, 2 days) and search: under a minute")
    ap.add_argument("--replay", action="append", metavar="PATH",
                    help="an exported history to replay instead of the default workload and example")
    ap.add_argument("--trace", action="append", metavar="FILE",
                    help="a workload trace (JSON or CSV, docs/trace-format.md) instead of the "
                         "default workload and example")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of: {', '.join(POLICIES)} (default: all)")
    ap.add_argument("--restore-mode", choices=RESTORE_MODES, default="eager",
                    help="eager: every cell restores a released kernel first; lazy: cells that "
                         "use no GPU run without a restore (default eager)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="room",
                    help="where sharing policies put a kernel at its start: room (the "
                         "product's placement rule: GPUs with room for what the kernel is "
                         "expected to need, the least SM load over --load-window first, "
                         "counting kernels placed there that have not computed yet) or "
                         "round-robin (a baseline: user i on GPU i mod G) (default room)")
    ap.add_argument("--servers", choices=SERVERS, default="rule",
                    help="the machine each user's server runs on, chosen at their first "
                         "kernel's start: rule (the machines ranked by the same placement "
                         "rule, as the hub service ranks nodes) or round-robin (a baseline: "
                         "the machine of the user's round-robin GPU); with --placement "
                         "round-robin, round-robin (default rule)")
    ap.add_argument("--load-window", type=float, default=defaults.LOAD_WINDOW, metavar="SECONDS",
                    help="s of SM history a GPU's load is the mean of, for placement, "
                         f"restores and rebalance (default {defaults.LOAD_WINDOW:g}, the product's)")
    ap.add_argument("--node-daemon", action="store_true",
                    help="every machine runs the node daemon (GPUShareApp.node_daemon_socket): "
                         "its servers tell each other their placed kernels at once (with the "
                         "hub service, placements count from the placing server's next poll, "
                         "release policies a refresh later); default: not run, as a server's "
                         "default is")
    ap.add_argument("--no-rebalance", action="store_true",
                    help="never move idle kernels off GPUs whose SMs are contended (a "
                         "baseline; the product rebalances by default)")
    ap.add_argument("--move-before-cell", action="store_true",
                    default=defaults.REBALANCE_BEFORE_CELL,
                    help="a heavy kernel whose GPU another kernel's cell keeps busy moves to a "
                         "quiet GPU before its next cell (the product's rebalance_before_cell; "
                         "off by default, as in the product)")
    ap.add_argument("--rebalance-idle", type=float, default=defaults.REBALANCE_IDLE,
                    metavar="SECONDS",
                    help="s a resident kernel must have been idle before rebalance may move it "
                         f"(default {defaults.REBALANCE_IDLE:g}, the product's)")
    ap.add_argument("--rebalance-per-hour", type=int, default=defaults.REBALANCE_PER_HOUR,
                    metavar="N", help="moves per kernel per hour, at most (default "
                                      f"{defaults.REBALANCE_PER_HOUR}, the product's)")
    ap.add_argument("--move-after", type=float, default=defaults.MOVE_AFTER, metavar="SECONDS",
                    help="s a restore waits for room on its kernel's own GPUs before it goes "
                         "onto other GPUs of the machine where the placement rule says, the "
                         "kernel then living there; a restore whose own GPUs' SMs are "
                         "contended goes onto a quieter one at once (the product's "
                         f"restore_move_after; default {defaults.MOVE_AFTER:g}; 0: never move)")
    ap.add_argument("--release-copies", choices=RELEASE_COPIES, default="changed",
                    help="what a release copies: changed (the product's: a restore keeps the "
                         "host copy and a release copies what changed since, with a "
                         "restore model whose method does so: pinned, sim) or all (a "
                         "baseline: every release copies the whole state) (default changed)")
    ap.add_argument("--precopy-after", type=float, default=defaults.PRECOPY_AFTER,
                    metavar="SECONDS",
                    help="s a kernel sits idle before it copies what changed to host in the "
                         "background, so that a release has less left to copy (the product's "
                         f"precopy_after; default {defaults.PRECOPY_AFTER:g}; 0: never)")
    ap.add_argument("--release-table", action="store_true",
                    help="a table of gpushare's cells that waited for room (their p99 and "
                         "worst delay) and fewest GPUs, with releases that copy everything "
                         "and with releases that copy what changed, under each restore model")
    ap.add_argument("--placement-table", action="store_true",
                    help="a table of gpushare's delays, moves and fewest GPUs with round-robin "
                         "and the product's placement, without and with restores that move "
                         "(--move-after) and rebalance")
    node = ap.add_argument_group("the node")
    node.add_argument("--gpus", type=int, help="GPUs per node (default 8; a replay's trace.json may say)")
    node.add_argument("--gpu-gib", type=float, help="GiB per GPU (default 80)")
    node.add_argument("--nodes", type=int, default=1,
                      help="machines of --gpus GPUs each (default 1); the fewest-GPUs search "
                           "adds machines as it needs")
    load = ap.add_argument_group("the synthetic workload")
    load.add_argument("--users-per-gpu", type=float, default=3.0,
                      help="load of the side-by-side table (default 3, the goal's)")
    load.add_argument("--days", type=int, default=5, help="from a Monday; weekdays work (default 5)")
    load.add_argument("--seed", type=int, default=0,
                      help="seeds the synthetic workload, copies of a trace's users and the "
                           "servers' poll phases: the same seed gives the same figures "
                           "(default 0)")
    search = ap.add_argument_group("what serves: no OOM, both bounds, no cell unfinished")
    search.add_argument("--delay-bound", type=float, default=1.0,
                        help="p99 cell delay (s) within which users count as served (default 1)")
    search.add_argument("--slowdown-bound", type=float, default=1.1,
                        help="p99 slowdown of GPU cells from sharing SMs within which users "
                             "count as served (default 1.1)")
    search.add_argument("--max-users-per-gpu", type=int, default=12,
                        help="the users-per-GPU search stops here (default 12; --quick: 8)")
    search.add_argument("--no-capacity", action="store_true",
                        help="only the side-by-side table (no fewest GPUs, no users per GPU)")
    gs = ap.add_argument_group("the gpushare policy (the product's options, same defaults)")
    config = PolicyConfig()
    gs.add_argument("--idle-timeout", type=float, default=config.idle_timeout, metavar="SECONDS",
                    help="s without a cell before a kernel counts as idle (default "
                         f"{config.idle_timeout:g}; 0: never released for idleness)")
    gs.add_argument("--idle-utilization", type=float, default=config.idle_utilization,
                    metavar="PERCENT", help="SM %% at or below which a kernel counts as idle "
                                            f"(default {config.idle_utilization:g})")
    gs.add_argument("--min-release-bytes", type=int, default=config.min_release_bytes,
                    metavar="BYTES", help="a kernel holding less is never released (default "
                                          f"{config.min_release_bytes})")
    gs.add_argument("--pressure-free-fraction", type=float,
                    default=config.pressure_free_fraction, metavar="FRACTION",
                    help="a GPU with less free is under memory pressure: its idle kernels are "
                         f"released (default {config.pressure_free_fraction:g}; 0: never)")
    gs.add_argument("--pressure-idle-timeout", type=float,
                    default=config.pressure_idle_timeout, metavar="SECONDS",
                    help="s idle before a kernel is released under memory pressure or to make "
                         f"room (default {config.pressure_idle_timeout:g})")
    gs.add_argument("--poll-interval", type=float, default=2.0, metavar="SECONDS",
                    help="s between two polls of each user's server (default 2)")
    tm = ap.add_argument_group("release / restore time: overhead + bytes / bandwidth")
    tm.add_argument("--restore-model", choices=sorted(PRESETS), default="driver",
                    help="driver: the driver method measured on an H200 (~3.7 GB/s restore, "
                         "~1.8 GB/s release, ~0.2-0.4 s); driver-published: the line through "
                         "cuda-checkpoint's two published H100 points (~5.4 / ~3.1 GB/s); "
                         "pinned: the framework method's best case, copies at the pinned PCIe "
                         "Gen5 limit; h100: an older default; sim: this project's simulated "
                         "benchmark (default driver)")
    tm.add_argument("--restore-overhead", type=float, help="s (overrides the model's)")
    tm.add_argument("--restore-bandwidth", type=float, help="GB/s (overrides the model's)")
    tm.add_argument("--release-overhead", type=float, help="s (overrides the model's)")
    tm.add_argument("--release-bandwidth", type=float, help="GB/s (overrides the model's)")
    ah = ap.add_argument_group("restores ahead of the person, and when to release")
    ah.add_argument("--ahead-lead", type=float, default=0.0, metavar="SECONDS",
                    help="s from a person's first activity in a notebook (focus, an edit) to "
                         "their cell; a released kernel restores from the activity on (default "
                         "0: no activity seen, today's behaviour)")
    ah.add_argument("--ahead-share", type=float, default=1.0, metavar="FRACTION",
                    help="of cells, the share the lab sees activity before (seeded per cell; "
                         "default 1)")
    ah.add_argument("--ahead-grace", type=float, default=300.0, metavar="SECONDS",
                    help="a kernel restored ahead that runs no cell this long is released "
                         "again, and a restore ahead that finds no room this long after the "
                         "activity is dropped (default 300, the product's ahead_grace)")
    ah.add_argument("--ahead-sensitivity", action="store_true",
                    help="a table of gpushare's delays and fewest GPUs for leads of "
                         f"{', '.join(f'{x:g}' for x in AHEAD_LEADS)} s, under both release "
                         "policies")
    ah.add_argument("--release-policy", choices=RELEASE_POLICIES, default=defaults.RELEASE_POLICY,
                    help="needs (the product's release_policy): release an idle kernel only "
                         "when its GPU is below the pressure threshold or a restore waits "
                         "there, or after --long-idle; proactive (a baseline): release at "
                         f"idle_timeout (default {defaults.RELEASE_POLICY}, the product's)")
    ah.add_argument("--long-idle", type=float, default=defaults.LONG_IDLE, metavar="SECONDS",
                    help="under --release-policy needs: released anyway after this long idle "
                         f"(default {defaults.LONG_IDLE:g}, the product's long_idle)")
    cull = ap.add_argument_group("the cull policy")
    cull.add_argument("--cull-after", type=float, default=3600.0, help="s idle (default 3600)")
    cull.add_argument("--cull-interval", type=float, default=300.0, help="s (jupyter_server's default)")
    out = ap.add_argument_group("output")
    out.add_argument("--out", default="gpushare-simulate",
                     help="directory for simulate.json and the PNGs (default ./gpushare-simulate)")
    out.add_argument("--no-png", action="store_true",
                     help="write no PNGs (they need matplotlib: the simulate extra)")
    out.add_argument("--wide", action="store_true",
                     help=f"every table in full, one line per row (default: tables fit "
                          f"{report.WIDTH} columns, with a legend for the units)")
    return ap


def settings_from(args: argparse.Namespace) -> Settings:
    model = PRESETS[args.restore_model]
    transfer = TransferModel(
        model.name if all(v is None for v in (args.restore_overhead, args.restore_bandwidth,
                                              args.release_overhead, args.release_bandwidth)) else "custom",
        model.release_overhead if args.release_overhead is None else args.release_overhead,
        model.release_bandwidth if args.release_bandwidth is None else args.release_bandwidth * GB,
        model.restore_overhead if args.restore_overhead is None else args.restore_overhead,
        model.restore_bandwidth if args.restore_bandwidth is None else args.restore_bandwidth * GB,
        incremental=model.incremental,
    )
    config = PolicyConfig(idle_timeout=args.idle_timeout, idle_utilization=args.idle_utilization,
                          min_release_bytes=args.min_release_bytes,
                          pressure_free_fraction=args.pressure_free_fraction,
                          pressure_idle_timeout=args.pressure_idle_timeout)
    return Settings(gpus=args.gpus or (4 if args.quick else 8), gpu_gib=args.gpu_gib or 80.0,
                    nodes=args.nodes, transfer=transfer, config=config,
                    poll_interval=args.poll_interval, cull_after=args.cull_after,
                    cull_interval=args.cull_interval, delay_bound=args.delay_bound,
                    slowdown_bound=args.slowdown_bound, restore_mode=args.restore_mode,
                    placement=args.placement,
                    servers="round-robin" if args.placement == "round-robin" else args.servers,
                    load_window=args.load_window, rebalance=not args.no_rebalance,
                    rebalance_idle=args.rebalance_idle,
                    rebalance_per_hour=args.rebalance_per_hour,
                    rebalance_before_cell=args.move_before_cell,
                    max_users_per_gpu=min(args.max_users_per_gpu, 8) if args.quick else args.max_users_per_gpu,
                    seed=args.seed, ahead_lead=args.ahead_lead, ahead_share=args.ahead_share,
                    ahead_grace=args.ahead_grace, release_policy=args.release_policy,
                    long_idle=args.long_idle, move_after=args.move_after,
                    release_copies=args.release_copies, precopy_after=args.precopy_after,
                    node_daemon=args.node_daemon)


def moves_state(policy: str, s: Settings) -> bool:
    """Whether the policy's figures depend on the transfer model (it releases and restores)."""
    return isinstance(POLICIES[policy](s), GPUShare)


def compared_models(s: Settings) -> list[TransferModel]:
    """The chosen transfer model, then the compared ones it is not."""
    return [s.transfer] + [PRESETS[m] for m in COMPARED_MODELS if m != s.transfer.name]


def headline(workload: Workload, s: Settings, policies: list[str],
             limit: int | None = None) -> dict[str, Any]:
    """Fewest GPUs per policy under the chosen transfer model and the compared ones (a policy
    that never moves state is searched once: the model does not change it). ``limit``: the
    compute limit, from which every count below the bisection's answer is tried too (whether
    a count serves is not monotonic: a partly filled last machine can fail where fewer GPUs
    serve)."""
    models = compared_models(s)
    out: dict[str, Any] = {"models": [m.name for m in models], "by_model": {}}
    first: dict[str, Any] = {}
    for i, model in enumerate(models):
        sm = replace(s, transfer=model)
        rows = {}
        for p in policies:
            if i and not moves_state(p, s):
                rows[p] = first[p]
            else:
                rows[p] = fewest_gpus(p, workload, sm, from_gpus=limit)
        if not i:
            first = rows
        out["by_model"][model.name] = rows
    return out


def compare(name: str, source: str, workload_for: Any, reference_users: int, s: Settings,
            policies: list[str], capacity: bool, stats: dict[str, Any],
            recorded: dict[str, Any] | None = None, ahead: bool = False,
            placement: bool = False, releases: bool = False) -> dict[str, Any]:
    """Every policy on the same workload; (optionally) each one's fewest GPUs for all its
    users, under each compared transfer model, and its most users per GPU on the node."""
    reference = {p: run(workload_for(reference_users), p, s, series=True) for p in policies}
    result: dict[str, Any] = {
        "name": name, "source": source,
        "node": {"nodes": s.nodes, "gpus_per_node": s.gpus, "gpu_gib": s.gpu_gib},
        "reference_users": reference_users, "statistics": stats, "reference": reference,
    }
    if recorded is not None:
        result["recorded_events"] = recorded
    moving = [p for p in policies if moves_state(p, s)]
    if capacity or (moving and (ahead or placement)):
        result["compute_limit"] = compute_limit(workload_for(reference_users), s)
    if ahead and moving:
        result["ahead_sensitivity"] = {"policy": moving[0], "rows": ahead_sensitivity(
            moving[0], workload_for(reference_users), s, compared_models(s))}
    if releases and moving:
        result["release_table"] = {"policy": moving[0], "rows": release_comparison(
            moving[0], workload_for(reference_users), s)}
    if placement and moving:
        result["placement_table"] = {"policy": moving[0], "rows": placement_comparison(
            moving[0], workload_for(reference_users), s, compared_models(s))}
    if capacity:
        result["fewest_gpus"] = {**headline(workload_for(reference_users), s, policies,
                                            result["compute_limit"]["gpus"]),
                                 "compute_limit": result["compute_limit"]}
        result["capacity"] = {p: most_users(p, workload_for, s) for p in policies}
        result["goal"] = report.goal(result["capacity"], s.delay_bound)
        result["tails"] = {p: report.tail_note(p, c, s.delay_bound)
                           for p, c in result["capacity"].items()}
    return result


def print_result(r: dict[str, Any], s: Settings, wide: bool = False) -> None:
    node = r["node"]

    def say(text: str) -> None:
        print(report.wrap(text, indent="  "))

    print()
    say(f"== {r['name']}: {r['source']}")
    say(f"node: {node['nodes']} x {node['gpus_per_node']} GPUs of {node['gpu_gib']:g} GiB; "
        f"restore mode {s.restore_mode}; release policy {s.release_policy}; placement "
        f"{s.placement}" + (f", servers by {s.servers}" if s.placement != "round-robin" else "")
        + "; " + (f"restores move after {s.move_after:g} s; " if s.move_after > 0
                  else "restores never move; ")
        + (f"rebalance after {s.rebalance_idle:g} s idle"
           + (", and before a heavy cell on a busy GPU; " if s.rebalance_before_cell else "; ")
           if s.rebalance else "no rebalance; ")
        + s.transfer.describe())
    if r["statistics"]:
        print("\nthe workload against the published figures the generator is calibrated to:")
        print(report.statistics_table(r["statistics"], wide))
    print()
    say(f"same workload, {r['reference_users']} users, every policy "
        f"(exclusive: each user's own GPUs; the others: {node['nodes'] * node['gpus_per_node']} "
        "GPUs):")
    print(report.same_load_table(r["reference"], wide))
    if "recorded_events" in r and "gpushare" in r["reference"]:
        rec, sim = r["recorded_events"], r["reference"]["gpushare"]
        say(f"recorded in the trace: {rec['releases']} releases, {rec['restores']} restores; "
            f"simulated gpushare: {sim['releases']} releases, {sim['restores']} restores")
    if "fewest_gpus" in r:
        h = r["fewest_gpus"]
        print()
        say(f"HEADLINE: fewest GPUs (machines of {node['gpus_per_node']}) that serve all "
            f"{r['reference_users']} users: no out-of-memory cell, p99 cell delay <= "
            f"{s.delay_bound:g} s, p99 slowdown of GPU cells <= {s.slowdown_bound:g}, no cell "
            f"unfinished; transfer model {h['models'][0]} (other models: last columns):")
        print(report.fewest_table(h, wide))
    if "ahead_sensitivity" in r:
        a = r["ahead_sensitivity"]
        print()
        say(f"restores ahead of the person (--ahead-lead) and the release policy: {a['policy']}, "
            f"{r['reference_users']} users; at the node's {node['nodes'] * node['gpus_per_node']}"
            f" GPUs, then at the fewest that serve them (transfer model {s.transfer.name} first):")
        print(report.ahead_table(a["rows"], wide, r.get("compute_limit")))
    if "release_table" in r:
        t = r["release_table"]
        print()
        say(f"what a release copies (--release-copies, --precopy-after {s.precopy_after:g} s): "
            f"{t['policy']}, {r['reference_users']} users on the node's "
            f"{node['nodes'] * node['gpus_per_node']} GPUs:")
        print(report.release_table(t["rows"], wide))
    if "placement_table" in r:
        p = r["placement_table"]
        print()
        say(f"placement and restores that move (--placement, --move-after): {p['policy']}, "
            f"{r['reference_users']} users; at the node's {node['nodes'] * node['gpus_per_node']}"
            f" GPUs, then at the fewest that serve them (transfer model {s.transfer.name} first):")
        print(report.placement_table(p["rows"], wide, r.get("compute_limit")))
    if "capacity" in r:
        print()
        say(f"most users per GPU on the node with no out-of-memory failure, p99 cell delay <= "
            f"{s.delay_bound:g} s, p99 slowdown <= {s.slowdown_bound:g} and no cell unfinished "
            f"(+ = the search's cap):")
        print(report.capacity_table(r["capacity"], wide))
        in_goal = "gpushare" if r["goal"].get("tail") else None
        for policy, note in r["tails"].items():
            if note and policy != in_goal:
                say(note)
        print(report.goal_line(r["goal"]))


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()  # how long the tool ran, for the person; never the model's clock
    args = parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser().error(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    if not args.move_after >= 0:
        parser().error(f"--move-after {args.move_after:g}: seconds, 0 (never move) or more")
    base = settings_from(args)
    results = []
    traces: list[tuple[str, Workload, dict[str, Any]]] = []
    for path in args.trace or []:
        try:
            traces.append((path, *read_trace(path)))
        except TraceError as e:
            parser().exit(2, f"jupyter gpushare simulate: error: {e}\n")
    if not args.replay and not args.trace:
        days = 2 if args.quick else args.days
        most = base.max_users_per_gpu * base.total_gpus
        synthetic = generate(most, days=days, seed=base.seed, gpu_gib=base.gpu_gib)
        reference = max(1, round(args.users_per_gpu * base.total_gpus))
        source = f"synthetic: {days} days from a Monday, seed {base.seed} (generator.py)"
        results.append(compare("default workload", source, synthetic.first_users, reference, base,
                               policies, not args.no_capacity,
                               trace_statistics(synthetic.first_users(reference)),
                               ahead=args.ahead_sensitivity,
                               placement=args.placement_table,
                               releases=args.release_table))
    for path, tw, node in traces:
        s = replace(base, gpus=args.gpus or int(node.get("gpus", base.gpus)),
                    gpu_gib=args.gpu_gib or float(node.get("gpu_gib", base.gpu_gib)))
        widest = max(k.gpus for k in tw.kernels)
        if widest > s.gpus:
            parser().exit(2, f"jupyter gpushare simulate: error: {path}: a session of {widest} "
                             f"GPUs cannot run on machines of {s.gpus} (--gpus)\n")
        results.append(compare(f"trace {Path(path).name}", tw.source,
                               lambda n, w=tw, seed=s.seed: with_users(w, n, seed),
                               len(tw.users), s, policies, not args.no_capacity,
                               trace_statistics(tw), ahead=args.ahead_sensitivity,
                               placement=args.placement_table,
                               releases=args.release_table))
    for path in args.replay or ([] if args.trace else [str(EXAMPLE)]):
        rep = read_replay(path)
        s = replace(base, gpus=args.gpus or int(rep.node.get("gpus", base.gpus)),
                    gpu_gib=args.gpu_gib or float(rep.node.get("gpu_gib", base.gpu_gib)))
        w: Workload = rep.workload
        name = "example replay" if Path(path) == EXAMPLE else f"replay {path}"
        results.append(compare(name, w.source, lambda n, w=w, seed=s.seed: with_users(w, n, seed),
                               len(w.users), s, policies, not args.no_capacity,
                               trace_statistics(w, marks_cpu_cells=False), rep.recorded,
                               ahead=args.ahead_sensitivity,
                               placement=args.placement_table,
                               releases=args.release_table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    for r in results:
        print_result(r, base, args.wide)
        if args.no_png:
            continue
        for policy, f in r["reference"].items():
            png = out / f"{r['name'].replace(' ', '-')}-{policy}.png"
            title = (f"{r['name']}, {policy}: {f['users']} users on {f['gpus']} GPUs of "
                     f"{f['gpu_gib']:g} GiB - allocation vs utilization")
            note = report.plot(f, title, png)
            if note:
                notes.append(note)
                break
    elapsed = time.perf_counter() - started
    document = {"settings": {**{k: v for k, v in vars(args).items()}, "transfer": base.transfer.describe()},
                "traces": results, "runtime_s": round(elapsed, 1)}
    (out / "simulate.json").write_text(json.dumps(document, indent=1) + "\n")
    for note in dict.fromkeys(notes):
        print(f"\n{report.wrap(note)}")
    pngs = "" if args.no_png or notes else f"; PNGs in {out}/"
    print("\n" + report.wrap(f"figures: {out / 'simulate.json'}{pngs}; ran in {elapsed:.0f} s"))
    return 0
