"""Per-cell overhead of the kernel agent on a resident kernel.

Three real servers run side by side, one kernel each:

- agent: the extension with its defaults (the provisioner loads the agent in the kernel);
- no agent: the extension on, ``GPUShareApp.load_agent = False``;
- off: the extension disabled (no agent, no gate, no poll loop).

Two measures, both interleaved in rounds across the three so drift hits them alike:

1. over the wire: N cells ``pass`` sent one after another over the v1 websocket protocol
   (JupyterLab's), each timed from send to execute_reply + idle status (round trip; it
   carries jupyter_server's ~40 ms Nagle stall, see gate_latency.py) and, on the kernel's
   clock, from its start of the request to its idle status (kernel span: where the agent's
   pre_run_cell hook runs, without the network's noise);
2. in the kernel: ``get_ipython().run_cell("pass")`` N times in a loop, which runs the same
   pre/post-run-cell hooks (where the agent's per-cell check lives) without the network;
3. in the kernel: ``events.trigger("pre_run_cell", info)`` 20,000 times: the agent's hook
   alone, the one thing it adds to a resident kernel's cell.

Each kernel also reports whether the agent is loaded and connected and how many
pre_run_cell hooks it has, so a figure is never read off the wrong setup.

    python benchmarks/agent_cell_overhead.py [--quick] [--cells 1000] [--rounds 10] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import Server, machine, pass_cells, summary, table

CONFIGS = [("agent", True, {}), ("no agent", True, {"load_agent": False}), ("off", False, {})]

PROBE = """
import json, sys
_mod = sys.modules.get("jupyter_gpushare.kernel.agent")
_agent = getattr(_mod, "_agent", None)
print(json.dumps({"agent": _agent is not None and _agent.client is not None,
                  "pre_run_cell_hooks": len(get_ipython().events.callbacks["pre_run_cell"])}))
"""

IN_KERNEL = """
import json, time
_ip = get_ipython()
_t = time.perf_counter()
for _ in range({n}):
    _ip.run_cell("pass", store_history=False)
print(json.dumps((time.perf_counter() - _t) / {n}))
"""

HOOKS = """
import json, time
from IPython.core.interactiveshell import ExecutionInfo
_ip, _info = get_ipython(), ExecutionInfo("pass", False, False, True, None)
_t = time.perf_counter()
for _ in range({n}):
    _ip.events.trigger("pre_run_cell", _info)
print(json.dumps((time.perf_counter() - _t) / {n}))
"""
HOOK_CALLS = 20000


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 cells")
    ap.add_argument("--cells", type=int, default=1000, help="cells per configuration and measure")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="2 cells a row: the path, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.cells, args.rounds = 2, 2
    warmup, hook_calls = (1, 100) if args.smoke else (30, HOOK_CALLS)
    cells = 300 if args.quick else args.cells
    per_round = max(1, cells // args.rounds)

    print(f"per-cell overhead of the kernel agent -- {machine()}")
    servers = [Server(name.replace(" ", ""), extension=ext, gpushare=cfg) for name, ext, cfg in CONFIGS]
    names = [c[0] for c in CONFIGS]
    wire_s: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    inside: dict[str, list[float]] = {n: [] for n in names}
    hooks: dict[str, list[float]] = {n: [] for n in names}
    probes = {}
    try:
        await asyncio.gather(*(srv.start() for srv in servers))
        started = await asyncio.gather(*(srv.start_kernel("v1") for srv in servers))
        kernels = dict(zip(names, started, strict=True))
        for name in names:
            probes[name] = await kernels[name].value(PROBE)
        if not probes["agent"]["agent"] or probes["no agent"]["agent"] or probes["off"]["agent"]:
            raise RuntimeError(f"unexpected setup: {probes}")
        for name in names:  # warm up
            await pass_cells(kernels[name], warmup, "in_kernel")
            await kernels[name].value(IN_KERNEL.format(n=100))
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                wire_s[name] += await pass_cells(kernels[name], per_round, "in_kernel")
                inside[name].append(await kernels[name].value(IN_KERNEL.format(n=per_round)))
                hooks[name].append(await kernels[name].value(HOOKS.format(n=hook_calls)))
    finally:
        for srv in servers:
            await srv.stop()

    rtt = {k: summary([r for r, _ in v]) for k, v in wire_s.items()}
    span = {k: summary([sp for _, sp in v]) for k, v in wire_s.items()}
    loop = {k: statistics.median(v) for k, v in inside.items()}
    hook = {k: statistics.median(v) for k, v in hooks.items()}
    rows = []
    for name in names:
        rows.append([
            name, str(probes[name]["agent"]).lower(), probes[name]["pre_run_cell_hooks"],
            f"{rtt[name]['median'] * 1e3:.2f}", f"{rtt[name]['median'] / rtt['no agent']['median']:.3f}",
            f"{span[name]['median'] * 1e6:.0f}", f"{span[name]['p95'] * 1e6:.0f}",
            f"{span[name]['median'] / span['no agent']['median']:.3f}",
            f"{span[name]['median'] / span['off']['median']:.3f}",
            f"{loop[name] * 1e6:.1f}", f"{loop[name] / loop['no agent']:.3f}",
            f"{hook[name] * 1e9:.0f}",
        ])
    print(f"\n{per_round * args.rounds} cells `pass` per configuration and measure, in {args.rounds} "
          "interleaved rounds. round trip: client send -> reply + idle received; kernel span: the "
          "kernel's own start -> idle status of each cell; run_cell loop: run_cell('pass') in a "
          "loop inside the kernel")
    print(table(["config", "agent", "hooks", "round trip ms", "x no agent",
                 "kernel span us", "p95 us", "x no agent", "x off", "run_cell us", "x no agent",
                 "pre_run_cell ns"], rows))
    d_span = (span["agent"]["median"] - span["no agent"]["median"]) * 1e6
    d_loop = (loop["agent"] - loop["no agent"]) * 1e6
    d_hook = (hook["agent"] - hook["no agent"]) * 1e9
    print(f"agent - no agent, per cell: {d_span:+.1f} us kernel span (median), {d_loop:+.2f} us "
          f"run_cell loop, {d_hook:+.0f} ns pre_run_cell hooks (medians of the rounds' means)")

if __name__ == "__main__":
    asyncio.run(main())
