"""The comparison as text (tables, ratios against ``exclusive`` from the same run) and PNGs."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .calibration import PUBLISHED
from .figures import TAIL_SECONDS

WIDTH = 100  # columns the terminal report fits in (``--wide``: tables as wide as they come)
TAIL_FACTOR = 10.0  # a worst wait this many times the delay bound (and >= 10 s) gets a sentence


def table(headers: list[str], rows: list[list[Any]], width: int | None = None) -> str:
    """A plain-text table, columns right-aligned except the first; with ``width``, a first
    column that would make it wider is wrapped onto more lines."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    head = 1  # lines of the header
    if width is not None:
        first = max(16, width - sum(widths[1:]) - 2 * (len(widths) - 1))
        if widths[0] > first:
            widths[0] = first
            wrapped = []
            for i, r in enumerate(cells):
                parts = textwrap.wrap(r[0], first, break_on_hyphens=False) or [""]
                wrapped.append([parts[0], *r[1:]])
                wrapped.extend([part, *([""] * (len(r) - 1))] for part in parts[1:])
                if i == 0:
                    head = len(parts)
            cells = wrapped
    return "\n".join([_line(r, widths) for r in cells[:head]] + ["  ".join("-" * w for w in widths)]
                     + [_line(r, widths) for r in cells[head:]])


def _line(r: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()


def wrap(text: str, width: int = WIDTH, indent: str = "") -> str:
    """Prose for the terminal: lines of at most ``width`` columns."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)  # a path stays whole, to be copied


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _s(v: float) -> str:
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _n(v: float) -> str:
    """A count or a long time, readable: 3,980."""
    return f"{v:,.0f}"


def statistics_table(stats: dict[str, Any], wide: bool = False) -> str:
    rows = [[PUBLISHED[k][0], PUBLISHED[k][1], "n/a" if stats.get(k) is None else f"{stats[k]:.0f}"]
            for k in PUBLISHED]
    return table(["published figure", "target %", "this trace %"], rows, None if wide else WIDTH)


def same_load_table(results: dict[str, dict[str, Any]], wide: bool = False) -> str:
    """Every policy on the same workload: one wide table, or (the default) two that fit
    ``WIDTH`` columns, cells and delays then memory and SMs, with a legend for the units."""
    base = results.get("exclusive")
    delays, use, full = [], [], []
    for name, f in results.items():
        d = [name, f["gpus"], f"{f['users_per_gpu']:.2f}", f["oom_failures"],
             f"{f['cells_delayed_pct']:.2f}"]
        u = [_n(f["gpu_hours"]), f"{f['work_lost_gpu_hours']:.1f}", f"{f['reclaimed_gpu_hours']:.0f}",
             f"{f['mean_allocation_pct']:.1f}", f"{f['mean_sm_utilization_pct']:.1f}",
             _ratio(f["mean_sm_utilization_pct"], base["mean_sm_utilization_pct"]) if base else "-",
             f"{f['gpu_cell_slowdown_p99']:.2f}", f["cells_unfinished_contention"]]
        quantiles = [_s(f["delay_p50_s"]), _s(f["delay_p95_s"]), _s(f["delay_p99_s"])]
        tail = [_s(f["cell_delay_p99_s"]), _s(f["delay_max_s"])]
        full.append([*d, " / ".join(quantiles), *tail, *u])
        delays.append(d + quantiles + tail)
        use.append([name, *u])
    if wide:
        return table(["policy", "GPUs", "users/GPU", "OOM cells", "delayed %",
                      "delay p50/p95/p99 s (delayed cells)", "p99 all cells s", "worst delay s",
                      "GPU-h paid", "work lost GPU-h", "reclaimed GPU-h", "mean alloc %",
                      "mean SM %", "SM x excl.", "GPU-cell slowdown p99", "unfinished cells"], full)
    legend = ("OOM: cells failed for lack of GPU memory. Delays in s: p50/p95/p99 of the delayed "
              "cells; p99 all: over every cell (the bound's figure); worst: the longest wait. "
              "GPU-h: the GPUs x the trace (exclusive: each user's GPUs while a kernel of theirs "
              "is alive); lost: GPU-h of GPU cells to re-run after a cull (x their GPUs); "
              "reclaimed: GPU-h of memory off the GPU; alloc / SM: mean memory held / SMs busy; "
              "slowdown: p99 over GPU cells of run time / time alone (SMs shared); unfin.: cells "
              "that would have ended by the trace's end alone but were still running.")
    return "\n".join([
        table(["policy", "GPUs", "users/GPU", "OOM", "delayed %", "p50", "p95", "p99",
               "p99 all", "worst"], delays),
        "",
        table(["policy", "GPU-h", "lost GPU-h", "reclaimed GPU-h", "alloc %", "SM %", "SM x excl.",
               "slowdown", "unfin."], use),
        wrap(legend),
    ])


def capacity_table(capacity: dict[str, dict[str, Any]], wide: bool = False) -> str:
    base = capacity.get("exclusive", {}).get("users_per_gpu", 0.0)
    rows = []
    for name, c in capacity.items():
        f = c["figures"] or {}
        at_max = "+" if c["capped"] else ""
        rows.append([
            name, f"{c['users_per_gpu']:.2f}{at_max}", _ratio(c["users_per_gpu"], base), c["users"],
            _s(f.get("cell_delay_p99_s", 0.0)), f"{f.get('gpu_cell_slowdown_p99', 1.0):.2f}",
            _s(f.get("delay_max_s", 0.0)), f"{f.get('work_lost_gpu_hours', 0.0):.1f}",
            f"{f.get('mean_allocation_pct', 0.0):.1f}", f"{f.get('mean_sm_utilization_pct', 0.0):.1f}",
        ])
    if wide:
        return table(["policy", "most users/GPU", "x exclusive", "users", "p99 all cells s",
                      "GPU-cell slowdown p99", "worst delay s", "work lost GPU-h", "mean alloc %",
                      "mean SM %"], rows)
    return "\n".join([
        table(["policy", "users/GPU", "x excl.", "users", "p99 all", "slowdown", "worst",
               "lost GPU-h", "alloc %", "SM %"], rows),
        wrap("users/GPU: the most served on the node (+ = the search's cap); the run at that "
             "count: delays in s (p99 all: over every cell; worst: the longest wait), slowdown: "
             "p99 over GPU cells of run time / time alone, lost: GPU-h of GPU cells to re-run, "
             "alloc / SM: mean memory held / SMs busy."),
    ])


def fewest_table(h: dict[str, Any], wide: bool = False) -> str:
    """The headline: per policy, the fewest GPUs that serve every user, what they cost in
    GPU-hours against reserving GPUs per user's sessions, and the run's delays and slowdown;
    then the fewest GPUs under each other transfer model."""
    first, others = h["models"][0], h["models"][1:]
    limit = h.get("compute_limit")
    rows = []
    for name, c in h["by_model"][first].items():
        f = c["figures"] or {}
        served = c["gpus"] is not None
        rows.append([
            name, c["gpus"] if served else "none", _times(c["gpus"], limit),
            _n(c["gpu_hours"]) if served else "-",
            _n(c["reserved_gpu_hours"]), _ratio(c["gpu_hours"], c["reserved_gpu_hours"]) if served else "-",
            _s(f.get("cell_delay_p99_s", 0.0)) if served else "-",
            _s(f.get("delay_max_s", 0.0)) if served else "-",
            f"{f.get('gpu_cell_slowdown_p99', 1.0):.2f}" if served else "-",
            f"{f.get('work_lost_gpu_hours', 0.0):.1f}" if served else "-",
            *[_gpus(h["by_model"][m][name]) for m in others],
        ])
    notes = []
    for name, c in h["by_model"][first].items():
        if c["gpus"] is None and c["probes"]:
            last = c["probes"][-1]
            notes.append(f"{name} at {last['gpus']} GPUs: {', '.join(last['why_not'])}")
    # whether a count serves is not monotonic: say which larger counts the search tried and
    # saw fail, so a lucky count is not read as a margin
    above = [_fails_above(name, c) for name, c in h["by_model"][first].items() if c.get("fails_above")]
    # why each policy does not serve on one GPU fewer: what to add, memory or SMs
    fewer = [line for name, c in h["by_model"][first].items() if (line := _one_fewer(name, c))]
    if wide:
        heads = ["policy", "fewest GPUs", "x compute limit", "GPU-h", "reserved GPU-h", "x reserved",
                 "p99 delay s", "worst delay s", "GPU-cell slowdown p99", "work lost GPU-h",
                 *[f"fewest GPUs ({m})" for m in others]]
        return "\n".join([table(heads, rows)] + [f"none: {n}" for n in notes] + above + fewer
                         + [limit_line(limit)])
    _beside(rows, 1)
    heads = ["policy", "GPUs (x limit)", "GPU-h", "reserved", "x res.", "p99", "worst",
             "slowdown", "lost", *others]
    legend = (f"GPUs: the fewest that serve every user under transfer model {first} (none: not "
              "even exclusive's count does), and their multiple of the compute limit; GPU-h: those GPUs for the whole trace (exclusive: "
              "each user's own GPUs only while a kernel of theirs is alive); reserved: GPU-h of "
              "reserving each user's GPUs for their sessions' lifetime, what a scheduler that "
              "hands out whole GPUs charges; x res.: GPU-h / reserved. At that count: p99 delay "
              "over every cell and worst wait in s; slowdown: p99 over GPU cells of run time / "
              "time alone; lost: GPU-h of GPU cells to re-run after a cull. "
              + ", ".join(others) + ": the fewest GPUs under that transfer model. On one "
              "fewer: why the count below the fewest does not serve, which says what to add: "
              "cells out of memory, and under the release policy needs the cells' waits for "
              "restores (releases make room), ask for more memory per GPU; a slowdown, for "
              "more SMs.")
    return "\n".join([table(heads, rows, WIDTH)] + [wrap(f"none: {n}.") for n in notes]
                     + [wrap(a) for a in above] + [wrap(f) for f in fewer]
                     + [wrap(legend), limit_line(limit)])


def _fails_above(name: str, c: dict[str, Any]) -> str:
    """``name``'s larger counts the search tried that do not serve, and why."""
    why = {p["gpus"]: p["why_not"] for p in c.get("probes", ())}
    counts = "; ".join(f"{g} ({', '.join(why.get(g, []))})" for g in c["fails_above"])
    return (f"{name}: {c['gpus']} GPUs serve, but larger counts the search tried do not: "
            f"{counts}.")


def _one_fewer(name: str, c: dict[str, Any]) -> str:
    """Why ``name`` does not serve on one GPU fewer than its fewest, where the search tried
    that count ("" where it did not: below the compute limit, or none serves)."""
    if c.get("gpus") is None:
        return ""
    fewer = c["gpus"] - 1
    why = next((p["why_not"] for p in c.get("probes", ()) if p["gpus"] == fewer), None)
    if not why:
        return ""
    return f"{name} on one fewer ({fewer} GPU{'' if fewer == 1 else 's'}): {'; '.join(why)}."


def _gpus(c: dict[str, Any]) -> str:
    return "none" if c["gpus"] is None else str(c["gpus"])


def _times(gpus: int | None, limit: dict[str, Any] | None) -> str:
    """``gpus`` as a multiple of the compute limit's GPUs."""
    if gpus is None or not limit or not limit.get("gpus"):
        return "-"
    return f"{gpus / limit['gpus']:.2f}x"


def _beside(rows: list[list[Any]], i: int) -> None:
    """Narrow tables: column ``i + 1`` (a multiple of the compute limit) beside column ``i``
    (a count of GPUs), in place."""
    for row in rows:
        x = row.pop(i + 1)
        row[i] = row[i] if x in (None, "-") else f"{row[i]} ({x})"


def limit_line(limit: dict[str, Any] | None) -> str:
    """The compute limit, said once above a table that shows the fewest GPUs against it."""
    if not limit:
        return ""
    return wrap(f"compute limit: {limit['gpus']} GPUs (the peak SM demand of the cells running "
                f"at once, {limit['peak_sm_demand_pct']:.0f} % of one GPU, rounded up; no "
                "policy serves on fewer without slowing cells); x limit: the fewest GPUs as a "
                "multiple of it.")


def tail_threshold(worst: float, bound: float) -> int | None:
    """Which of ``figures.TAIL_SECONDS`` to count a tail's cells over: 60 s where it lies between
    the bound and the worst wait, else the nearest one that does; None if none does."""
    between = [t for t in TAIL_SECONDS if bound < t < worst]
    if not between:
        return None
    return min((t for t in between if t >= 60), default=max(between))


def _short(kernel_id: str) -> str:
    """A kernel id as people quote it: a UUID's first 8 characters (a copy keeps its ~N)."""
    base, tilde, copy = kernel_id.partition("~")
    return (base[:8] if len(base) > 12 else base) + tilde + copy


def _pct(v: float) -> str:
    return f"{v:.2g}" if v < 10 else f"{v:.0f}"


def tail_note(name: str, c: dict[str, Any], bound: float, lead: bool = True) -> str | None:
    """A sentence where a policy's run at its most users has a worst wait far above the delay
    bound (which its p99 keeps to): whose cell, where, why, and how many cells waited that
    long. None where there is no such tail. ``lead``: begin with the policy and its p99."""
    f = c.get("figures") or {}
    worst = f.get("delay_max_s", 0.0)
    if not f or worst <= max(TAIL_FACTOR * bound, 10.0):
        return None
    p99 = f["cell_delay_p99_s"]
    text = f"the worst wait, {_n(worst)} s, "
    cell = f.get("worst_cell")
    if cell:
        text += (f"was one cell of kernel {_short(cell['kernel'])} (user {cell['user']}) on GPU "
                 f"{cell['gpu']}, arriving {cell['arrival_h']:.1f} h into the trace, that ")
        if cell["still_waiting_at_end"]:
            text += "was still waiting for room on its GPU when the trace ended"
        elif cell["restore_s"] > 0 and cell.get("moved_to") is not None:
            text += (f"waited {_n(worst - cell['restore_s'])} s for room on its GPU, then "
                     f"{cell['restore_s']:.1f} s for its restore onto GPU {cell['moved_to']}")
        elif cell["restore_s"] > 0:
            text += (f"waited {_n(worst - cell['restore_s'])} s for room on its GPU, then "
                     f"{cell['restore_s']:.1f} s for its restore")
        else:
            text += "waited for its kernel"
    else:
        text += "is far above the bound"
    over = tail_threshold(worst, bound)
    if over is not None:
        n, cells = f["cells_waited_over_s"][str(over)], f["cells"]
        text += (f"; {_n(n)} of {_n(cells)} cells ({_pct(100.0 * n / max(1, cells))} %) waited "
                 f"over {over} s")
    if lead:
        within = "within" if p99 <= bound else "above"
        text = f"{name} at {c['users']} users: p99 {_s(p99)} s, {within} the {bound:g} s bound; {text}"
    return text + "."


def goal(capacity: dict[str, dict[str, Any]], bound: float) -> dict[str, Any]:
    """The issue's goal, checked, not assumed: >= 3x users per GPU over exclusive with p99 cell
    delay <= 1 s and no work lost."""
    base = capacity.get("exclusive", {}).get("users_per_gpu", 0.0)
    g = capacity.get("gpushare")
    if not g or not base:
        return {"checked": False}
    f = g["figures"] or {}  # None: no user count was served at all
    ratio = g["users_per_gpu"] / base
    met = ratio >= 3.0 and bound <= 1.0 and f.get("work_lost_gpu_hours") == 0.0
    return {"checked": True, "met": met, "ratio": ratio, "delay_bound_s": bound,
            "p99_s": f.get("cell_delay_p99_s"), "worst_delay_s": f.get("delay_max_s"),
            "work_lost_gpu_hours": f.get("work_lost_gpu_hours"),
            "tail": tail_note("gpushare", g, bound, lead=False)}


def goal_line(g: dict[str, Any]) -> str:
    if not g.get("checked"):
        return wrap("goal (>= 3x users per GPU over exclusive, p99 <= 1 s, no work lost): "
                    "not checked")
    verdict = "met" if g["met"] else "NOT met"
    lost, p99 = g["work_lost_gpu_hours"], g.get("p99_s")
    delay = (f"p99 {_s(p99)} s <= {g['delay_bound_s']:g} s" if p99 is not None
             else f"p99 <= {g['delay_bound_s']:g} s")
    text = (f"goal (>= 3x users per GPU over exclusive, p99 cell delay <= 1 s, no work lost): "
            f"{verdict}: gpushare serves {g['ratio']:.2f}x exclusive's users per GPU with {delay}"
            + ("" if lost is None else f" and {lost:.1f} GPU-h of work lost"))
    if g.get("tail"):
        text += f". The p99 hides a tail: {g['tail']}"
    return wrap(text)


def install_hint(extra: str = "simulate") -> str:
    """How to add ``extra``'s packages: from the checkout this runs from (an editable
    install), else from the package index."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "jupyter_gpushare").is_dir():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'jupyter-gpushare[{extra}]'"


def plot(f: dict[str, Any], title: str, path: Path) -> str | None:
    """Allocation against utilization over time, as a PNG; a message instead if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no PNGs: matplotlib is not installed ({install_hint()})"
    series = f["series"]
    hours = [i * series["bin_seconds"] / 3600 for i in range(len(series["allocation_pct"]))]
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=100)
    ax.fill_between(hours, series["allocation_pct"], step="post", alpha=0.35, color="tab:blue",
                    label=f"allocation: memory held (mean {f['mean_allocation_pct']:.1f} %)")
    ax.step(hours, series["sm_utilization_pct"], where="post", color="tab:red", linewidth=1,
            label=f"utilization: SM busy (mean {f['mean_sm_utilization_pct']:.1f} %)")
    ax.set_xlim(0, hours[-1] + series["bin_seconds"] / 3600 if hours else 1)
    ax.set_ylim(0, 100)
    ax.set_xlabel("hours from the trace's start (Monday 00:00)")
    ax.set_ylabel(f"% of {f['gpus']} GPUs")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def ahead_table(rows: list[dict[str, Any]], wide: bool = False,
                limit: dict[str, Any] | None = None) -> str:
    """The restore-ahead sensitivity: per release policy and lead, delays at the
    node's GPUs and the fewest GPUs under each transfer model, with the delays there."""
    models = list(rows[0]["fewest_gpus"]) if rows else []
    first = models[0] if models else ""
    out = []
    for r in rows:
        there = r["fewest_gpus"].get(first, {})
        served = there.get("gpus") is not None
        out.append([r["release_policy"], f"{r['ahead_lead_s']:g}", _s(r["cell_delay_p99_s"]),
                    _s(r["delay_max_s"]), f"{r['cells_delayed_pct']:.2f}",
                    f"{r['ahead_restores']:,}", f"{r['releases']:,}",
                    there.get("gpus") if served else "none", _times(there.get("gpus"), limit),
                    f"{_s(there['cell_delay_p99_s'])} / {_s(there['delay_max_s'])}" if served else "-",
                    f"{there['cells_delayed_pct']:.2f}" if served else "-",
                    *[_gpus(r["fewest_gpus"][m]) for m in models[1:]]])
    if wide:
        return table(["release policy", "ahead lead s", "p99 all cells s", "worst delay s",
                      "delayed %", "restores ahead", "releases", f"fewest GPUs ({first})",
                      "x compute limit", "p99 / worst there s", "delayed % there",
                      *[f"fewest GPUs ({m})" for m in models[1:]]], out) + "\n" + limit_line(limit)
    _beside(out, 7)
    return "\n".join([
        table(["release", "lead", "p99", "worst", "delayed %", "ahead", "releases",
               f"{first} (x)", "p99 / worst", "delayed %", *models[1:]], out, WIDTH),
        wrap(f"lead: s from the person's first activity to their cell; at the node's GPUs: p99 "
             f"delay over every cell and worst wait in s, share of cells delayed, restores "
             f"started ahead of a cell, releases. {first}: the fewest GPUs that serve every user "
             f"under that transfer model (x: their multiple of the compute limit), with p99 / "
             f"worst delay and delayed % at that count; "
             + ", ".join(models[1:]) + ": the fewest GPUs under that model."),
        limit_line(limit),
    ])


def release_table(rows: list[dict[str, Any]], wide: bool = False) -> str:
    """What a release copies: per transfer model, everything (the baseline) against what
    changed since the host copy (the product's), at the node's GPUs and at the fewest GPUs."""
    out = [[r["model"] + ("" if r["incremental"] else " (copies all)"), r["release_copies"],
            f"{r['room_waits']:,}", _s(r["room_wait_p99_s"]), _s(r["room_wait_max_s"]),
            _s(r["cell_delay_p99_s"]), f"{r['releases']:,}", _n(r["release_gib_copied"]),
            r["fewest_gpus"] if r["fewest_gpus"] is not None else "none"] for r in rows]
    headers = (["transfer model", "release copies", "cells that waited for room",
                "p99 of their delay s", "worst s", "p99 all cells s", "releases",
                "GiB copied by releases", "fewest GPUs"] if wide else
               ["model", "copies", "room waits", "p99", "worst", "p99 all", "releases",
                "GiB copied", "fewest"])
    return "\n".join([
        table(headers, out, None if wide else WIDTH),
        wrap("all: every release copies the kernel's whole state (the baseline); changed: a "
             "restore keeps the host copy and a kernel idle for precopy_after copies what "
             "changed in the background, so a release copies what is left (the product's, "
             "with the framework and simulated methods; the driver's checkpoint copies all by "
             "its nature). At the node's GPUs: cells whose restore found no room at once (it "
             "waited for releases or a move), the p99 and worst of their delay, p99 over every "
             "cell, releases and what they copied; fewest: GPUs that serve every user."),
    ])


def placement_table(rows: list[dict[str, Any]], wide: bool = False,
                    limit: dict[str, Any] | None = None) -> str:
    """Placement and migration: per configuration (round-robin and the product's placement,
    without and with restores that move and rebalance), delays and moves at the node's GPUs,
    and the fewest GPUs under each transfer model, with the delays and moves there."""
    models = list(rows[0]["fewest_gpus"]) if rows else []
    first = models[0] if models else ""

    def fewest(c: dict[str, Any]) -> str:
        return _gpus(c) + ("*" if c.get("fails_above") else "")

    out = []
    for r in rows:
        there = r["fewest_gpus"].get(first, {})
        served = there.get("gpus") is not None
        out.append([r["configuration"], _s(r["cell_delay_p99_s"]), _s(r["delay_max_s"]),
                    f"{r['cells_delayed_pct']:.2f}", f"{r['moves']:,}", fewest(there),
                    _times(there.get("gpus"), limit),
                    f"{_s(there['cell_delay_p99_s'])} / {_s(there['delay_max_s'])}" if served else "-",
                    f"{there['moves']:,}" if served else "-",
                    *[fewest(r["fewest_gpus"][m]) for m in models[1:]]])
    if not wide:  # the multiple beside the count: the table fits
        _beside(out, 5)
    if wide:
        return table(["configuration", "p99 all cells s", "worst delay s", "delayed %", "moves",
                      f"fewest GPUs ({first})", "x compute limit", "p99 / worst there s",
                      "moves there", *[f"fewest GPUs ({m})" for m in models[1:]]], out) \
            + "\n" + limit_line(limit)
    return "\n".join([
        table(["configuration", "p99", "worst", "delayed %", "moves", f"{first} (x)",
               "p99 / worst", "moves", *models[1:]], out, WIDTH),
        wrap(f"round-robin: each user's kernels on their turn's GPUs (a baseline); room: the "
             f"product's placement rule, at a kernel's start, over its server's machine (chosen "
             f"by the same rule); + move: a restore whose own GPUs lack room that long, or whose "
             f"SMs are contended, goes where the rule says, and the kernel stays there (without "
             f"it: never moved); + rebalance: idle kernels move off contended GPUs (the "
             f"product's defaults are the last row). At the node's GPUs: "
             f"p99 delay over every cell and worst wait in s, share of cells delayed, restores "
             f"moved. {first}: the fewest GPUs that serve every user under that transfer model "
             f"(every count tried) and their multiple of the compute limit, with p99 / worst "
             f"delay and moves at that count; "
             + ", ".join(models[1:]) + ": the fewest GPUs under that model. *: a larger count "
             "tried does not serve (where kernels land changes with the count of GPUs)."),
        limit_line(limit),
    ])
