"""The simulator counts what the product counts: room for placement and rebalance is free
memory less what released kernels take back by the product's own count
(node.gpu_load.coming_back), a restore's targets leave out only releases in flight (as the
server's restore room does), a cell computes on a GPU only above ``idle_utilization`` (the
tracker's threshold), and the rebalancer looks at every poll. Each by hand on a small trace
that differs without it.

Runs where the simulator (jupyter_gpushare.simulate) is part of the package."""

from __future__ import annotations

import pytest

from jupyter_gpushare.node.gpu_load import coming_back
from jupyter_gpushare.policy import PolicyConfig

engine = pytest.importorskip("jupyter_gpushare.simulate.engine")
policies = pytest.importorskip("jupyter_gpushare.simulate.policies")
transfer = pytest.importorskip("jupyter_gpushare.simulate.transfer")
workload = pytest.importorskip("jupyter_gpushare.simulate.workload")
Simulation, GPUShare, GiB = engine.Simulation, policies.GPUShare, workload.GiB
Cell, KernelWork, Session, Workload = workload.Cell, workload.KernelWork, workload.Session, workload.Workload

TINY_TRANSFER = transfer.TransferModel("tiny", 0.5, GiB, 0.5, GiB)  # 4 GiB move in 4.5 s
PROACTIVE = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=50)


def kernel(name: str, user: str, gib: float, start: float, *cells):
    return KernelWork(name, user, int(gib * GiB), (Session(start, tuple(cells)),))


def simulation(w, policy):
    """Two GPUs of 10 GiB, each user on their round-robin turn (user i on GPU i mod 2)."""
    return Simulation(w, policy, 10 * GiB, 2, TINY_TRANSFER, placement="round-robin")


def at(sim, times, probe) -> list:
    """``probe(sim)`` at each of ``times`` of the run: what it returned, in order."""
    seen: list = []
    for t in times:
        sim.schedule(t, lambda: seen.append(probe(sim)))
    sim.run()
    return seen


def test_room_is_free_memory_less_what_comes_back_by_the_products_count():
    """A (4 GiB, GPU 1) is released at 110 (idle 100 s), its copy running until 114.5, and
    restored by its cell at 400 (until 404.5). A new kernel's or a move's room on GPU 1, as
    the product's placer and rebalancer count it (coming_back): while the release runs, A's
    bytes are still on the GPU and its held state counts too; released, its state counts;
    while its restore runs, its bytes are allocated and its state does not count again. A
    restore's targets leave out only a release in flight (RestoreRoom.releases_may_take_back)."""
    w = Workload(600.0, (kernel("b", "B", 1, 0.0, Cell(0, 10, 50)),
                         kernel("a", "A", 4, 0.0, Cell(0, 10, 50), Cell(390, 10, 50))),
                 "one release", ("B", "A"))
    sim = simulation(w, GPUShare(PROACTIVE, poll_interval=0.5, release_policy="proactive",
                                 rebalance=False))

    def rooms(s) -> tuple:
        a = s.kernels[1]
        return (a.state, s.views([1])[1].room, s.views([1], taken_back=s.releases_in_flight())[1].room,
                coming_back([a]))

    seen = at(sim, [112.0, 200.0, 402.0, 500.0], rooms)
    assert seen == [
        ("releasing", 2 * GiB, 2 * GiB, {1: 4 * GiB}),
        ("released", 6 * GiB, 10 * GiB, {1: 4 * GiB}),
        ("restoring", 6 * GiB, 6 * GiB, {}),
        ("resident", 6 * GiB, 6 * GiB, {}),
    ]


def test_a_restores_targets_do_not_hold_room_for_other_released_kernels():
    """B (7 GiB, GPU 0) and A (4 GiB, GPU 1) are released at idle; F takes 5 GiB of GPU 0 at
    120 and computes until 1120. B's cell at 400 lacks room at home; after move_after (30 s)
    its restore goes onto GPU 1, 10 GiB free, as the product's restore room counts it (A's
    released state is not held back there). Counted as placement counts (less A's 4 GiB:
    6 GiB), B waited until F was released at 1225."""
    w = Workload(3000.0, (kernel("b", "B", 7, 0.0, Cell(0, 10, 50), Cell(390, 10, 50)),
                          kernel("a", "A", 4, 0.0, Cell(0, 10, 50), Cell(1990, 10, 50)),
                          kernel("f", "F", 5, 120.0, Cell(0, 1000, 10))),
                 "a target with room", ("B", "A", "F"))
    sim = simulation(w, GPUShare(PROACTIVE, poll_interval=0.5, release_policy="proactive",
                                 rebalance=False)).run()
    b_cell = [r for r in sim.cells if sim.kernels[r.kernel].id == "b"][1]
    assert (b_cell.ran_on, b_cell.start) == (1, pytest.approx(430.0 + 7.5))
    assert sim.counters.moves == 1


def contended_for_a_moment(sm: tuple[float, float] = (60.0, 60.0),
                           u_starts: float | None = 405.0):
    """K (user 0, GPU 0) computes 0-10 and comes back at 1000; T1 and T2 (GPU 0) compute
    from 5 on at ``sm`` %; U (GPU 1) computes at 100 % from ``u_starts`` (None: never).
    Over the rebalancer's 600 s window GPU 0 reads 90 % from about 545 s, and GPU 1 stays
    quiet (25 % at most) until about 555 s."""
    u = (Cell(u_starts, 600, 100),) if u_starts is not None else (Cell(0, 5, 1),)
    return Workload(1200.0, (
        kernel("k", "K", 2, 0.0, Cell(0, 10, 1), Cell(990, 10, 50)),
        kernel("u", "U", 1, 0.0, *u),
        kernel("t1", "T1", 1, 5.0, Cell(0, 1000, sm[0])),
        kernel("v", "V", 1, 0.0, Cell(0, 5, 1)),
        kernel("t2", "T2", 1, 5.0, Cell(0, 1000, sm[1]))),
        "contended for a moment", ("K", "U", "T1", "V", "T2"))


def test_the_rebalancer_looks_at_every_poll():
    """GPU 0 is contended and GPU 1 quiet together only from about 545 to 555 s, between two
    passes 30 s apart (540, 570): the product's rebalancer, which runs at every poll (2 s),
    moves K onto GPU 1 then, and its cell at 1000 runs there."""
    sim = simulation(contended_for_a_moment(), GPUShare(PolicyConfig(), poll_interval=2.0)).run()
    assert sim.counters.rebalances == 1
    assert [r.ran_on for r in sim.cells if r.kernel == 0] == [0, 1]


@pytest.mark.parametrize(("idle_utilization", "moved"), [(5.0, False), (3.0, True)])
def test_a_cell_computes_on_its_gpu_only_above_idle_utilization(idle_utilization, moved):
    """T1 computes at 96 % and T2 at 4 % on GPU 0 (busy 100 %): with idle_utilization 5 (the
    product's default) only T1 computes there as the tracker counts it, so GPU 0 is not
    contended (two kernels computing and busy) and K stays; at 3, T2 counts and K moves."""
    policy = GPUShare(PolicyConfig(idle_utilization=idle_utilization), poll_interval=2.0)
    sim = simulation(contended_for_a_moment((96.0, 4.0), u_starts=None), policy).run()
    assert sim.counters.rebalances == int(moved)
    assert sim.kernels[0].gpus == ([1] if moved else [0])


def test_a_restores_targets_leave_room_for_its_servers_other_released_kernels():
    """A's kernels a0 and a1, B's b, placed by room (a0 on GPU 0, b and a1 on GPU 1), all
    released at idle. A restore of a0 judges GPU 1 as the product's RestoreRoom.views does:
    free memory less a1's held state (its server's own released kernel: the room it comes back
    to), not less b's (another server's, which A's server does not know)."""
    w = Workload(600.0, (kernel("a0", "A", 3, 0.0, Cell(0, 10, 50)),
                         kernel("b", "B", 2, 0.0, Cell(0, 10, 50)),
                         kernel("a1", "A", 4, 0.0, Cell(0, 10, 50))),
                 "three releases", ("A", "B"))
    sim = Simulation(w, GPUShare(PROACTIVE, poll_interval=0.5, release_policy="proactive",
                                 rebalance=False), 10 * GiB, 2, TINY_TRANSFER, placement="room")
    policy = sim.policy

    def probe(s) -> tuple:
        a0, b, a1 = s.kernels
        views = policy.restore_views(s, a0)
        return (a0.state, b.state, a1.state, a0.gpus, b.gpus, a1.gpus,
                {g: v.room for g, v in views.items()})

    (seen,) = at(sim, [300.0], probe)
    a0_gpus, b_gpus, a1_gpus = seen[3:6]
    assert seen[:3] == ("released", "released", "released")
    room = seen[6]
    # a1's 4 GiB are held back where it comes back; b's 2 GiB (another server's) are not
    expected = {g: 10 * GiB - (4 * GiB if g in a1_gpus else 0) for g in (0, 1)}
    assert room == expected, (a0_gpus, b_gpus, a1_gpus, room)
