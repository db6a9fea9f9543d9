"""The simulator's releases copy only what changed since the kernel's host copy (as the
product's framework and simulated methods do), with the pre-copy of idle kernels
(``precopy_after``), against the named baseline that copies everything; and the cells that
waited for room, which a release elsewhere holds up.

Runs where the simulator (jupyter_gpushare.simulate) is part of the package."""

from __future__ import annotations

import pytest

from jupyter_gpushare.policy import PolicyConfig

engine = pytest.importorskip("jupyter_gpushare.simulate.engine")
policies = pytest.importorskip("jupyter_gpushare.simulate.policies")
capacity = pytest.importorskip("jupyter_gpushare.simulate.capacity")
cli = pytest.importorskip("jupyter_gpushare.simulate.cli")
figures_mod = pytest.importorskip("jupyter_gpushare.simulate.figures")
settings = pytest.importorskip("jupyter_gpushare.simulate.settings")
transfer = pytest.importorskip("jupyter_gpushare.simulate.transfer")
workload = pytest.importorskip("jupyter_gpushare.simulate.workload")
Simulation, GPUShare = engine.Simulation, policies.GPUShare
TransferModel, GiB = transfer.TransferModel, workload.GiB
Cell, KernelWork, Session, Workload = workload.Cell, workload.KernelWork, workload.Session, workload.Workload

# 6 GiB moves in 0.5 + 6 = 6.5 s; a release of nothing left takes the 0.5 s overhead
INCREMENTAL = TransferModel("tiny", 0.5, GiB, 0.5, GiB, incremental=True)
COPIES_ALL = TransferModel("tiny-driver", 0.5, GiB, 0.5, GiB)  # a method that copies everything
CFG = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=20)


def kernel(name: str, user: str, gib: float, start: float, *cells):
    return KernelWork(name, user, int(gib * GiB), (Session(start, tuple(cells)),))


def two_kernels(a_again: float | None = None) -> Workload:
    """One GPU of 10 GiB. B (6 GiB) computes 0-10 and is released idle at 110 (its pre-copy
    ran 70-76: that release copies nothing but in the baseline). A (6 GiB) computes 120-130
    (and again at ``a_again``, 10 s). B's next cell comes at 200: its restore lacks room, so A
    (idle past 20 s, not yet its idle timeout) is released to make room, then B is restored
    (6.5 s)."""
    # A's cells use the GPU (so change all it holds) at 0 % SM: quiet, so make-room may take it
    a_cells = [Cell(0, 10, 0, gpus=1)]
    if a_again is not None:
        a_cells.append(Cell(a_again - 130, 10, 0, gpus=1))
    a = kernel("a", "B", 6, 120.0, *a_cells)  # the same person's: their server makes room
    b = kernel("b", "B", 6, 0.0, Cell(0, 10, 50), Cell(190, 5, 50))
    return Workload(400.0, (b, a), "two kernels, one GPU", ("B",))


def run(w: Workload, model=INCREMENTAL, **kw):
    policy = GPUShare(CFG, release_policy="proactive", rebalance=False, move_after=0)
    sim = Simulation(w, policy, 10 * GiB,
                     1, model, placement="round-robin", **kw).run()
    return sim, figures_mod.figures(sim)


def b_cell(sim):
    return next(r for r in sim.cells if sim.kernels[r.kernel].id == "b" and r.arrival == 200.0)


def test_a_release_after_the_precopy_copies_nothing_so_the_waiting_cell_waits_for_its_restore_only():
    """Baseline (every release copies all): A's release 6.5 s + B's restore 6.5 s = 13.0 s.
    Changed: A sat idle from 130, pre-copied 190-196; its release copies nothing (0.5 s), B
    waits 0.5 + 6.5 = 7.0 s."""
    before, f_before = run(two_kernels(), release_copies="all")
    after, f_after = run(two_kernels())
    assert b_cell(before).delay == pytest.approx(13.0)
    assert b_cell(after).delay == pytest.approx(7.0)
    for sim, f in ((before, f_before), (after, f_after)):
        assert b_cell(sim).waited_for_room
        assert f["room_waits"] == 1  # B's cell; none other found its GPU full
    assert f_before["room_wait_max_s"] == pytest.approx(13.0)
    assert f_after["room_wait_p99_s"] == pytest.approx(7.0)
    # three releases (B at 110, A at 200, B at its idle timeout after its cell) copy 6 GiB
    # each in the baseline; after: nothing (each pre-copied while idle)
    assert f_before["releases"] == f_after["releases"] == 3
    assert f_before["release_gib_copied"] == pytest.approx(18.0)
    assert f_after["release_gib_copied"] == 0
    assert (f_before["release_copies"], f_after["release_copies"]) == ("all", "changed")


def test_what_a_cell_changes_after_the_precopy_is_copied_at_release():
    """A computes again 160-170, after the moment its pre-copy would start: at 200 it has been
    idle 30 s (less than precopy_after), so its release copies all 6 GiB again: B waits
    13.0 s as in the baseline."""
    sim, f = run(two_kernels(a_again=160.0))
    assert b_cell(sim).delay == pytest.approx(13.0)
    assert f["release_gib_copied"] == pytest.approx(6.0)  # A's second release; B's none


def test_a_release_during_the_precopy_copies_what_it_has_not_yet_copied():
    """precopy_after 65: A's pre-copy starts at 195 (idle since 130) and has copied 5 GiB by
    200: the release copies 1 GiB (1.5 s), B waits 1.5 + 6.5 = 8.0 s."""
    sim, _ = run(two_kernels(), precopy_after=65.0)
    assert b_cell(sim).delay == pytest.approx(8.0)


def test_no_precopy_and_a_method_that_copies_all_both_copy_everything():
    """precopy_after 0: no pre-copy; A's release copies what changed since its start, all of
    it. A method that is not incremental (the driver's checkpoint) copies all whatever the
    setting."""
    for sim, _ in (run(two_kernels(), precopy_after=0.0), run(two_kernels(), model=COPIES_ALL)):
        assert b_cell(sim).delay == pytest.approx(13.0)


def test_a_restore_keeps_the_host_copy_so_an_unchanged_kernel_releases_at_once_without_precopy():
    """No pre-copy. C computes 0-10, is released at 110 (copies 6 GiB), restored at 200 for a
    CPU-only cell (eager restores) that changes nothing, and released at its idle timeout
    again: that release copies nothing, what the restore brought back being its host copy."""
    cpu = kernel("c", "C", 6, 0.0, Cell(0, 10, 50), Cell(190, 5, 0, gpus=0))
    w = Workload(400.0, (cpu,), "a CPU cell after a restore", ("C",))
    _, f = run(w, precopy_after=0.0)
    assert (f["releases"], f["restores"]) == (2, 1)
    assert f["release_gib_copied"] == pytest.approx(6.0)
    _, f = run(w, precopy_after=0.0, release_copies="all")
    assert f["release_gib_copied"] == pytest.approx(12.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="release copies"):
        run(two_kernels(), release_copies="some")
    with pytest.raises(ValueError, match="precopy_after"):
        run(two_kernels(), precopy_after=float("nan"))


def test_the_release_table_rows_and_the_cli_options():
    """--release-table: per transfer model, the baseline then the product's; the driver's
    rows equal (it copies everything by its nature); --release-copies all is the baseline."""
    s = settings.Settings(gpus=1, gpu_gib=10.0, transfer=INCREMENTAL, config=CFG,
                          release_policy="proactive", rebalance=False, placement="round-robin",
                          servers="round-robin")
    rows = capacity.release_comparison("gpushare", two_kernels(), s)
    by = {(r["model"], r["release_copies"]): r for r in rows}
    assert [r["model"] for r in rows[:2]] == ["tiny", "tiny"]
    assert by[("tiny", "all")]["room_wait_max_s"] == pytest.approx(13.0)
    assert by[("tiny", "changed")]["room_wait_max_s"] == pytest.approx(7.0)
    drv = (by[("driver", "all")], by[("driver", "changed")])
    assert drv[0]["room_wait_max_s"] == drv[1]["room_wait_max_s"] > 0
    assert drv[0]["release_gib_copied"] == drv[1]["release_gib_copied"] > 0
    args = cli.parser().parse_args(["--release-copies", "all", "--precopy-after", "30"])
    got = cli.settings_from(args)
    assert (got.release_copies, got.precopy_after, got.transfer.incremental) == ("all", 30.0, False)
    assert cli.settings_from(cli.parser().parse_args(["--restore-model", "pinned"])).transfer.incremental
