"""The figures benchmarks/README.md quotes from a GPU run, computed from its records.

    python benchmarks/gpu/figures.py stage1.jsonl stage2.jsonl [stage3.jsonl]

Prints Markdown: the machine, NVML attribution, the driver method against pinned copies per
size and its fit over every size, the server's round trips (PyTorch, CuPy, JAX's pool),
lazy mode, caps, the fingerprint's cost, the shutdown of a restored kernel, the cold start,
and every failed check. Standard library only (it reads what report.py writes).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from report import bandwidth_rows, fits, fmt_bytes, machine, read, steps_of


def _step(records: list[dict[str, Any]], scene: str, step: str) -> dict[str, Any]:
    """The step's record ({} when the records lack it)."""
    return next((r for r in steps_of(records) if (r["scene"], r["step"]) == (scene, step)), {})


def _rate(n: float, s: float | None, moved: bool) -> str:
    # a rate only where the whole state left the GPU: else it divides what did not move
    if not moved:
        return "nothing moved"
    return f"{n / s / 1e9:.2f} GB/s" if s else "-"


def _signed(n: int | None) -> str:
    return "?" if n is None else ("-" if n < 0 else "+") + fmt_bytes(abs(n))


def _fit(d: str, fit: dict[str, float | None]) -> str | None:
    o, g = fit["overhead_s"], fit["GBps"]
    return None if o is None or g is None else f"{d} {o * 1e3:.0f} ms + {g:.2f} GB/s"


def _first(detail: str) -> str:
    """A check's detail on one line: a traceback by its last two lines."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip(" ^~")] or [""]
    return (" ... ".join(lines[-3:]) if lines[0].startswith("Traceback") else lines[0])[:300]


def figures(records: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    m = machine(records)
    torch_build = next((r["figures"][k].get("torch") for r in steps_of(records)
                        for k in ("state", "torch_state") if isinstance(r["figures"].get(k), dict)
                        and r["figures"][k].get("torch")), None)
    if m:
        v = m.get("versions") or {}
        out += [f"- machine: {m.get('gpus')}; driver {m.get('driver')}, CUDA (driver) "
                f"{m.get('cuda_driver')}; host {m.get('host')}",
                "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x)
                + (f" (PyTorch build {torch_build})" if torch_build else "")]

    a = _step(records, "torch", "attribution")
    f = a.get("figures", {}).get("attribution")
    if f:
        out.append(f"- NVML attribution: the kernel's memory showed in status "
                   f"{f['seconds_to_show']:.2f} s after the state was on the GPU (poll "
                   f"{f['poll_s']} s); status {fmt_bytes(f['status_bytes'])} = CUDA context "
                   f"{fmt_bytes(f['context_bytes'])} + {fmt_bytes(f['status_bytes'] - f['context_bytes'])}"
                   f" for a state of {fmt_bytes(f['state_bytes'])} in an allocator reserve of "
                   f"{fmt_bytes(f['reserved_bytes'])}")

    rows = sorted(bandwidth_rows(records), key=lambda r: (r["method"], r["bytes"]))
    if rows:
        out += ["", "| method | size | release s | restore s | release GB/s | restore GB/s | "
                "x pinned D2H / H2D | pinned D2H / H2D GB/s | intact |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['method']} | {fmt_bytes(r['bytes'])} | {r['release_s']:.3f} | "
                       f"{r['restore_s']:.3f} | {r['release_GBps']:.2f} | {r['restore_GBps']:.2f} | "
                       f"{r['release_frac']:.3f} / {r['restore_frac']:.3f} | "
                       f"{r['pinned_d2h_GBps']:.1f} / {r['pinned_h2d_GBps']:.1f} | "
                       f"{'yes' if r['intact'] else 'NO'} |")
        out.append("")
        for method, fit in fits(rows).items():
            sizes = sorted({r["bytes"] for r in rows if method == "pinned copy" or r["method"] == method})
            said = [_fit(d, fit[d]) for d in ("release", "restore")]
            out.append(f"- fit over {', '.join(fmt_bytes(b) for b in sizes)} ({method}): "
                       + "; ".join(x for x in said if x))

    for scene, step in (("torch", "driver_round_trip"), ("frameworks", "cupy_round_trip"),
                        ("auto", "torch_pick"), ("auto", "jax_pool_pick")):
        r = _step(records, scene, step)
        t = r.get("figures", {}).get("round_trip")
        if t:
            moved = t["freed_bytes"] is None or t["freed_bytes"] >= 0.9 * t["held_bytes"]
            out.append(f"- {scene}.{step} ({t.get('method')}): held {fmt_bytes(t['held_bytes'])}, "
                       f"GPU free afterwards {_signed(t['freed_bytes'])}; release "
                       f"{t['release_s']} s ({_rate(t['held_bytes'], t['release_s'], moved)}), restore "
                       f"{t['restore_s']} s ({_rate(t['held_bytes'], t['restore_s'], moved)}), next cell "
                       f"{t['cell_s']} s; checksum equal: {t['checksum_equal']}")
    r = _step(records, "frameworks", "jax_room_wait")
    if r:
        rel = next((c["detail"] for c in r["checks"] if c["name"].endswith("release over REST")), "")
        out.append(f"- frameworks.jax_room_wait: {r['status']}; release: {rel}")
    r = _step(records, "lazy", "cpu_cell_then_gpu_cell")
    c = r.get("figures", {}).get("cells")
    if c:
        out.append(f"- lazy mode: a CPU-only cell on a released kernel {c['cpu_cell_s']} s, no "
                   f"restore; the GPU cell after it {c['gpu_cell_s']} s, of which the restore "
                   f"{c['restore_s']} s")
    for step in ("torch_cap", "jax_cap"):
        r = _step(records, "caps", step)
        if r:
            out.append(f"- caps.{step}: {r['status']}; " + "; ".join(
                f"{c['name']}: {c['detail'].splitlines()[0][:100]}" for c in r["checks"]))
    r = _step(records, "bandwidth_large", "fingerprint")
    for row in r.get("figures", {}).get("fingerprint_rows", []):
        out.append(f"- fingerprint of {fmt_bytes(row['bytes'])}: {row['fingerprint_s'] * 1e3:.1f} ms "
                   f"against a pinned copy's {row['copy_s'] * 1e3:.1f} ms "
                   f"({row['fraction_of_copy']:.1%}); a one-word change seen: {row['seen']}")
    r = _step(records, "torch", "shutdown_restored")
    if r:
        out.append("- shutdown of a restored kernel: " + "; ".join(
            f"{c['name']}: {c['detail'].strip()}" for c in r["checks"]))
    r = _step(records, "bandwidth", "cold_start")
    cold = r.get("figures", {}).get("fresh_process_cuInit_s")
    if cold is not None:
        out.append(f"- a fresh process's import of cuda.bindings + cuInit: {cold:.3f} s")

    bad = [(r, c) for r in steps_of(records) for c in r["checks"] if c["ok"] is False]
    out += ["", f"Failed checks ({len(bad)}):"]
    out += [f"- {r['scene']}.{r['step']}: {c['name']}: {_first(c['detail'])}" for r, c in bad]
    out += [f"- {r['scene']}.{r['step']}: {r['status']}: {r['reason']}" for r in steps_of(records)
            if r["status"] in ("failed", "timeout") and r["reason"]]
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    records = [rec for p in argv for rec in read(Path(p))]
    print("\n".join(figures(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
