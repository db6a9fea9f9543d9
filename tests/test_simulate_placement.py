"""The simulator is the product: its defaults are the product's options' defaults, and its
placement, restore targets, rebalance and server placement call the product's placement
rule (jupyter_gpushare.policy.placement) unchanged, by hand on small traces; the baselines
(round-robin, no moves, no rebalance) stay available by name. And the compute limit.

Runs where the simulator (jupyter_gpushare.simulate) is part of the package."""

from __future__ import annotations

import pytest

from jupyter_gpushare.core.options import RestoreOptions
from jupyter_gpushare.node.options import NodeOptions
from jupyter_gpushare.policy import PolicyConfig
from jupyter_gpushare.policy.options import ReleaseOptions

engine = pytest.importorskip("jupyter_gpushare.simulate.engine")
policies = pytest.importorskip("jupyter_gpushare.simulate.policies")
settings = pytest.importorskip("jupyter_gpushare.simulate.settings")
capacity = pytest.importorskip("jupyter_gpushare.simulate.capacity")
cli = pytest.importorskip("jupyter_gpushare.simulate.cli")
report = pytest.importorskip("jupyter_gpushare.simulate.report")
transfer = pytest.importorskip("jupyter_gpushare.simulate.transfer")
workload = pytest.importorskip("jupyter_gpushare.simulate.workload")
Simulation, GPUShare, Settings = engine.Simulation, policies.GPUShare, settings.Settings
GiB = workload.GiB
Cell, KernelWork, Session, Workload = workload.Cell, workload.KernelWork, workload.Session, workload.Workload

TINY_TRANSFER = transfer.TransferModel("tiny", 0.5, GiB, 0.5, GiB)
PROACTIVE = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=50)


def kernel(name: str, user: str, gib: float, start: float, *cells, gpus: int = 1):
    return KernelWork(name, user, int(gib * GiB), (Session(start, tuple(cells)),), gpus=gpus)


def run(w, policy=None, gpus: int = 2, per_node: int | None = None, **kw):
    policy = policy or GPUShare(PolicyConfig(), poll_interval=0.5)
    return Simulation(w, policy, 10 * GiB, per_node or gpus, TINY_TRANSFER, total_gpus=gpus,
                      **kw).run()


def gpus_of(sim) -> dict[str, list[int]]:
    return {k.id: k.gpus for k in sim.kernels}


# -- the product's defaults ---------------------------------------------------------------------

def test_the_defaults_are_the_products_options_defaults():
    s = Settings()
    assert s.release_policy == ReleaseOptions.class_traits()["release_policy"].default_value
    assert s.long_idle == ReleaseOptions.class_traits()["long_idle"].default_value
    restore = RestoreOptions.class_traits()
    assert s.move_after == restore["restore_move_after"].default_value
    assert s.ahead_grace == restore["ahead_grace"].default_value
    assert s.rebalance == restore["rebalance"].default_value
    assert s.rebalance_idle == restore["rebalance_idle"].default_value
    assert s.rebalance_per_hour == restore["rebalance_max_per_hour"].default_value
    assert s.rebalance_before_cell == restore["rebalance_before_cell"].default_value
    assert s.load_window == NodeOptions.class_traits()["load_window"].default_value
    assert (s.placement, s.servers) == ("room", "rule")
    # the command line's defaults are the same settings
    parsed = cli.settings_from(cli.parser().parse_args([]))
    for name in ("release_policy", "long_idle", "move_after", "ahead_grace", "rebalance",
                 "rebalance_idle", "rebalance_per_hour", "rebalance_before_cell", "load_window",
                 "placement", "servers"):
        assert getattr(parsed, name) == getattr(s, name), name
    # and a policy built without arguments is the product too
    p = GPUShare(PolicyConfig())
    assert (p.release_policy, p.move_after, p.rebalance) == (s.release_policy, s.move_after,
                                                            s.rebalance)


def test_the_baselines_stay_available_by_name():
    args = cli.parser().parse_args(["--release-policy", "proactive", "--placement",
                                    "round-robin", "--move-after", "0", "--no-rebalance"])
    s = cli.settings_from(args)
    assert (s.release_policy, s.placement, s.servers, s.move_after, s.rebalance) == (
        "proactive", "round-robin", "round-robin", 0.0, False)


def test_help_is_plain_text_and_every_option_says_what_it_does():
    ap = cli.parser()
    text = ap.format_help()
    assert "``" not in text
    assert "release_policy needs" in text
    assert [a.option_strings for a in ap._actions if not a.help] == []


def test_the_install_hint_suits_the_checkout_it_runs_from():
    hint = report.install_hint()
    assert hint.startswith("pip install -e '") and hint.endswith("[simulate]'")


# -- placement: the product's rule ------------------------------------------------------------

def test_two_kernels_started_back_to_back_before_either_allocates_land_apart():
    """A's two kernels start at 0 and 1 s and allocate at their first cell, at 100 s: the
    first placed counts on GPU 0 (pending) when the second is placed. Round-robin (the
    baseline) puts both on A's GPU."""
    w = Workload(300.0, (kernel("a1", "A", 2, 0.0, Cell(100, 10, 50)),
                         kernel("a2", "A", 2, 1.0, Cell(100, 10, 50))), "back to back", ("A",))
    assert gpus_of(run(w)) == {"a1": [0], "a2": [1]}
    assert gpus_of(run(w, placement="round-robin")) == {"a1": [0], "a2": [0]}


def test_a_server_knows_other_servers_placed_kernels_only_through_the_hub_service_or_daemon():
    """A's kernel is placed at 0 s and allocates at 100 s; B's starts at 50 s (and C's at
    1 s). B's server alone does not know of A's placement (the node's ledger knows
    allocations): both on GPU 0, as the product places them. With the hub service, A's
    server tells the service at its first poll after the placement (0.5 s) and the service
    counts A's kernel from then: B goes to GPU 1, and so does C, a second after A (before
    A's server told the service, at the service's next poll and B's refresh, 40 s, C did not);
    D, placed 0.05 s after A, before A's server polled, does not; with the node daemon, told
    at once, D does too."""
    w = Workload(400.0, (kernel("a", "A", 2, 0.0, Cell(100, 10, 50)),
                         kernel("b", "B", 2, 50.0, Cell(100, 10, 50))), "two servers", ("A", "B"))
    assert gpus_of(run(w)) == {"a": [0], "b": [0]}
    hub = pytest.importorskip("jupyter_gpushare.simulate.hub_policy")
    assert gpus_of(run(w, hub.GPUShareHub(PolicyConfig(), poll_interval=0.5))) == {"a": [0], "b": [1]}
    w = Workload(400.0, (kernel("a", "A", 2, 0.0, Cell(100, 10, 50)),
                         kernel("c", "C", 2, 1.0, Cell(100, 10, 50))), "a second after", ("A", "C"))
    assert gpus_of(run(w, hub.GPUShareHub(PolicyConfig(), poll_interval=0.5))) == {"a": [0], "c": [1]}
    w = Workload(400.0, (kernel("a", "A", 2, 0.0, Cell(100, 10, 50)),
                         kernel("d", "D", 2, 0.05, Cell(100, 10, 50))), "back to back", ("A", "D"))
    sim = run(w, hub.GPUShareHub(PolicyConfig(), poll_interval=0.5))
    assert gpus_of(sim) == {"a": [0], "d": [0]}
    assert 0.05 < sim.policy.read[0] <= 0.5  # A's server told the service at its first poll
    for daemon in (policies.GPUShare(PolicyConfig(), poll_interval=0.5, node_daemon=True),
                   hub.GPUShareHub(PolicyConfig(), poll_interval=0.5, node_daemon=True)):
        assert gpus_of(run(w, daemon)) == {"a": [0], "d": [1]}
    made = settings.POLICIES["gpushare"](cli.settings_from(cli.parser().parse_args(["--node-daemon"])))
    assert made.node_daemon is True


def test_a_server_counts_other_servers_released_states_only_through_the_daemon_or_hub():
    """A's 6 GiB kernel on GPU 0 is released after 100 s idle; A's other kernel (1 GiB)
    computes on GPU 1 throughout. At 300 s B's kernel starts: GPU 0 looks emptier, but A's state comes
    back there. B's server alone counts only its own released states (as the product's placer
    does): GPU 0. Told by the node daemon or the hub service: GPU 1."""
    w = Workload(600.0, (kernel("a", "A", 6, 0.0, Cell(1, 10, 50)),
                         kernel("c", "A", 1, 0.5, Cell(1, 500, 5)),
                         kernel("b", "B", 1, 300.0, Cell(10, 10, 50))), "released", ("A", "B"))
    hub = pytest.importorskip("jupyter_gpushare.simulate.hub_policy")
    made = {"alone": GPUShare(PROACTIVE, poll_interval=0.5, release_policy="proactive"),
            "daemon": GPUShare(PROACTIVE, poll_interval=0.5, release_policy="proactive",
                               node_daemon=True),
            "hub": hub.GPUShareHub(PROACTIVE, poll_interval=0.5, release_policy="proactive")}
    placed = {name: gpus_of(run(w, policy)) for name, policy in made.items()}
    assert {name: (p["a"], p["c"]) for name, p in placed.items()} == dict.fromkeys(made, ([0], [1]))
    assert {name: p["b"] for name, p in placed.items()} == {"alone": [0], "daemon": [1], "hub": [1]}


def test_a_gpu_at_full_sm_with_more_room_loses_to_an_idle_one_with_enough():
    """A computes on GPU 0 at 100 % SM from 0 to 1000 holding 1 GiB; C holds 6 GiB on GPU 1
    (placed there: GPU 0 already had A), idle after 15 s. D starts at 300: GPU 0 has 9 GiB
    of room and 100 % load, GPU 1 has 4 GiB and none: D goes to GPU 1 and runs alone."""
    w = Workload(1200.0, (kernel("a", "A", 1, 0.0, Cell(0, 1000, 100)),
                          kernel("c", "C", 6, 5.0, Cell(0, 10, 50)),
                          kernel("d", "D", 1, 300.0, Cell(0, 100, 80))), "busy", ("A", "C", "D"))
    sim = run(w)
    assert gpus_of(sim) == {"a": [0], "c": [1], "d": [1]}
    d = next(r for r in sim.cells if sim.kernels[r.kernel].id == "d")
    assert d.end - d.start == pytest.approx(100.0)  # alone on its GPU
    rr = run(w, placement="round-robin")  # the baseline: D's turn is GPU 0, shared with A
    d = next(r for r in rr.cells if rr.kernels[r.kernel].id == "d")
    assert d.ran_on == 0 and d.end - d.start > 150.0


def test_a_users_server_lands_on_the_machine_the_rule_ranks_first():
    """Two machines of two GPUs. A computes on GPU 0 from 0 on; B's server starts at 300
    with a kernel of two GPUs: machine 1 has two idle GPUs, machine 0 one. Round-robin
    servers (the baseline) put B on its turn's machine, 0, sharing A's GPU."""
    w = Workload(1200.0, (kernel("a", "A", 1, 0.0, Cell(0, 1000, 100)),
                          kernel("b", "B", 1, 300.0, Cell(0, 100, 60, gpus=2), gpus=2)),
                 "servers", ("A", "B"))
    assert sorted(gpus_of(run(w, gpus=4, per_node=2))["b"]) == [2, 3]
    assert sorted(gpus_of(run(w, gpus=4, per_node=2, servers="round-robin"))["b"]) == [0, 1]


# -- restores and rebalance ---------------------------------------------------------------------

def contended_home(*later: float) -> Workload:
    """Round-robin turns on 2 GPUs: K (user 0) and the trainers T1, T2 (users 2, 4) on GPU 0,
    U1 and U3 on GPU 1. K computes 0-10, then its person comes back at 10 + each of
    ``later``; T1 and T2 compute at 60 % each from 50 on (120 % asked: GPU 0 contended)."""
    k = KernelWork("k", "K", 2 * GiB, (Session(0.0, (Cell(0, 10, 50), *[Cell(g, 10, 50)
                                                                       for g in later])),))
    return Workload(3000.0, (
        k, kernel("u1", "U1", 1, 0.0, Cell(0, 5, 10)),
        kernel("t1", "T1", 1, 50.0, Cell(0, 2900, 60)),
        kernel("u3", "U3", 1, 0.0, Cell(0, 5, 10)),
        kernel("t2", "T2", 1, 50.0, Cell(0, 2900, 60))), "contended",
        ("K", "U1", "T1", "U3", "T2"))


def test_a_restore_whose_home_gpu_is_contended_goes_onto_a_quiet_one():
    """K is released at 110 (idle 100 s, proactive); its cell at 410 finds GPU 0 with room
    but contended (T1 and T2 computing, SMs busy): it restores onto GPU 1 and runs there.
    Without moves (--move-after 0) it restores home."""
    def sim(move_after: float):
        return run(contended_home(400), GPUShare(PROACTIVE, poll_interval=0.5,
                                                 release_policy="proactive",
                                                 move_after=move_after, rebalance=False),
                   placement="round-robin")
    moved = sim(30.0)
    k = moved.kernels[0]
    assert k.gpus == [1] and moved.counters.moves == 1
    assert [r.ran_on for r in moved.cells if r.kernel == 0] == [0, 1]
    stays = sim(0.0)
    assert stays.kernels[0].gpus == [0] and stays.counters.moves == 0


def test_an_idle_kernel_on_a_contended_gpu_is_moved_and_its_next_cell_runs_there():
    """K stays resident (release policy needs, nothing needs its memory). GPU 0 turns
    contended (two kernels computing, SMs busy 90 % of the rebalancer's window) while K's
    person is away: rebalance moves K to GPU 1, and its cell at 2010 runs there. The
    trainers, mid-cell, never move; without rebalance (the baseline) K stays."""
    def sim(rebalance: bool):
        return run(contended_home(2000), GPUShare(PolicyConfig(), poll_interval=0.5,
                                                  rebalance=rebalance),
                   placement="round-robin")
    moved = sim(True)
    assert moved.counters.rebalances == 1 and moved.counters.release_reasons == {"rebalance": 1}
    assert gpus_of(moved) == {"k": [1], "u1": [1], "t1": [0], "u3": [1], "t2": [0]}
    assert [r.ran_on for r in moved.cells if r.kernel == 0] == [0, 1]
    assert all(r.end - r.start == pytest.approx(r.duration) for r in moved.cells
               if r.kernel == 0)
    stays = sim(False)
    assert stays.counters.rebalances == 0 and stays.kernels[0].gpus == [0]


def test_a_heavy_kernel_about_to_share_a_busy_gpu_moves_before_its_cell_with_the_option():
    """K trains 0-10 at 90 % SM on GPU 0, and its person runs the next training 60 s later
    (not away: rebalance alone would not move it), while T's training keeps GPU 0 busy
    from 30 on. With rebalance_before_cell (``--move-before-cell``) K moves to GPU 1 first:
    its cell waits for the move, then runs at full speed there, and T's is not slowed;
    without it (the product's default) both share GPU 0's SMs."""
    w = Workload(3000.0, (
        kernel("k", "K", 2, 0.0, Cell(0, 10, 90), Cell(60, 100, 90)),
        kernel("u", "U", 1, 0.0, Cell(0, 5, 10)),
        kernel("t", "T", 1, 30.0, Cell(0, 2900, 100))), "busy", ("K", "U", "T"))

    def sim(before_cell: bool):
        return run(w, GPUShare(PolicyConfig(), poll_interval=0.5,
                               rebalance_before_cell=before_cell), placement="round-robin")
    moved = sim(True)
    k_cells = [r for r in moved.cells if r.kernel == 0]
    assert [r.ran_on for r in k_cells] == [0, 1] and moved.kernels[0].gpus == [1]
    assert moved.counters.rebalances == 1 and moved.counters.release_reasons == {"rebalance": 1}
    assert k_cells[1].delay > 0  # it waited for the move
    assert k_cells[1].end - k_cells[1].start == pytest.approx(100)
    stays = sim(False)
    k_cells = [r for r in stays.cells if r.kernel == 0]
    assert [r.ran_on for r in k_cells] == [0, 0]  # (rebalance moves it later, once it is idle)
    assert k_cells[1].end - k_cells[1].start > 150  # 190 % asked of GPU 0: both slowed


def test_how_heavy_a_kernel_was_is_what_its_cells_got_as_the_tracker_reads_it():
    """K's first training (90 % SM asked) shares GPU 0 with T's (100 %) all along: it gets
    90 x 100 / 190 % of the GPU, under the 50 % that makes a kernel heavy, so its next cell
    runs where it is, as in the product (whose tracker reads what a process got, not what
    it asked); T alone the first time, K reads 90 % and moves (the test above)."""
    w = Workload(3000.0, (
        kernel("k", "K", 2, 1.0, Cell(0, 10, 90), Cell(60, 100, 90)),
        kernel("u", "U", 1, 0.0, Cell(0, 5, 10)),
        kernel("t", "T", 1, 0.0, Cell(0, 2900, 100))), "shared", ("K", "U", "T"))
    sim = run(w, GPUShare(PolicyConfig(), poll_interval=0.5, rebalance_before_cell=True),
              placement="round-robin")
    k = sim.kernels[0]
    assert k.last_gpu_utilization == 90 and k.last_gpu_share == pytest.approx(90 * 100 / 190)
    assert [r.ran_on for r in sim.cells if r.kernel == 0] == [0, 0]


# -- the compute limit -------------------------------------------------------------------------

def test_the_compute_limit_is_the_peak_sm_demand_of_cells_running_at_once():
    """A asks 60 % from 0 to 100, B 70 % on each of its two GPUs from 50 to 150: 200 %
    while both run (the peak), 140 % for B alone: 2 GPUs."""
    w = Workload(300.0, (kernel("a", "A", 1, 0.0, Cell(0, 100, 60)),
                         kernel("b", "B", 1, 50.0, Cell(0, 100, 70, gpus=2), gpus=2)),
                 "limit", ("A", "B"))
    limit = capacity.compute_limit(w, Settings(gpus=2, gpu_gib=10.0, transfer=TINY_TRANSFER))
    assert limit == {"gpus": 2, "peak_sm_demand_pct": pytest.approx(200.0)}


def test_the_headline_tries_every_count_from_the_compute_limit_below_the_bisections_answer():
    """Whether a count serves is not monotonic (a partly filled last machine can fail where
    fewer GPUs serve), so from the compute limit up every count is tried: the answer is the
    first that serves, and every count tried below it fails."""
    w = Workload(400.0, tuple(kernel(f"k{i}", f"U{i}", 1, 10.0 * i, Cell(0, 100, 90))
                              for i in range(4)), "steps", tuple(f"U{i}" for i in range(4)))
    s = Settings(gpus=2, gpu_gib=10.0, transfer=TINY_TRANSFER)
    limit = capacity.compute_limit(w, s)["gpus"]
    found = capacity.fewest_gpus("gpushare", w, s, from_gpus=limit)
    tried = {p["gpus"]: p["serves"] for p in found["probes"]}
    assert found["gpus"] is not None and found["gpus"] >= limit
    assert all(g in tried for g in range(limit, found["gpus"] + 1)), tried
    assert tried[found["gpus"]] and not any(tried[g] for g in range(limit, found["gpus"]))
