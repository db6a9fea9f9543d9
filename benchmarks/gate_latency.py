"""Latency the gate adds to an execute_request on a resident kernel.

Two real servers run side by side, both with the extension and the kernel agent:

- gate: the default, where the extension installs its GateConnection;
- stock: ``ServerApp.kernel_websocket_connection_class`` set to a plain subclass of the
  stock ZMQChannelsWebsocketConnection (``_server.StockConnection``), so the extension
  leaves the gate off (naming the stock class itself would not: ``_install_gate`` replaces
  exactly that class). The server log is checked for the "gate is off" line on stock and
  for its absence on gate;
- stock + TCP_NODELAY (``_server.NoDelayConnection``) and gate + TCP_NODELAY
  (``_server.GateNoDelayConnection``): Nagle's algorithm, which jupyter_server leaves on,
  stalls every round trip ~40 ms on the client's delayed ACK (unrelated to the gate, but
  it dwarfs it); with it off, round trips compare to a fraction of a millisecond.

Each server has one kernel per websocket protocol (legacy JSON and the v1 binary protocol
JupyterLab uses). N cells ``pass`` per server and protocol, interleaved in rounds with
alternating order so drift hits all alike. Two times per cell: inbound (client send -> the
kernel starts handling it, from the execute_reply's ``started`` metadata; same clock) is the
path the gate sits on; round trip (send -> execute_reply and idle status received) is what a
user waits. Printed: median / p95 of both, and the ratio to stock.

    python benchmarks/gate_latency.py [--quick] [--n 300] [--rounds 10] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server import Server, machine, pass_cells, summary, table

HERE = os.path.dirname(os.path.abspath(__file__))
GATE_OFF_LOG = "the gate is off"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N=100")
    ap.add_argument("--n", type=int, default=300, help="round trips per server and protocol")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--smoke", action="store_true",
                    help="2 cells a row, the v1 protocol only: the path, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.n, args.rounds, args.warmup = 2, 2, 1
    n = 100 if args.quick else args.n
    per_round = max(1, n // args.rounds)

    print(f"gate latency on a resident kernel -- {machine()}")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    servers = [
        Server("gate"),
        Server("stock", server={"kernel_websocket_connection_class": "_server.StockConnection"}),
        Server("nodelay", server={"kernel_websocket_connection_class": "_server.NoDelayConnection"}),
        Server("gate-nodelay",
               server={"kernel_websocket_connection_class": "_server.GateNoDelayConnection"}),
    ]
    protocols = ("v1",) if args.smoke else ("json", "v1")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        await asyncio.gather(*(srv.start() for srv in servers))
        keys = [(srv, p) for srv in servers for p in protocols]
        started = await asyncio.gather(*(srv.start_kernel(p) for srv, p in keys))
        kernels = {(srv.name, p): k for (srv, p), k in zip(keys, started, strict=True)}
        for srv in servers:
            gate_off = GATE_OFF_LOG in srv.log_tail(400)
            if gate_off != (not srv.name.startswith("gate")):
                raise RuntimeError(f"server {srv.name}: gate off = {gate_off}:\n{srv.log_tail()}")
        for kernel in kernels.values():
            await pass_cells(kernel, args.warmup, "inbound")
        results = {key: [] for key in kernels}
        for r in range(args.rounds):
            order = list(kernels) if r % 2 == 0 else list(reversed(kernels))
            for key in order:
                results[key] += await pass_cells(kernels[key], per_round, "inbound")
    finally:
        for srv in servers:
            await srv.stop()

    rows = []
    labels = {"stock": "stock", "gate": "gate", "nodelay": "stock + TCP_NODELAY",
              "gate-nodelay": "gate + TCP_NODELAY"}
    for p in protocols:
        stats = {name: (summary([r for r, _ in results[(name, p)]]),
                        summary([i for _, i in results[(name, p)]])) for name in labels}
        for name, label in labels.items():
            base_rtt, base_in = stats["nodelay" if name.endswith("nodelay") else "stock"]
            rtt, inbound = stats[name]
            rows.append([f"{p:4}  {label}", rtt["n"],
                         f"{inbound['median'] * 1e3:.3f}", f"{inbound['p95'] * 1e3:.3f}",
                         f"{inbound['median'] / base_in['median']:.3f}",
                         f"{rtt['median'] * 1e3:.2f}", f"{rtt['p95'] * 1e3:.2f}",
                         f"{rtt['median'] / base_rtt['median']:.3f}"])
        for gate, stock in (("gate", "stock"), ("gate-nodelay", "nodelay")):
            (g_rtt, g_in), (s_rtt, s_in) = stats[gate], stats[stock]
            rows.append([f"{p:4}  {labels[gate]} - {labels[stock]}", "",
                         f"{(g_in['median'] - s_in['median']) * 1e3:+.3f}", "", "",
                         f"{(g_rtt['median'] - s_rtt['median']) * 1e3:+.2f}", "", ""])
    print(f"\ncell `pass`, {per_round * args.rounds} per row in {args.rounds} interleaved rounds "
          f"(after {args.warmup} warm-up cells). inbound = client send -> kernel starts the request "
          "(execute_reply metadata 'started'): the path the gate is on. round trip = send -> "
          "execute_reply and idle status received.")
    print(table(["protocol / connection", "n", "inbound med ms", "p95 ms", "x base",
                 "round trip med ms", "p95 ms", "x base"], rows))
    print("x base: against stock, or against stock + TCP_NODELAY for the TCP_NODELAY rows. The "
          "stock round trip lands near 44 or 48 ms per connection (the phase of the client's "
          "delayed ACK), so only the TCP_NODELAY rows resolve the gate's share of a round trip.")


if __name__ == "__main__":
    asyncio.run(main())
