"""The twin: a short workload played through a real server (real kernels, the simulated node,
cells over the websocket) and through the simulator, with the same settings; the two agree
within the stated tolerances (jupyter_gpushare/simulate/twin.py).

The scenario (tests/twin_scenario.json, 7 kernels on two 40 GiB GPUs, 900 s of trace run 10
times faster): a kernel of two GPUs; a kernel released under memory pressure whose next cell
makes room (an idle kernel released for its restore); a restore ahead of a cell (its person
was active 60 s before it), itself making room; a restore whose GPU stays full that moves onto
the other GPU after restore_move_after.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks import twin as driver
from jupyter_gpushare.simulate import twin
from jupyter_gpushare.simulate.trace import read_trace

SCENARIO = Path(__file__).parent / "twin_scenario.json"
SCALE = 10.0  # the product runs 10x faster than the trace: about 90 s


def said(run: twin.Run, what: str) -> list[str]:
    return [kid for _, kid, line in run.timeline if line.startswith(what)]


async def test_the_product_and_the_simulator_agree_on_a_short_workload(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    workload, node = read_trace(SCENARIO)
    leads = twin.leads_of(json.loads(SCENARIO.read_text()))
    s = twin.TwinSettings(gpus=node["gpus"], gpu_gib=node["gpu_gib"], scale=SCALE)
    product, transfer = await driver.run_product(workload, s, leads, log=lambda *a: None)
    firsts = {c.kernel: c.arrival for c in product.cells if c.index == 0}
    simulated = twin.simulate(twin.with_first_arrivals(workload, firsts), s, transfer, leads)
    comparison = twin.compare(product, simulated)
    text = twin.report(product, simulated, comparison)
    assert comparison.ok, "\n".join(comparison.failures()) + "\n" + text

    # the scenario did what it is for, on both sides
    for run in (product, simulated):
        assert said(run, "released (making room"), f"{run.side}: no make-room\n{text}"
        assert run.kernel("m").placed and len(run.kernel("m").placed) == 2, text
        assert run.kernel("c").restores.get("activity") == 1, f"{run.side}: no restore ahead\n{text}"
        assert run.cell("c", 2) is not None and not run.cell("c", 2).oom, text
    assert product.kernel("a").moves == 1, text
    assert product.cell("a", 2).ran_on != product.cell("a", 1).ran_on, text
    assert all(c.start is not None for c in product.cells), text
    assert not os.environ.get("CUDA_VISIBLE_DEVICES")


def test_the_comparison_names_what_differs():
    """Counts, delay quantiles, OOM cells and placements each have their tolerance; a cell that
    differs is listed with both sides' view of it."""
    def run(side: str, delay: float, gpus: tuple[int, ...], oom: bool = False) -> twin.Run:
        r = twin.Run(side)
        r.cells = [twin.CellRun("k", 0, 10.0, 10.0, 20.0, 10.0, 1, ran_on=gpus),
                   twin.CellRun("k", 1, 40.0, None if oom else 40.0 + delay,
                                None if oom else 50.0 + delay, 10.0, 1, oom=oom, ran_on=gpus)]
        k = r.kernel("k")
        k.placed, k.releases = gpus, 1
        k.restored("cell")
        return r

    same = twin.compare(run("product", 5.0, (0,)), run("simulator", 5.5, (0,)))
    assert same.ok, same.failures()
    late = twin.compare(run("product", 9.0, (0,)), run("simulator", 5.0, (1,), oom=False))
    assert not late.ok
    failures = "\n".join(late.failures())
    assert "delay_max s: product 9.00, simulator 5.00" in failures
    assert "kernels on the same GPUs" in failures
    text = twin.report(run("product", 9.0, (0,)), run("simulator", 5.0, (1,)), late)
    assert "k#1" in text and "delay 9.00 s on GPU 0" in text and "delay 5.00 s on GPU 1" in text
    oom = twin.compare(run("product", 0.0, (0,), oom=True), run("simulator", 0.0, (0,)))
    assert "OOM cells: product 1, simulator 0" in "\n".join(oom.failures())


def test_the_product_options_are_the_settings_at_scale():
    s = twin.TwinSettings(gpus=2, gpu_gib=40, scale=10, byte_scale=1 / 256)
    o = s.product_options()
    assert o["simulated_gpus"] == [160 << 20] * 2
    assert o["poll_interval"] == 0.2 and o["restore_move_after"] == 3.0
    assert o["idle_timeout"] == 60.0 and o["pressure_idle_timeout"] == 12.0
    assert o["context_bytes"] == 2 << 20 and o["release_policy"] == "needs"
    # the device copies the trace's bytes at the trace's rate, at both scales
    assert s.device_rate() == s.rate / 256 * 10
    sim = s.simulator(twin.device_transfer(s))
    assert sim.move_after == 30.0 and sim.poll_interval == 2.0 and sim.gpus == 2


def test_a_transfer_model_is_fitted_to_the_products_moves():
    """The device's copy speed, and the median of what each move took beyond it."""
    s = twin.TwinSettings(rate=4e9)
    model = twin.fit_transfer([(int(4e9), 1.5), (int(8e9), 2.5), (int(4e9), 9.0)],
                              [(int(2e9), 0.5)], s)
    assert abs(model.release_seconds(int(4e9)) - 1.5) < 1e-9  # 0.5 s over the copy; 8 s spike left out
    assert model.restore_overhead == 0.0 and model.restore_bandwidth == s.rate
    assert model.incremental  # the simulated method keeps its host copy


def test_a_release_is_fitted_by_the_bytes_its_copy_moved():
    """The simulated method copies only what changed since the kernel's host copy and says so
    in the release event's detail: the fit reads that, not the bytes freed (a pre-copied
    state released in 0.3 s is 0.3 s of overhead, not a copy faster than the device's)."""
    s = twin.TwinSettings(byte_scale=1 / 256)
    freed = {"action": "released", "bytes": 64 << 20, "seconds": 0.3,
             "detail": "4 arrays; copied 0 B of 64.0 MiB (the rest had a current host copy)"}
    part = dict(freed, detail="4 arrays; copied 16.0 MiB of 64.0 MiB (the rest had ...)")
    whole = dict(freed, detail="4 arrays")
    assert driver.copied_per_gpu(freed, s, 1) == 0
    assert driver.copied_per_gpu(part, s, 2) == (16 << 20) * 256 // 2
    assert driver.copied_per_gpu(whole, s, 1) == (64 << 20) * 256
    model = twin.fit_transfer([(driver.copied_per_gpu(freed, s, 1), 0.3)], [], s)
    assert abs(model.release_overhead - 0.3) < 1e-9


def test_the_simulator_judges_pressure_over_pressure_idle_timeout_as_the_controller_does():
    """A kernel idle past pressure_idle_timeout on a GPU under memory pressure is released,
    though its last GPU use is within idle_timeout: the controller judges quietness for
    pressure and make-room over pressure_idle_timeout (``policy.observed``'s default); the
    simulator judged it over idle_timeout (600 s) and released such kernels 8 minutes late."""
    from jupyter_gpushare.simulate.workload import Cell, KernelWork, Session, Workload

    gib = 1 << 30
    cells = (Cell(10.0, 10.0, 50.0, gpus=1, nbytes=int(9.5 * gib)),)
    w = Workload(1000.0, (KernelWork("a", "u", int(9.5 * gib), (Session(0.0, cells),)),), "t")
    s = twin.TwinSettings(gpus=1, gpu_gib=10)
    run = twin.simulate(w, s, twin.device_transfer(s))
    released = [t for t, kid, what in run.timeline if what.startswith("released (memory pressure")]
    assert released and 20 + 120 <= released[0] <= 20 + 120 + 2 * s.poll_interval, run.timeline


def test_the_simulator_stops_a_restore_ahead_without_room_after_5_s_as_the_server_does():
    """The server stops a restore ahead that finds no room within ``core.ahead.ROOM_WAIT``
    (5 s) and the cell, when it comes, restores as any cell; the simulator kept such a restore
    waiting for ``ahead_grace`` (300 s) and restored it ahead when room came later."""
    from jupyter_gpushare.simulate.workload import Cell, KernelWork, Session, Workload

    gib = 1 << 30
    # a fills the GPU with b: released under pressure at about 140; b grows while its cell
    # runs (200-320, a's room gone), then frees; a's person comes back at 300, its cell at 500
    a = (Cell(10.0, 10.0, 50.0, gpus=1, nbytes=6 * gib), Cell(480.0, 10.0, 50.0, gpus=1, nbytes=6 * gib))
    b = (Cell(20.0, 10.0, 50.0, gpus=1, nbytes=7 * gib // 2),
         Cell(170.0, 120.0, 50.0, gpus=1, nbytes=7 * gib, keeps=gib))
    w = Workload(1000.0, (KernelWork("a", "u", 6 * gib, (Session(0.0, a),)),
                          KernelWork("b", "u", 7 * gib // 2, (Session(0.0, b),))), "t")
    s = twin.TwinSettings(gpus=1, gpu_gib=10, scale=1.0)  # the server's own pace: 5 s
    run = twin.simulate(w, s, twin.device_transfer(s), leads={("a", 1): 200.0})
    lines = [(t, what) for t, kid, what in run.timeline if kid == "a"]
    assert any(what.startswith("released (memory pressure") for _, what in lines), lines
    assert any(what.startswith("activity") for _, what in lines), lines
    assert run.kernel("a").restores == {"cell": 1}, lines
