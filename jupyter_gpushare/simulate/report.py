"""The comparison as text (tables, ratios against ``exclusive`` from the same run) and PNGs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .calibration import PUBLISHED


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _s(v: float) -> str:
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def statistics_table(stats: dict[str, Any]) -> str:
    rows = [[PUBLISHED[k][0], PUBLISHED[k][1], "n/a" if stats.get(k) is None else f"{stats[k]:.0f}"]
            for k in PUBLISHED]
    return table(["published figure", "target %", "this trace %"], rows)


def same_load_table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("exclusive")
    rows = []
    for name, f in results.items():
        rows.append([
            name, f["gpus"], f"{f['users_per_gpu']:.2f}", f["oom_failures"],
            f"{f['cells_delayed_pct']:.2f}",
            f"{_s(f['delay_p50_s'])} / {_s(f['delay_p95_s'])} / {_s(f['delay_p99_s'])}",
            _s(f["cell_delay_p99_s"]), f"{f['work_lost_gpu_hours']:.1f}",
            f"{f['reclaimed_gpu_hours']:.0f}", f"{f['mean_allocation_pct']:.1f}",
            f"{f['mean_sm_utilization_pct']:.1f}",
            _ratio(f["mean_sm_utilization_pct"], base["mean_sm_utilization_pct"]) if base else "-",
            f"{f['sm_sharing_stretch_p99']:.2f}",
        ])
    return table(["policy", "GPUs", "users/GPU", "OOM cells", "delayed %",
                  "delay p50/p95/p99 s (delayed cells)", "p99 all cells s", "work lost GPU-h",
                  "reclaimed GPU-h", "mean alloc %", "mean SM %", "SM x excl.", "slowdown p99"],
                 rows)


def capacity_table(capacity: dict[str, dict[str, Any]]) -> str:
    base = capacity.get("exclusive", {}).get("users_per_gpu", 0.0)
    rows = []
    for name, c in capacity.items():
        f = c["figures"] or {}
        at_max = "+" if c["capped"] else ""
        rows.append([
            name, f"{c['users_per_gpu']:.2f}{at_max}", _ratio(c["users_per_gpu"], base), c["users"],
            _s(f.get("cell_delay_p99_s", 0.0)), f"{f.get('cells_delayed_pct', 0.0):.2f}",
            _s(f.get("delay_max_s", 0.0)), f"{f.get('work_lost_gpu_hours', 0.0):.1f}",
            f"{f.get('mean_allocation_pct', 0.0):.1f}", f"{f.get('mean_sm_utilization_pct', 0.0):.1f}",
        ])
    return table(["policy", "most users/GPU", "x exclusive", "users", "p99 all cells s",
                  "delayed %", "worst delay s", "work lost GPU-h", "mean alloc %", "mean SM %"], rows)


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
            "work_lost_gpu_hours": f.get("work_lost_gpu_hours")}


def goal_line(g: dict[str, Any]) -> str:
    if not g.get("checked"):
        return "goal (>= 3x users per GPU over exclusive, p99 <= 1 s, no work lost): not checked"
    verdict = "met" if g["met"] else "NOT met"
    lost = g["work_lost_gpu_hours"]
    return (f"goal (>= 3x users per GPU over exclusive, p99 cell delay <= 1 s, no work lost): "
            f"{verdict}: gpushare serves {g['ratio']:.2f}x exclusive's users per GPU with p99 <= "
            f"{g['delay_bound_s']:g} s" + ("" if lost is None else f" and {lost:.1f} GPU-h of work lost"))


def plot(f: dict[str, Any], title: str, path: Path) -> str | None:
    """Allocation against utilization over time, as a PNG; a message instead if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNGs: matplotlib is not installed (pip install 'jupyter-gpushare[simulate]')"
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
