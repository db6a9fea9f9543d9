"""Load: 50 kernels cycling release/restore while the status is polled at 10 Hz.

One real server (simulated backend, four 16 GiB simulated GPUs, poll_interval 1 s,
idle_timeout 1 h so that only the benchmark releases, history_seconds 30 so that the ring
buffers are full before the first measure) and 50 real ipykernels started over REST, each
holding a few ``simgpu`` arrays (32 MiB in all by default) on GPU ``i % 4`` whose CRC-32s
are taken at the start.

- **Warm-up:** one release/restore of every kernel, so first-use costs (imports, allocator
  growth, the first websocket messages) are not counted as growth.
- **Before:** once every kernel is resident and idle and a few polls have passed: the server
  process's open file descriptors (/proc/PID/fd), RSS and threads (psutil), and its live
  asyncio tasks (the ``gpushare_asyncio_tasks`` gauge on /metrics). Then 10 s of status
  polling at 10 Hz with nothing else running: the idle baseline of the poll latency.
- **Load:** N rounds; in each, every kernel is released over REST, then restored either over
  REST (then a cell reads its checksums) or, for one kernel in five (rotating), by running
  the checksum cell over the websocket so that the gate restores it; at most ``--concurrency``
  kernels cycle at a time. Every release must answer ``released`` with all its bytes, every
  restore must complete (a ``202`` is followed until the kernel is resident), every checksum
  must equal the one taken at the start, and after each round the status must show every
  kernel resident with the expected release/restore counts and no error. The status poller
  runs at 10 Hz (its own thread and keep-alive connection, as a browser tab) throughout.
- **After:** the same measures as before, once everything settled.

Printed: before/after/ratio of fds, tasks, RSS and threads (and their trend per round);
release and restore latency (REST) and the gate's restore-then-cell time; the status poll
latency under load against the idle baseline; counts of operations, failures and checksum
mismatches (each failure is printed). Exit status 1 if anything failed.

Host memory: about 130 MiB per kernel (the process, the state and its copy while moving),
7 GiB for 50 kernels; fewer kernels are started (with a note) when that does not fit.

    python benchmarks/load_cycle.py [--quick] [--kernels 50] [--rounds 10] [--mib 32] [--smoke]
                                    [--concurrency 8] [--hz 10] [--history 30]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import re
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psutil
from tornado.httpclient import HTTPClientError
from tornado.simple_httpclient import HTTPTimeoutError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import GiB, Kernel, Server, machine, process_cpu_seconds, quantile, table

MiB = 1 << 20
GPUS = 4
POLL_INTERVAL = 1.0
KERNEL_HOST_BYTES = 130 * MiB  # a kernel process with the agent, numpy and a 32 MiB state, moving
RESIDENT = ("active", "idle")

FILL = """
import json, numpy as np
from jupyter_gpushare.sim import simgpu
xs = [simgpu.array(np.random.default_rng({seed} + i).integers(0, 2**32, {n}, dtype=np.uint32),
                   device={gpu}, copy=False) for i in range({count})]
print(json.dumps({{"bytes": sum(x.nbytes for x in xs), "sums": [x.checksum() for x in xs]}}))
"""

CHECK = "print(json.dumps([x.checksum() for x in xs]))"


# -- the status poller ----------------------------------------------------------------------
class StatusPoller(threading.Thread):
    """GET /api/gpushare/status at ``hz`` on one keep-alive connection, in its own thread (so
    the benchmark's own event loop does not delay it). Samples are filed under the phase set
    when they were taken; no phase = not polling."""

    def __init__(self, srv: Server, hz: float, kernel_ids: set[str]):
        super().__init__(name="status-poller", daemon=True)
        self.host, self.port, self.token = "127.0.0.1", srv.port, srv.token
        self.period = 1.0 / hz
        self.kernel_ids = kernel_ids
        self.phase: str | None = None
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, list[str]] = defaultdict(list)  # non-200s, refused, bad bodies
        self.span: dict[str, float] = defaultdict(float)  # seconds polled per phase
        self._quit = threading.Event()
        self._conn: http.client.HTTPConnection | None = None

    def stop(self) -> None:
        self._quit.set()
        # idle between phases, it ends at once; one stuck in a request to a server that no
        # longer answers is a daemon and must not hold up the stopping of everything else
        self.join(timeout=2)

    def _get(self) -> tuple[int, bytes]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        self._conn.request("GET", "/api/gpushare/status",
                           headers={"Authorization": f"token {self.token}"})
        r = self._conn.getresponse()
        return r.status, r.read()

    def _check(self, body: bytes) -> str | None:
        """Why a 200 body is not a sane status (None: it is)."""
        try:
            status = json.loads(body)
            shown = {k["id"]: k for k in status["kernels"]}
        except (ValueError, KeyError, TypeError) as e:
            return f"unreadable status: {e}"
        missing = self.kernel_ids - set(shown)
        if missing:
            return f"{len(missing)} kernel(s) missing from the status"
        bad = [f"{kid[:8]} {k['state']}: {k['error']}" for kid, k in shown.items()
               if kid in self.kernel_ids and k.get("state") == "failed"]
        return f"failed kernels: {bad}" if bad else None

    def run(self) -> None:
        next_at = time.perf_counter()
        while not self._quit.is_set():
            phase = self.phase
            if phase is None:
                self._close()
                self._quit.wait(0.02)
                next_at = time.perf_counter()
                continue
            start = time.perf_counter()
            try:
                code, body = self._get()
                took = time.perf_counter() - start
                if code != 200:
                    self.errors[phase].append(f"HTTP {code}: {body[:200]!r}")
                else:
                    self.latency[phase].append(took)
                    problem = self._check(body)
                    if problem:
                        self.errors[phase].append(problem)
            except (OSError, http.client.HTTPException) as e:
                self.errors[phase].append(f"{type(e).__name__}: {e}")
                self._close()
            next_at += self.period
            now = time.perf_counter()
            if next_at < now:  # a slow answer: the next poll goes now, never two at once
                next_at = now
            self._quit.wait(next_at - now)
            self.span[phase] += time.perf_counter() - start

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# -- measuring the server ----------------------------------------------------------------------
@dataclass
class Resources:
    fds: int
    tasks: int
    rss: int
    threads: int


async def asyncio_tasks(srv: Server) -> int:
    text = await srv.metrics()
    m = re.search(r"^gpushare_asyncio_tasks (\S+)$", text, re.M)
    if m is None:
        raise RuntimeError("the server exports no gpushare_asyncio_tasks gauge")
    return int(float(m.group(1)))


async def resources(srv: Server) -> Resources:
    """The server process's fds, asyncio tasks (at its last poll), RSS and threads."""
    p = psutil.Process(srv.pid)
    return Resources(fds=p.num_fds(), tasks=await asyncio_tasks(srv), rss=p.memory_info().rss,
                     threads=p.num_threads())


async def settled_resources(srv: Server, samples: int = 5) -> Resources:
    """Median of a few readings one poll apart (a task or fd in flight can come and go)."""
    seen = []
    for _ in range(samples):
        await asyncio.sleep(POLL_INTERVAL)
        seen.append(await resources(srv))

    def med(key: str) -> int:
        return sorted(getattr(r, key) for r in seen)[len(seen) // 2]

    return Resources(*(med(k) for k in ("fds", "tasks", "rss", "threads")))


def kernels_rss(srv: Server) -> int:
    total = 0
    for p in srv.kernel_processes():
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


async def server_counters(srv: Server) -> dict[str, float]:
    """gpushare_releases_total / gpushare_restores_total by outcome; polls and their seconds."""
    text = await srv.metrics()
    out: dict[str, float] = defaultdict(float)
    pattern = r'^gpushare_(releases|restores)_total\{method="[^"]*",outcome="(\w+)"\} (\S+)$'
    for what, outcome, value in re.findall(pattern, text, re.M):
        out[f"{what} {outcome}"] += float(value)
    for key in ("count", "sum"):
        m = re.search(rf"^gpushare_poll_seconds_{key} (\S+)$", text, re.M)
        out[f"polls {key}"] = float(m.group(1)) if m else 0.0
    return out


# -- the cycling ---------------------------------------------------------------------------------
@dataclass(eq=False)  # a kernel is itself, not its values
class KernelUnderLoad:
    kernel: Kernel
    index: int
    nbytes: int
    sums: list[str]
    cycles: int = 0  # completed release+restore pairs the status must show


@dataclass
class Tally:
    release: list[float] = field(default_factory=list)  # s, REST
    restore: list[float] = field(default_factory=list)  # s, REST (until resident, 202s followed)
    gate: list[float] = field(default_factory=list)  # s, the checksum cell that restored
    releases_ok: int = 0
    restores_rest: int = 0
    restores_gate: int = 0
    accepted_202: int = 0
    checks: int = 0
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, k: KernelUnderLoad, rnd: int, what: str) -> None:
        self.failures.append(f"round {rnd}, kernel {k.index} ({k.kernel.id[:8]}): {what}")


def http_error(e: HTTPClientError) -> str:
    body = e.response.body.decode(errors="replace") if e.response is not None and e.response.body else ""
    try:
        body = json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        pass
    return f"HTTP {e.code}: {body[:300]}"


async def wait_resident(srv: Server, kid: str, timeout: float = 120) -> dict[str, Any]:
    """Follow a 202: the restore goes on in the background until the kernel is resident."""
    return await srv.wait_kernel(kid, lambda k: k["state"] in (*RESIDENT, "failed"),
                                 "the restore that answered 202", timeout=timeout)


async def cycle(srv: Server, k: KernelUnderLoad, rnd: int, via_gate: bool, tally: Tally) -> None:
    kid = k.kernel.id
    t = time.perf_counter()
    try:
        view = await srv.api("POST", f"/api/gpushare/kernels/{kid}/release", timeout=120)
    except HTTPClientError as e:
        tally.fail(k, rnd, f"release: {http_error(e)}")
        return
    tally.release.append(time.perf_counter() - t)
    if view["state"] != "released" or view["released_bytes"] != k.nbytes:
        tally.fail(k, rnd, f"release answered {view['state']}, {view['released_bytes']} bytes "
                           f"(want released, {k.nbytes}): {view['error']}")
        return
    tally.releases_ok += 1
    if via_gate:
        t = time.perf_counter()
        try:
            sums = await k.kernel.value(CHECK, timeout=120)  # held by the gate until restored
        except (RuntimeError, TimeoutError, ConnectionError) as e:
            tally.fail(k, rnd, f"cell through the gate: {e}")
            return
        tally.gate.append(time.perf_counter() - t)
        tally.restores_gate += 1
    else:
        t = time.perf_counter()
        try:
            r = await srv.api("POST", f"/api/gpushare/kernels/{kid}/restore", timeout=120)
            # a 202 comes back as a normal answer; its body shows the restore still waiting
            if r["state"] not in RESIDENT:
                tally.accepted_202 += 1
                r = await wait_resident(srv, kid)
        except (HTTPClientError, TimeoutError) as e:
            tally.fail(k, rnd, f"restore: {http_error(e) if isinstance(e, HTTPClientError) else e}")
            return
        tally.restore.append(time.perf_counter() - t)
        if r["state"] not in RESIDENT:
            tally.fail(k, rnd, f"restore ended {r['state']}: {r['error']}")
            return
        tally.restores_rest += 1
        try:
            sums = await k.kernel.value(CHECK, timeout=120)
        except (RuntimeError, TimeoutError, ConnectionError) as e:
            tally.fail(k, rnd, f"checksum cell: {e}")
            return
    tally.checks += 1
    if sums != k.sums:
        tally.mismatches += 1
        tally.fail(k, rnd, "checksums differ from the ones taken at the start")
        return
    k.cycles += 1


async def one_round(srv: Server, ks: list[KernelUnderLoad], rnd: int, concurrency: int,
                    tally: Tally) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(k: KernelUnderLoad) -> None:
        async with gate:
            await cycle(srv, k, rnd, via_gate=(k.index + rnd) % 5 == 0, tally=tally)

    await asyncio.gather(*(one(k) for k in ks))


async def check_shown(srv: Server, ks: list[KernelUnderLoad], warmup: int, rnd: int,
                      tally: Tally, timeout: float = 60) -> None:
    """The status must show every kernel resident, idle, with its counts and no error."""
    want = {k.kernel.id: k for k in ks}
    deadline = time.monotonic() + timeout
    while True:
        shown = {v["id"]: v for v in (await srv.api("GET", "/api/gpushare/status"))["kernels"]}
        wrong = {}
        for kid, k in want.items():
            v = shown.get(kid)
            if v is None:
                wrong[k] = "missing from the status"
            elif (v["state"] not in RESIDENT or v["execution_state"] != "idle" or v["error"]
                  or v["waiting"] or v["released_bytes"] or v["gpu_memory_bytes"] != k.nbytes):
                wrong[k] = (f"{v['state']}, {v['execution_state']}, {v['gpu_memory_bytes']} bytes on "
                            f"the GPU, {v['released_bytes']} held, error {v['error']!r}, "
                            f"waiting {v['waiting']!r}")
            elif (v["releases"], v["restores"]) != (warmup + k.cycles,) * 2:
                wrong[k] = (f"{v['releases']} releases, {v['restores']} restores shown, "
                            f"{warmup + k.cycles} cycles completed")
        if not wrong:
            return
        if time.monotonic() > deadline:
            for k, why in wrong.items():
                tally.fail(k, rnd, f"status after the round: {why}")
            return
        await asyncio.sleep(0.2)


# -- the run -------------------------------------------------------------------------------------
async def start_kernels(srv: Server, n: int, mib: int, concurrency: int) -> list[KernelUnderLoad]:
    arrays = 4
    per_array = mib * MiB // arrays // 4  # uint32 elements
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> KernelUnderLoad:
        async with gate:
            kernel = await srv.start_kernel()
            info = await kernel.value(FILL.format(seed=1000 * i, n=per_array, gpu=i % GPUS,
                                                  count=arrays), timeout=120)
            return KernelUnderLoad(kernel, i, info["bytes"], info["sums"])

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def stop_kernels(srv: Server, concurrency: int) -> None:
    """Shut the kernels down over REST, several at a time (Server.stop would go one by one)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(kid: str) -> None:
        async with gate:
            if srv.unresponsive:
                return
            try:
                await srv.api("DELETE", f"/api/kernels/{kid}", timeout=30)
                srv.kernel_ids.remove(kid)
            except HTTPTimeoutError:  # the server stopped answering: Server.stop kills it all
                srv.unresponsive = True
                print(f"shutting down kernel {kid}: the server does not answer", file=sys.stderr)
            except Exception as e:  # Server.stop tries again, then kills what is left
                print(f"shutting down kernel {kid}: {e}", file=sys.stderr)

    for k in srv.kernels:
        k.close()
    srv.kernels.clear()
    await asyncio.gather(*(one(kid) for kid in list(srv.kernel_ids)))


def lat_row(label: str, values: list[float], base: list[float] | None = None) -> list[str]:
    if not values:
        return [label, "0", "-", "-", "-", ""]
    ms = [v * 1000 for v in values]
    ratio = ""
    if base:
        ratio = f"{quantile(values, 0.5) / quantile(base, 0.5):.2f}x / {quantile(values, 0.95) / quantile(base, 0.95):.2f}x"
    return [label, str(len(ms)), f"{quantile(ms, 0.5):.1f}", f"{quantile(ms, 0.95):.1f}",
            f"{max(ms):.1f}", ratio]


def res_rows(before: Resources, after: Resources) -> list[list[str]]:
    rows = []
    for label, key, scale, unit in (("open file descriptors", "fds", 1, ""),
                                    ("asyncio tasks (gpushare_asyncio_tasks)", "tasks", 1, ""),
                                    ("RSS", "rss", MiB, " MiB"), ("threads", "threads", 1, "")):
        b, a = getattr(before, key), getattr(after, key)
        rows.append([label, f"{b / scale:.0f}{unit}", f"{a / scale:.0f}{unit}", f"{a / b:.3f}",
                     f"{(a - b) / scale:+.0f}{unit}"])
    return rows


async def run(args: argparse.Namespace) -> int:
    kernels, rounds = args.kernels, args.rounds
    fits = int((psutil.virtual_memory().available - 2 * GiB) // (KERNEL_HOST_BYTES + 2 * args.mib * MiB))
    notes = []
    if kernels > fits:
        notes.append(f"{kernels} kernels do not fit in this machine's available memory: {fits} started")
        kernels = max(fits, 1)
    print(f"load: {kernels} kernels x {rounds} rounds of release/restore, status at {args.hz:g} Hz "
          f"-- {machine()}", flush=True)
    # idle_timeout: never reached in a run (only the benchmark releases), yet the policy looks
    # at a long idle window as in production; history_seconds: the ring buffers are full
    # before the first measure, so what grows after it is not their filling
    cfg = {"simulated_gpus": [16 * GiB] * GPUS, "poll_interval": POLL_INTERVAL,
           "idle_timeout": 3600.0, "min_release_bytes": 0, "pressure_free_fraction": 0.0,
           "history_seconds": args.history}
    tally = Tally()
    trend: list[list[str]] = []
    poller: StatusPoller | None = None
    async with Server("load", gpushare=cfg) as srv:
        try:
            t0 = time.monotonic()
            ks = await start_kernels(srv, kernels, args.mib, concurrency=4)
            for k in ks:  # a release before the server has seen the bytes would be refused
                await srv.wait_kernel(k.kernel.id, lambda v, n=k.nbytes: v["gpu_memory_bytes"] == n,
                                      f"kernel {k.index} to show its {k.nbytes} bytes")
            print(f"started {len(ks)} kernels, {ks[0].nbytes / MiB:.0f} MiB each, "
                  f"in {time.monotonic() - t0:.0f} s; kernels' RSS {kernels_rss(srv) / GiB:.1f} GiB",
                  flush=True)
            poller = StatusPoller(srv, args.hz, {k.kernel.id for k in ks})
            poller.start()

            warm = Tally()  # the warm-up's figures are not reported, its failures are
            await one_round(srv, ks, 0, args.concurrency, warm)
            await check_shown(srv, ks, 0, 0, warm)
            tally.failures += [f"warm-up: {f}" for f in warm.failures]
            warmup = 1
            for k in ks:
                k.cycles = 0
            before = await settled_resources(srv)
            counters_before = await server_counters(srv)

            server = psutil.Process(srv.pid)
            cpu = process_cpu_seconds(server)
            poller.phase = "idle"
            await asyncio.sleep(args.idle)
            poller.phase = None
            idle_cpu = (process_cpu_seconds(server) - cpu) / args.idle

            print(f"before: {before}; idle baseline done; cycling", flush=True)
            poller.phase = "load"
            t_load, cpu = time.monotonic(), process_cpu_seconds(server)
            for rnd in range(1, rounds + 1):
                t = time.monotonic()
                await one_round(srv, ks, rnd, args.concurrency, tally)
                await check_shown(srv, ks, warmup, rnd, tally)
                r = await resources(srv)
                trend.append([str(rnd), f"{time.monotonic() - t:.1f}", str(r.fds), str(r.tasks),
                              f"{r.rss / MiB:.0f}", str(r.threads), str(len(tally.failures))])
                print(f"round {rnd}: {trend[-1][1]} s, fds {r.fds}, tasks {r.tasks}, "
                      f"RSS {r.rss / MiB:.0f} MiB, threads {r.threads}, failures {len(tally.failures)}",
                      flush=True)
            load_seconds = time.monotonic() - t_load
            load_cpu = (process_cpu_seconds(server) - cpu) / load_seconds
            poller.phase = None

            await asyncio.sleep(args.settle)
            after = await settled_resources(srv)
            counters = await server_counters(srv)
            server_ops = {k: counters.get(k, 0.0) - counters_before.get(k, 0.0)
                          for k in ("releases ok", "releases failed", "restores ok", "restores failed",
                                    "polls count", "polls sum")}
        finally:
            if poller is not None:
                poller.stop()
            await stop_kernels(srv, concurrency=8)

    report(args, len(ks), rounds, before, after, trend, tally, poller, server_ops,
           idle_cpu, load_cpu, load_seconds, notes)
    return 1 if tally.failures or poller.errors else 0


def report(args: argparse.Namespace, kernels: int, rounds: int, before: Resources, after: Resources,
           trend: list[list[str]], tally: Tally, poller: StatusPoller, server_ops: dict[str, float],
           idle_cpu: float, load_cpu: float, load_seconds: float, notes: list[str]) -> None:
    ops = kernels * rounds
    print(f"\n{kernels} kernels x {rounds} rounds ({ops} release/restore cycles, "
          f"{args.mib} MiB each, at most {args.concurrency} at a time) in {load_seconds:.0f} s; "
          f"server CPU {load_cpu * 100:.0f} % of a core under load, {idle_cpu * 100:.1f} % idle "
          "(polled only)\n")
    print("server process, settled: before the cycling (after one warm-up round) and after it")
    print(table(["measure", "before", "after", "after/before", "change"], res_rows(before, after)))
    print("\nper round (under load, not settled)")
    print(table(["round", "s", "fds", "tasks", "RSS MiB", "threads", "failures so far"], trend))
    idle, load = poller.latency["idle"], poller.latency["load"]
    rate = {p: len(poller.latency[p]) / poller.span[p] if poller.span[p] else 0.0 for p in ("idle", "load")}
    print("\nlatency (ms)")
    print(table(["operation", "n", "p50", "p95", "max", "vs idle (p50 / p95)"], [
        lat_row("release (REST)", tally.release),
        lat_row("restore (REST, until resident)", tally.restore),
        lat_row("cell restored by the gate (restore + cell)", tally.gate),
        lat_row(f"status poll, idle baseline ({rate['idle']:.1f}/s)", idle),
        lat_row(f"status poll, during the load ({rate['load']:.1f}/s)", load, idle),
    ]))
    poll_errors = sum(len(v) for v in poller.errors.values())
    polls = server_ops["polls count"]
    print("\noutcomes")
    print(table(["count", "value"], [
        ["releases answered released (REST)", f"{tally.releases_ok} / {ops}"],
        ["restores completed: REST", str(tally.restores_rest)],
        ["restores completed: gate (cell over the websocket)", str(tally.restores_gate)],
        ["restores completed, all", f"{tally.restores_rest + tally.restores_gate} / {ops}"],
        ["restores answered 202 (then followed to resident)", str(tally.accepted_202)],
        ["checksum checks / mismatches", f"{tally.checks} / {tally.mismatches}"],
        ["server counters: releases ok / failed",
         f"{server_ops['releases ok']:.0f} / {server_ops['releases failed']:.0f}"],
        ["server counters: restores ok / failed",
         f"{server_ops['restores ok']:.0f} / {server_ops['restores failed']:.0f}"],
        ["status polls not 200 or not sane", str(poll_errors)],
        ["status polls slower than 250 ms: idle / load",
         f"{sum(v > 0.25 for v in idle)} / {sum(v > 0.25 for v in load)}"],
        ["server polls from before to after (loop + one per operation), mean s",
         f"{polls:.0f}, {server_ops['polls sum'] / polls if polls else 0:.3f}"],
        ["failures", str(len(tally.failures))],
    ]))
    for f in tally.failures:
        print(f"FAILED {f}")
    for phase, errors in poller.errors.items():
        for e in errors[:20]:
            print(f"STATUS POLL ({phase}) {e}")
        if len(errors) > 20:
            print(f"STATUS POLL ({phase}) ... and {len(errors) - 20} more")
    for note in notes:
        print(note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 kernels, 15 rounds (about a minute)")
    ap.add_argument("--kernels", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mib", type=int, default=32, help="simulated GPU state per kernel")
    ap.add_argument("--concurrency", type=int, default=8, help="kernels cycling at once")
    ap.add_argument("--hz", type=float, default=10.0, help="status polls per second")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of the idle poll baseline")
    ap.add_argument("--history", type=float, default=30.0,
                    help="GPUShareApp.history_seconds; 30 fills the ring buffers before the "
                         "first measure (the default 1800 would go on filling during the run)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds before the after-measure")
    ap.add_argument("--smoke", action="store_true",
                    help="2 kernels of 1 MiB, 1 round: the whole path and its checks, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.kernels, args.rounds, args.mib, args.concurrency = 2, 1, 1, 2
        args.idle, args.settle = 1.0, 0.5
    if args.quick:
        args.kernels, args.rounds, args.idle, args.settle = 16, 15, 5.0, 2.0
    for name in ("kernels", "rounds", "mib", "concurrency"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.hz <= 0:
        ap.error("--hz must be > 0")
    try:
        sys.exit(asyncio.run(run(args)))
    except KeyboardInterrupt:  # the server and kernels were stopped on the way out
        print("interrupted: every process the benchmark started is stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
