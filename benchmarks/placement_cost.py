"""Cost of one placement decision and one rebalance pass at 64 GPUs and 200 kernels
(target: under 5 ms each), as a ratio to one tracker poll of the same node in the same run.

In process, over the real parts: a ``SimNode`` of ``--gpus`` GPUs, the real ``Tracker`` and
``SimulatedTelemetry`` over ``--kernels`` real child processes (``python -c`` sleepers, as in
``tracker_poll.py``: the tracker sees pids, activity and execution state), each holding
256 MiB on a GPU, placed there by this server, and a few more kernels placed and still
starting; the GPUs' history then filled as a server that has run for ``history_seconds``
(1800 s at poll_interval 2 s: 901 samples a GPU) would hold it, a quarter of the GPUs busy
(the kernels there computing), the others nearly idle.

- tracker poll (baseline): ``Tracker.poll()`` with every kernel;
- placement decision: ``Placer.place`` as the provisioner calls it, with the server's
  ``GpuLoad`` over the tracker (SM load over the 120 s window from each GPU's history,
  pending and busy kernels, free memory read from the node, the rule's ``choose``), with
  every kernel placed already; a sample is appended to every GPU before each timing, so each
  includes bringing every GPU's load up to date (the first decision after a poll: each
  GPU's record keeps a running sum over the window, one new sample to fold in), and again
  without (a later decision before the next poll: nothing new to fold in);
- placement with the node daemon: the same decision by a placer told of other servers'
  placements through a real node daemon (``jupyter gpushare node-daemon`` in a subprocess, on
  a Unix socket): an exchange before the decision and the one right after it, awaited;
- rebalance pass: the views of every GPU (``GpuLoad.views``) and the rule's ``rebalance``
  over every resident kernel, with a quarter of the GPUs contended; and the rule alone;
- a move-before-cell decision (``rebalance_before_cell``: the gate asks it for each cell of
  the server's kernels when the option is on): the views and the rule's ``before_cell`` for
  a kernel that trained on a contended GPU.

Each is given as wall time and as this process's CPU time (``time.process_time``: on a
shared, loaded machine the wall time also counts the time others ran), each with its ratio
to the poll's.

    python benchmarks/placement_cost.py [--gpus 64] [--kernels 200] [--repeat 200] [--smoke]

``--smoke``: 4 GPUs, 8 kernels, a few repeats: the whole path in seconds, no figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import machine, summary, table
from tracker_poll import PER_KERNEL, FakeKernelManager, node_gpus, spawn_kernels

from jupyter_gpushare import clock
from jupyter_gpushare.core.tracker import Tracker
from jupyter_gpushare.node.daemon_client import NodeDaemonTurns
from jupyter_gpushare.node.gpu_load import GpuLoad
from jupyter_gpushare.node.node_placed import NodePlaced
from jupyter_gpushare.node.placement import Placer
from jupyter_gpushare.policy.placement import Need, Resident, before_cell, rebalance
from jupyter_gpushare.sim.node import SimNode
from jupyter_gpushare.telemetry.simulated import SimulatedTelemetry

POLL = 2.0  # s between the synthetic history's samples (the default poll_interval)
HISTORY = 1800.0  # s of history (the default history_seconds)
WINDOW = 120.0  # s, the default load_window


class Spec:
    name = "python3"
    display_name = "Python 3"
    metadata: dict[str, Any] = {}


def fill_history(tracker: Tracker, contended: set[int], now: float) -> None:
    """Each GPU's ring as a long-running server holds it: a sample every POLL seconds."""
    n = int(HISTORY / POLL) + 1
    for g, rec in tracker.gpus.items():
        busy = 100.0 if g in contended else 5.0
        rec.history = deque(((now - (n - 1 - i) * POLL, rec.info.memory_used,
                              busy if i % 3 else busy - 5.0) for i in range(n)),
                            maxlen=tracker.history_len)


def mark(tracker: Tracker, contended: set[int], now: float) -> None:
    """Kernels on contended GPUs computed there within the window; others long ago."""
    for rec in tracker.kernels.values():
        for g in rec.gpu_bytes:
            rec.computed[g] = now - (5.0 if g in contended else 3 * WINDOW)


STARTING: dict[str, int] = {}  # kernels placed and still starting: kernel -> GPU
CONTENDED: set[int] = set()  # the GPUs whose kernels compute


def setup(tracker: Tracker, load: GpuLoad, fresh: bool) -> None:
    """Before each timing, the same node whatever the run's length: the kernels still
    starting stay placed and the computing ones stay computing (past their grace and the
    window, they would drop out, and change what is measured); with ``fresh``, one more
    sample on every GPU, as a poll appends, so that each GPU's load is brought up to date
    again (its running sum takes the new sample in)."""
    now = clock.now()
    for kid, g in STARTING.items():
        load.place(kid, [g], Need(PER_KERNEL))
    mark(tracker, CONTENDED, now)
    if fresh:
        for g, rec in tracker.gpus.items():
            t, used, _ = rec.history[-1]
            rec.history.append((max(now, t + 1e-3), used, 100.0 if g in CONTENDED else 5.0))


Times = tuple[list[float], list[float]]  # wall seconds, CPU seconds of this process


def timed(fn: Any, n: int, tracker: Tracker, load: GpuLoad, fresh: bool = True) -> Times:
    wall, cpu = [], []
    for _ in range(n):
        setup(tracker, load, fresh)
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


async def timed_async(fn: Any, n: int, tracker: Tracker, load: GpuLoad,
                      fresh: bool = True) -> Times:
    wall, cpu = [], []
    for _ in range(n):
        setup(tracker, load, fresh)
        t, c = time.perf_counter(), time.process_time()
        await fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


async def timed_polls(tracker: Tracker, n: int) -> Times:
    """One tracker poll, as ``tracker_poll.py`` times it (its sample runs on the tracker's
    thread: this process's CPU time counts it too)."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        await tracker.poll()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def start_daemon(directory: str) -> tuple[subprocess.Popen, str]:
    """A node daemon on a Unix socket of its own (free memory not read: claims only)."""
    path = os.path.join(directory, "node.sock")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter_gpushare.cli", "node-daemon",
                             "--socket", path, "--backend", "none", "--log-level", "ERROR"],
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the node daemon did not start")
        time.sleep(0.05)
    return proc, path


async def run(gpus: int, kernels: int, repeat: int) -> tuple[list[list[Any]], str]:
    children = spawn_kernels(kernels)
    directory = tempfile.mkdtemp(prefix="gpushare-cost-")
    daemon, socket_path = start_daemon(directory)
    try:
        pids = [c.pid for c in children]
        node = SimNode(node_gpus(kernels, gpus))
        for i, pid in enumerate(pids):
            node.alloc(pid, i % gpus, PER_KERNEL)
        km = FakeKernelManager(pids)
        telemetry = SimulatedTelemetry(node)
        tracker = Tracker(km, telemetry, HISTORY, POLL)
        await timed_polls(tracker, 3)  # the records' first fill (psutil objects made)
        # the baseline's polls run on a tracker of their own: a poll appends what the node
        # reads now (sleepers: idle GPUs), which would change the load measured below
        poller = Tracker(km, telemetry, HISTORY, POLL)
        await timed_polls(poller, 3)
        now = clock.now()
        contended = set(range(0, gpus, 4))
        CONTENDED.update(contended)
        fill_history(tracker, contended, now)
        load = GpuLoad(lambda: tracker.gpus, lambda: tracker.kernels, WINDOW)
        ids = km.list_kernel_ids()
        for i, kid in enumerate(ids):  # every kernel placed by this server where it runs
            load.place(kid, [i % gpus], Need(PER_KERNEL))
        for i in range(max(1, gpus // 4)):  # and some still starting: pending load
            STARTING[f"starting-{i}"] = (4 * i + 1) % gpus
        setup(tracker, load, False)

        async def read_free(indices: list[int]) -> dict[int, int | None]:
            return {g: telemetry.free_bytes(g) for g in indices}

        placer = Placer(lambda: [r.info for r in tracker.gpus.values()], read_free, dict, dict,
                        lambda: ids, min_room=512 << 20, load=load,
                        recent=tracker.recent_peaks_of)

        async def place() -> None:
            got = await placer.place("new-kernel", Spec(), {})
            assert got is not None and got.gpus
            load.placed.pop("new-kernel")

        told = NodePlaced(NodeDaemonTurns(socket_path).placed,
                          lambda: [r.info for r in tracker.gpus.values()],
                          lambda: {g: (n, k, 0) for g, (n, k) in load.unused().items()},
                          keep=lambda: 3 * POLL)
        other = NodeDaemonTurns(socket_path)  # another server's claim on every GPU
        await other.placed({r.info.uuid: (PER_KERNEL, 1, 0) for r in tracker.gpus.values()})
        told_placer = Placer(lambda: [r.info for r in tracker.gpus.values()], read_free, dict,
                             dict, lambda: ids, min_room=512 << 20, load=load,
                             recent=tracker.recent_peaks_of, node_placed=told)

        async def place_told() -> None:
            got = await told_placer.place("new-kernel", Spec(), {})
            assert got is not None and got.gpus and told.error is None, told.error
            await told.told()  # the exchange right after it
            load.placed.pop("new-kernel")

        residents = [Resident(kid, dict(rec.gpu_bytes), i % 2 == 0, idle_seconds=float(i))
                     for i, (kid, rec) in enumerate(tracker.kernels.items())]
        room = {g: telemetry.free_bytes(g) for g in range(gpus)}

        def views() -> Any:
            return load.views(room)

        def pass_() -> None:
            rebalance(residents, views())

        seen = views()
        moves = rebalance(residents, seen)
        # a cell arrives for a kernel that trained on a contended GPU (rebalance_before_cell)
        heavy = Resident(residents[0].kernel, residents[0].gpus, True)
        reading = {g: float(r.history[-1][2] or 0.0) for g, r in tracker.gpus.items()}

        def before() -> Any:
            return before_cell(heavy, 90.0, reading, load.views(room, exclude=heavy.kernel))

        planned = before()
        keys = ("poll", "place", "place_kept", "place_told", "pass", "pass_kept", "rule",
                "before")
        results: dict[str, Times] = {k: ([], []) for k in keys}

        def add(key: str, got: Times) -> None:
            results[key][0].extend(got[0])
            results[key][1].extend(got[1])

        rounds = 5  # interleaved, so drift hits every measure alike
        for _ in range(rounds):
            add("poll", await timed_polls(poller, max(1, repeat // 10 // rounds)))
            add("place", await timed_async(place, repeat // rounds, tracker, load))
            add("pass", timed(pass_, repeat // rounds, tracker, load))
            add("place_kept", await timed_async(place, repeat // rounds, tracker, load, False))
            add("place_told", await timed_async(place_told, repeat // rounds, tracker, load,
                                                False))
            add("pass_kept", timed(pass_, repeat // rounds, tracker, load, False))
            add("rule", timed(lambda: rebalance(residents, seen), repeat // rounds, tracker,
                              load, False))
            add("before", timed(before, repeat // rounds, tracker, load, False))
        assert len(tracker.kernels) == kernels
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        for c in children:
            c.stdin.close()  # type: ignore[union-attr]
        for c in children:  # a loaded machine may take a while to even start them
            try:
                c.wait(timeout=60)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    base = summary(results["poll"][0])["median"]
    base_cpu = summary(results["poll"][1])["median"]
    rows = []
    for key, label in (("poll", f"baseline: one tracker poll, {kernels} kernels"),
                       ("place", "one placement decision (Placer.place)"),
                       ("place_kept", "  the same, loads already up to date this poll"),
                       ("place_told", "  the same, with the node daemon (two exchanges)"),
                       ("pass", "one rebalance pass (views + rebalance)"),
                       ("pass_kept", "  the same, loads already up to date this poll"),
                       ("rule", "  the rule alone (rebalance)"),
                       ("before", "one move-before-cell decision (views + before_cell)")):
        s, c = summary(results[key][0]), summary(results[key][1])
        rows.append([label, s["n"], f"{s['median'] * 1e3:.3f}", f"{s['p95'] * 1e3:.3f}",
                     f"{s['median'] / base:.3f}", f"{c['median'] * 1e3:.3f}",
                     f"{c['median'] / base_cpu:.3f}" if base_cpu else "-"])
    note = (f"{gpus} GPUs of {node.capacities[0] >> 30} GiB, {kernels} kernels, "
            f"{len(contended)} GPUs contended; the pass planned {len(moves)} move(s); the "
            f"decision before a cell {'moved ' + str(planned) if planned else 'kept the kernel'}")
    return rows, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--kernels", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=200, help="timings of each measure")
    parser.add_argument("--smoke", action="store_true", help="4 GPUs, 8 kernels: the path only")
    args = parser.parse_args()
    gpus, kernels, repeat = (4, 8, 10) if args.smoke else (args.gpus, args.kernels, args.repeat)
    rows, note = asyncio.run(run(gpus, kernels, repeat))
    print(machine())
    print(table(["measure", "n", "median ms", "p95 ms", "x poll", "CPU ms", "CPU x poll"], rows))
    print(note + ("  (--smoke: no figures)" if args.smoke else ""))


if __name__ == "__main__":
    main()
