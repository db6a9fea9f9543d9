"""The simulator makes room after a cell ran out of memory as the product's server does
(``core.oom_room`` through the pure rule ``policy.oom.plan``): the failing kernel's server
releases its own idle kernels there, and the person's next cell fits. By hand on a small
trace that differs without it.

Runs where the simulator (jupyter_gpushare.simulate) is part of the package."""

from __future__ import annotations

import pytest

from jupyter_gpushare.policy import PolicyConfig

engine = pytest.importorskip("jupyter_gpushare.simulate.engine")
policies = pytest.importorskip("jupyter_gpushare.simulate.policies")
transfer = pytest.importorskip("jupyter_gpushare.simulate.transfer")
workload = pytest.importorskip("jupyter_gpushare.simulate.workload")
GiB = workload.GiB
Cell, KernelWork, Session, Workload = workload.Cell, workload.KernelWork, workload.Session, workload.Workload

TINY_TRANSFER = transfer.TransferModel("tiny", 0.5, GiB, 0.5, GiB)  # 7 GiB release in 7.5 s
NEEDS = PolicyConfig(idle_timeout=600, pressure_free_fraction=0.1, pressure_idle_timeout=50)


def run(on_oom: bool) -> tuple:
    """One GPU of 10 GiB, one user. ``a`` and ``b`` are placed at 0, each expected to need
    only a context (no history yet); ``a`` allocates 7 GiB at 5 and idles (3 GiB free: no
    pressure); ``b`` allocates 5 GiB at its first cell at 200 (out of memory) and tries its
    next cell 50 s later."""
    a = KernelWork("a", "U", 7 * GiB, (Session(0.0, (Cell(5, 10, 50),)),))
    b = KernelWork("b", "U", 5 * GiB, (Session(0.0, (Cell(200, 10, 50), Cell(50, 10, 50))),))
    policy = policies.GPUShare(NEEDS, poll_interval=0.5, rebalance=False)
    if not on_oom:  # the product before: the agent did not ask, the server did nothing
        policy.on_out_of_memory = lambda sim, k, nbytes: None
    released: list = []

    def seen(t, k, what, data) -> None:
        if what == "released":
            released.append((round(t), k.work.kernel_id, str(data["reason"])))

    sim = engine.Simulation(Workload(1000.0, (a, b), "oom", ("U",)), policy, 10 * GiB, 1,
                            TINY_TRANSFER, observer=seen)
    sim.run()
    ran = [(c.kernel, round(c.start)) for c in sim.cells]
    return sim.counters.oom_failures, released, ran


def test_a_cell_out_of_memory_has_its_servers_idle_kernels_make_room_for_the_next_try():
    failures, released, ran = run(on_oom=True)
    assert failures == 1
    assert len(released) == 1 and released[0][:2] == (208, "a")  # its copy took 7.5 s
    assert released[0][2].startswith("making room: kernel ") and "ran out of memory on GPU 0" in released[0][2]
    assert (1, 250) in ran  # b's next cell (50 s after the failed one) ran, on its 5 GiB


def test_without_it_the_next_try_fails_too():
    failures, released, ran = run(on_oom=False)
    assert failures == 2 and released == [] and all(k != 1 for k, _ in ran)


def across_users(policy_class, **options) -> tuple:
    """The same trace with ``a`` another person's (user V): ``b``'s server has no idle kernel
    of its own to release."""
    a = KernelWork("a", "V", 7 * GiB, (Session(0.0, (Cell(5, 10, 50),)),))
    b = KernelWork("b", "U", 5 * GiB, (Session(0.0, (Cell(200, 10, 50), Cell(50, 10, 50))),))
    policy = policy_class(NEEDS, poll_interval=0.5, rebalance=False, **options)
    released: list = []

    def seen(t, k, what, data) -> None:
        if what == "released":
            released.append((round(t), k.work.kernel_id, str(data["reason"])))

    sim = engine.Simulation(Workload(1000.0, (a, b), "oom", ("U", "V")), policy, 10 * GiB, 1,
                            TINY_TRANSFER, observer=seen)
    sim.run()
    ran = [(c.kernel, round(c.start)) for c in sim.cells]
    return sim.counters.oom_failures, released, ran


def test_with_the_hub_service_another_persons_idle_kernel_makes_room_for_the_next_try():
    """``gpushare-hub``: b's server asks the service, which releases a (idle 195 s, past
    pressure_idle_timeout) by the cross-user rule; b's next cell runs."""
    hub_policy = pytest.importorskip("jupyter_gpushare.simulate.hub_policy")
    failures, released, ran = across_users(hub_policy.GPUShareHub)
    assert failures == 1
    assert [r[:2] for r in released] == [(208, "a")]
    assert released[0][2].startswith("making room for u0's cell, which ran out of memory: idle for ")
    assert (1, 250) in ran


def test_without_the_service_another_persons_idle_kernel_is_not_taken():
    failures, released, ran = across_users(policies.GPUShare)
    assert failures == 2 and released == [] and all(k != 1 for k, _ in ran)


def test_with_the_node_daemon_another_persons_server_makes_way_under_memory_pressure():
    """``--node-daemon``: b's server has the room its failed cell asked for counted as wanted
    (``GpuLoad.owe``) and the daemon tells a's server at once, whose pressure rule (3 GiB free
    less 5 GiB wanted) releases a, idle 195 s, at its next poll; b's next cell runs. Before,
    a's server saw 30 % free and kept it."""
    failures, released, ran = across_users(policies.GPUShare, node_daemon=True)
    assert failures == 1
    assert [r[:2] for r in released] == [(208, "a")]  # polled at 200.x, its copy 7.5 s
    assert released[0][2].startswith("memory pressure on GPU 0: idle for "), released
    assert (1, 250) in ran
