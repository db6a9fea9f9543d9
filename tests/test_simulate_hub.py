"""The simulator's ``gpushare-hub`` policy: the service's cross-user make-room, by hand.

Runs where the simulator (jupyter_gpushare.simulate) is part of the package."""

from __future__ import annotations

import pytest

from jupyter_gpushare.policy import PolicyConfig

pytest.importorskip("jupyter_gpushare.simulate.engine")
engine = pytest.importorskip("jupyter_gpushare.simulate.engine")
figures = pytest.importorskip("jupyter_gpushare.simulate.figures").figures
hub_policy = pytest.importorskip("jupyter_gpushare.simulate.hub_policy")
policies = pytest.importorskip("jupyter_gpushare.simulate.policies")
transfer = pytest.importorskip("jupyter_gpushare.simulate.transfer")
workload = pytest.importorskip("jupyter_gpushare.simulate.workload")
Simulation, GPUShareHub, GPUShare = engine.Simulation, hub_policy.GPUShareHub, policies.GPUShare
TransferModel, GiB = transfer.TransferModel, workload.GiB
Cell, KernelWork, Session, Workload = workload.Cell, workload.KernelWork, workload.Session, workload.Workload

TINY_TRANSFER = TransferModel("tiny", 0.5, GiB, 0.5, GiB)  # 6 GiB move in 0.5 + 6 = 6.5 s
CFG = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=50)
# as these traces were worked out by hand: releases at idle_timeout, named (the product's
# default release policy is needs)
BY_HAND = {"poll_interval": 0.001, "release_policy": "proactive"}


def tiny() -> Workload:
    a = KernelWork("a", "A", 6 * GiB, (Session(0.0, (Cell(0, 10, 50), Cell(190, 10, 50),
                                                      Cell(150, 10, 50))),))
    # on the GPU (it allocates there) but computing nothing
    b = KernelWork("b", "B", 6 * GiB, (Session(155.0, (Cell(0, 10, 0, gpus=1),)),))
    return Workload(500.0, (a, b), "tiny", ("A", "B"))


def test_the_service_takes_another_users_idle_kernel_by_hand():
    """The tiny trace of the gpushare policy's hand-worked test (one 10 GiB GPU, A and B hold
    6 GiB each, moving 6 GiB takes 6.5 s), with the service across users (its poll every 10 s).

    - 0: A allocates, cell 0-10; 110: A idle 100 s, released (free at 116.5).
    - 155: B allocates, cell 155-165 (not on the GPU: a kernel whose GPU was busy within its
      idle window is never taken, as on one server). 200: A's second cell: 4 GiB free, A's own server has
      nothing to take; the push reaches the service: B was used 35 s ago (< 50): A waits.
    - 215: B idle 50 s; the service's poll at 220 takes it: release 220-226.5, A's restore
      226.5-233, the cell runs 233-243. Delay 33 s (78 s with each server alone: B's own
      idle release at 265).
    - 343: A released (idle 100 s). 393: A's third cell: restore 393-399.5. Delay 6.5 s.
    """
    f = figures(Simulation(tiny(), GPUShareHub(CFG, **BY_HAND), 10 * GiB, 1,
                           TINY_TRANSFER).run())
    assert f["cells"] == 4 and f["cells_delayed"] == 2 and f["oom_failures"] == 0
    assert f["delay_max_s"] == pytest.approx(33.0, abs=0.01)
    assert f["release_reasons"] == {"idle": 2, "making room": 1}
    assert (f["releases"], f["restores"]) == (3, 2)
    alone = figures(Simulation(tiny(), GPUShare(CFG, **BY_HAND), 10 * GiB, 1,
                               TINY_TRANSFER).run())
    assert alone["delay_max_s"] == pytest.approx(78.0, abs=0.01)


def test_a_busy_kernel_of_another_user_is_never_taken():
    # B computes 155-455 (a long cell): A's second cell at 200 waits until B's own end
    a = KernelWork("a", "A", 6 * GiB, (Session(0.0, (Cell(0, 10, 50), Cell(190, 10, 50))),))
    b = KernelWork("b", "B", 6 * GiB, (Session(155.0, (Cell(0, 300, 50),)),), shutdown_at=460.0)
    sim = Simulation(Workload(600.0, (a, b), "busy", ("A", "B")), GPUShareHub(CFG, **BY_HAND),
                     10 * GiB, 1, TINY_TRANSFER).run()
    assert "making room" not in sim.counters.release_reasons
    assert max(r.delay for r in sim.cells) >= 455.0 - 200.0


def test_with_the_service_another_users_placed_need_is_wanted_memory():
    """One 10 GiB GPU. A's kernel holds 5 GiB, idle from 10 s. B's first kernel held 5 GiB
    (what B's next one is expected to need); B's second starts at 100 and allocates 6 GiB at
    300. With the service, A's server counts B's placed need as wanted (free 5 - 5 GiB: under
    pressure) and releases A's idle kernel before B allocates; each server alone, A's server
    sees 5 GiB free, and B's first allocation runs out of memory next to A's idle kernel."""
    cfg = PolicyConfig(idle_timeout=1000, pressure_free_fraction=0.1, pressure_idle_timeout=50)
    a = KernelWork("a", "A", 5 * GiB, (Session(0.0, (Cell(0, 10, 50),)),), shutdown_at=900.0)
    b1 = KernelWork("b1", "B", 5 * GiB, (Session(0.0, (Cell(0, 10, 50),)),), shutdown_at=20.0)
    b2 = KernelWork("b2", "B", 6 * GiB, (Session(100.0, (Cell(200, 10, 50),)),), shutdown_at=900.0)
    w = Workload(1000.0, (a, b1, b2), "placed elsewhere", ("A", "B"))
    settings = {"poll_interval": 1.0, "release_policy": "needs"}
    hub = figures(Simulation(w, GPUShareHub(cfg, **settings), 10 * GiB, 1, TINY_TRANSFER).run())
    assert hub["oom_failures"] == 0
    assert hub["release_reasons"].get("memory pressure") == 1, hub["release_reasons"]
    alone = figures(Simulation(w, GPUShare(cfg, **settings), 10 * GiB, 1, TINY_TRANSFER).run())
    assert alone["oom_failures"] == 1
    assert "memory pressure" not in alone["release_reasons"], alone["release_reasons"]
