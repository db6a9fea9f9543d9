"""The simulator's restores that move onto other GPUs (``move_after``, the product's
``restore_move_after``), by hand, and the placement table that compares round-robin and
load-aware placement, each without and with moves.

Runs where the simulator (jupyter_gpushare.simulate) is part of the package."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from jupyter_gpushare.policy import PolicyConfig

engine = pytest.importorskip("jupyter_gpushare.simulate.engine")
policies = pytest.importorskip("jupyter_gpushare.simulate.policies")
hub_policy = pytest.importorskip("jupyter_gpushare.simulate.hub_policy")
settings = pytest.importorskip("jupyter_gpushare.simulate.settings")
transfer = pytest.importorskip("jupyter_gpushare.simulate.transfer")
workload = pytest.importorskip("jupyter_gpushare.simulate.workload")
Simulation, GPUShare, GPUShareHub = engine.Simulation, policies.GPUShare, hub_policy.GPUShareHub
TransferModel, GiB = transfer.TransferModel, workload.GiB
Cell, KernelWork, Session, Workload = workload.Cell, workload.KernelWork, workload.Session, workload.Workload

TINY_TRANSFER = TransferModel("tiny", 0.5, GiB, 0.5, GiB)  # 6 GiB move in 0.5 + 6 = 6.5 s
CFG = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=50)


def kernel(name: str, user: str, gib: float, start: float, *cells, gpus: int = 1):
    return KernelWork(name, user, int(gib * GiB), (Session(start, tuple(cells)),), gpus=gpus)


def by_hand(w, policy, gpus: int, observer=None):
    """A hand-worked run: round-robin placement (each user's turn), a baseline."""
    return Simulation(w, policy, 10 * GiB, gpus, TINY_TRANSFER, observer=observer,
                      placement="round-robin").run()


def baseline(cls=None, config: PolicyConfig | None = None, **kw):
    """gpushare as these traces were worked out by hand: releases at idle_timeout
    (``proactive``) and no rebalance, named (the product's defaults: ``needs``, rebalance)."""
    kw.setdefault("release_policy", "proactive")
    kw.setdefault("rebalance", False)
    return (cls or GPUShare)(config or CFG, **kw)


def one_gpu_full() -> Workload:
    """Two GPUs of 10 GiB. A (GPU 0 by turn) holds 6 GiB; B (GPU 1) 2 GiB, computing the
    whole time; C (GPU 0: user 2 mod 2) starts at 150 with 8 GiB and computes until 550."""
    a = kernel("a", "A", 6, 0.0, Cell(0, 10, 50), Cell(190, 10, 50),
               Cell(50, 10, 50, nbytes=7 * GiB))
    b = kernel("b", "B", 2, 0.0, Cell(0, 790, 50))
    c = kernel("c", "C", 8, 150.0, Cell(0, 400, 50))
    return Workload(800.0, (a, b, c), "one GPU full", ("A", "B", "C"))


@pytest.mark.parametrize("cls", [GPUShare, GPUShareHub])
def test_a_waiting_restore_moves_onto_the_gpu_with_room_after_move_after(cls):
    """- 0-10: A's cell on GPU 0. 110: A idle 100 s, released (done at 116.5).
    - 150: C takes 8 GiB of GPU 0 and computes until 550 (never idle: never taken).
    - 200: A's second cell: GPU 0 has 2 GiB free, A's own server has nothing to release (and
      the hub service nothing idle): it waits for room.
    - 230 (move_after 30 s later): GPU 1 has 8 GiB free: A restores there in 6.5 s and its
      cell runs at 236.5: delay 30 + 6.5 s. A lives on GPU 1 from then on: its third cell
      (296.5) grows it to 7 GiB there, and it is released from there at 406.5 (done at 414)."""
    moved: list[tuple[float, list[int], list[int]]] = []
    held: list[tuple[float, int, int]] = []  # after each change of A's memory: GPU 0, GPU 1

    def watch(t, k, what, data):
        if what == "moved":
            moved.append((t, data["gpus_from"], data["gpus_to"]))
        if what == "memory" and k.id == "a":
            held.append((t, *(g.used for g in k_sim[0].node.gpus)))

    k_sim: list = []
    policy = baseline(cls, poll_interval=0.001, move_after=30.0)
    sim = Simulation(one_gpu_full(), policy, 10 * GiB, 2, TINY_TRANSFER, observer=watch,
                     placement="round-robin")
    k_sim.append(sim)
    sim.run()
    a = sim.kernels[0]
    second, third = [r for r in sim.cells if r.kernel == 0][1:]
    assert second.arrival == pytest.approx(200.0)
    assert second.delay == pytest.approx(30.0 + TINY_TRANSFER.restore_seconds(6 * GiB), abs=0.01)
    assert second.restore_seconds == pytest.approx(6.5)
    assert moved == [(pytest.approx(230.0, abs=0.01), [0], [1])]
    assert a.gpus == [1] and sim.counters.moves == 1
    assert third.delay == 0.0 and a.held == 7 * GiB
    # restored onto GPU 1 (C's 8 GiB on GPU 0), grown there, then released again when idle
    # (B's 2 GiB on GPU 1 from its start at 0, after A's allocation)
    assert held == [(0.0, 6 * GiB, 0), (pytest.approx(116.5, abs=0.01), 0, 2 * GiB),
                    (pytest.approx(230.0, abs=0.01), 8 * GiB, 8 * GiB),
                    (pytest.approx(296.5, abs=0.01), 8 * GiB, 9 * GiB),
                    (pytest.approx(414.0, abs=0.01), 8 * GiB, 2 * GiB)]


def test_without_moves_the_restore_waits_for_room_on_its_own_gpu():
    """move_after 0: A's cell waits until C, idle from 550, is released at 650 (8 GiB: done
    at 658.5), then its 6.5 s restore: it runs at 665 on GPU 0, where A stays."""
    sim = by_hand(one_gpu_full(), baseline(poll_interval=0.001, move_after=0.0), 2)
    second = [r for r in sim.cells if r.kernel == 0][1]
    assert second.start == pytest.approx(665.0, abs=0.01)
    assert sim.kernels[0].gpus == [0] and sim.counters.moves == 0
    assert sim.kernels[0].held == 7 * GiB  # it grew on its own GPU


def test_a_restore_that_finds_room_before_move_after_stays_home():
    """move_after 600: C is released at 650, so A restores on GPU 0 as without moves."""
    sim = by_hand(one_gpu_full(), baseline(poll_interval=0.001, move_after=600.0), 2)
    assert [r for r in sim.cells if r.kernel == 0][1].start == pytest.approx(665.0, abs=0.01)
    assert sim.kernels[0].gpus == [0] and sim.counters.moves == 0


def two_gpu_kernel(third_gib: float, fourth_gib: float, second_full: bool = True) -> Workload:
    """One machine of four 10 GiB GPUs. X (user A, 2 GPUs: 0 and 1) holds 6 GiB on each,
    released at 110. D (GPU 4 mod 4 = 0) and E (GPU 1) start at 150 with 8 GiB (E: 2 GiB
    unless ``second_full``) and compute; B (GPU 2) and C (GPU 3) hold ``third_gib`` and
    ``fourth_gib`` and compute the whole time."""
    x = kernel("x", "A", 6, 0.0, Cell(0, 10, 50, gpus=2), Cell(190, 10, 50, gpus=2), gpus=2)
    b = kernel("b", "B", third_gib, 0.0, Cell(0, 490, 50))
    c = kernel("c", "C", fourth_gib, 0.0, Cell(0, 490, 50))
    d = kernel("d", "D", 8, 150.0, Cell(0, 340, 50))
    e = kernel("e", "E", 8 if second_full else 2, 150.0, Cell(0, 340, 50))
    return Workload(500.0, (x, b, c, d, e), "two-GPU kernel", ("A", "B", "C", "D", "E"))


def test_a_multi_gpu_kernel_moves_all_or_nothing():
    """Both of X's GPUs are full at 200. With one other GPU of room (GPU 2: 8 GiB free, GPU 3:
    2), X's two states have one place to go: X does not move, and its cell is still waiting
    at the trace's end. With room on both (GPU 3: 9 GiB free), at 230 both states move, the
    larger free first (GPU 0's to GPU 3, GPU 1's to GPU 2), restored in parallel: 6.5 s."""
    stuck = by_hand(two_gpu_kernel(2, 8), baseline(poll_interval=0.001), 4)
    x = stuck.kernels[0]
    assert x.gpus == [0, 1] and stuck.counters.moves == 0
    assert x.pending is not None and x.pending.arrival == pytest.approx(200.0)
    assert len([r for r in stuck.cells if r.kernel == 0]) == 1

    moved = by_hand(two_gpu_kernel(2, 1), baseline(poll_interval=0.001), 4)
    x = moved.kernels[0]
    assert x.gpus == [3, 2] and moved.counters.moves == 1
    second = [r for r in moved.cells if r.kernel == 0][1]
    assert second.gpus == 2 and second.delay == pytest.approx(36.5, abs=0.01)
    assert moved.reserved(2) == moved.reserved(3) == 6 * GiB  # released there again when idle


def test_a_multi_gpu_kernel_keeps_its_gpus_that_have_room():
    """As the product's ``move_plan``: only the GPU without room moves (GPU 1 has 8 GiB free
    with E at 2 GiB): X's state on GPU 0 goes to GPU 3, the one on GPU 1 stays."""
    sim = by_hand(two_gpu_kernel(2, 1, second_full=False), baseline(poll_interval=0.001), 4)
    assert sim.kernels[0].gpus == [3, 1] and sim.counters.moves == 1


def test_move_after_must_not_be_negative(capsys):
    from jupyter_gpushare.cli import main

    with pytest.raises(ValueError, match="move_after"):
        GPUShare(CFG, move_after=-1.0)
    with pytest.raises(ValueError, match="move_after"):
        settings.POLICIES["gpushare-hub"](replace(settings.Settings(), move_after=float("nan")))
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--quick", "--no-png", "--move-after", "-5"])
    assert e.value.code == 2
    assert "--move-after -5: seconds, 0 (never move) or more" in capsys.readouterr().err
    assert settings.Settings().move_after == 30.0 == GPUShare(CFG).move_after  # the product's


def test_the_placement_table_has_its_rows_fits_and_is_written(tmp_path, capsys):
    """Round-robin (the baseline) without and with moves, then the product's placement
    without moves, with them, and with rebalance too (the product's defaults), each with its
    fewest GPUs against the compute limit."""
    from jupyter_gpushare.cli import main
    from jupyter_gpushare.simulate.report import placement_table

    args = ["simulate", "--quick", "--policies", "exclusive,gpushare", "--no-capacity",
            "--no-png", "--out", str(tmp_path), "--placement-table", "--move-after", "20",
            "--users-per-gpu", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines())
    assert "placement and restores that move (--placement, --move-after)" in out
    assert "restores move after 20 s" in out
    doc = json.loads((tmp_path / "simulate.json").read_text())
    for trace in doc["traces"]:
        rows = trace["placement_table"]["rows"]
        assert [(r["configuration"], r["placement"], r["move_after_s"], r["rebalance"])
                for r in rows] == [
            ("round-robin", "round-robin", 0.0, False),
            ("round-robin + move 20 s", "round-robin", 20.0, False),
            ("room", "room", 0.0, False), ("room + move 20 s", "room", 20.0, False),
            ("room + move + rebalance", "room", 20.0, True)]
        assert rows[0]["moves"] == rows[2]["moves"] == 0
        assert set(rows[0]["fewest_gpus"]) == {"driver", "pinned"}
        first = max(len(r["configuration"]) for r in rows)
        for r in rows:
            printed = f"{r['configuration']:<{first}}  {r['cell_delay_p99_s']:.2f}"
            assert any(line.startswith(printed) for line in out.splitlines()), printed
        assert trace["reference"]["gpushare"]["move_after_s"] == 20.0
        limit = trace["compute_limit"]
        assert limit["gpus"] >= 1 and f"compute limit: {limit['gpus']} GPUs" in out
        wide = placement_table(rows, wide=True, limit=limit)
        assert "fewest GPUs (driver)" in wide and "moves there" in wide
        assert "x compute limit" in wide


def test_the_worst_cell_says_where_it_waited_and_where_its_restore_moved_it():
    from jupyter_gpushare.simulate.figures import figures
    from jupyter_gpushare.simulate.report import tail_note

    sim = by_hand(one_gpu_full(), baseline(poll_interval=0.001), 2)
    f = figures(sim)
    assert f["moves"] == 1 and f["move_after_s"] == 30.0
    cell = f["worst_cell"]
    assert (cell["kernel"], cell["gpu"], cell["moved_to"]) == ("a", 0, 1)
    assert cell["delay_s"] == pytest.approx(36.5, abs=0.01)
    note = tail_note("gpushare", {"figures": f, "users": 3}, 1.0)
    assert note is not None and ("waited 30 s for room on its GPU, then 6.5 s for its restore "
                                 "onto GPU 1") in note
    stay = figures(by_hand(one_gpu_full(), baseline(poll_interval=0.001, move_after=0), 2))
    assert stay["worst_cell"]["moved_to"] is None and stay["moves"] == 0
