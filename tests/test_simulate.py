"""The trace-driven simulator (issue 11): invariants, a trace worked out by hand, the replay
reader against the shipped example, and the command line."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace

import pytest

from jupyter_gpushare.cli import main
from jupyter_gpushare.policy import PolicyConfig
from jupyter_gpushare.simulate.capacity import run
from jupyter_gpushare.simulate.cli import EXAMPLE
from jupyter_gpushare.simulate.engine import Simulation
from jupyter_gpushare.simulate.figures import figures
from jupyter_gpushare.simulate.generator import generate
from jupyter_gpushare.simulate.policies import Cull, Exclusive, GPUShare
from jupyter_gpushare.simulate.replay import parse_timestamp, read_replay
from jupyter_gpushare.simulate.settings import POLICIES, Settings
from jupyter_gpushare.simulate.transfer import PRESETS, TransferModel
from jupyter_gpushare.simulate.workload import Cell, GiB, KernelWork, Session, Workload, with_users

# a crowded node: 2 GPUs of 40 GiB for 10 users over two days, so that gpushare releases for
# idleness, under pressure and to make room, and restores wait for memory
CROWDED = Settings(gpus=2, gpu_gib=40.0, transfer=PRESETS["sim"],
                   config=PolicyConfig(idle_timeout=300, pressure_idle_timeout=60))


@pytest.fixture(scope="module")
def crowded() -> Workload:
    return generate(10, days=2, seed=3, gpu_gib=CROWDED.gpu_gib)


def simulate(workload: Workload, policy: str, s: Settings = CROWDED, observer=None) -> Simulation:
    sim = Simulation(workload, POLICIES[policy](s), int(s.gpu_gib * GiB), s.gpus, s.transfer,
                     nodes=s.nodes, observer=observer)
    return sim.run()


# -- invariants -------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_gpu_is_ever_over_capacity(crowded, policy):
    seen = []

    def watch(t, k, what, data):
        if what == "memory":
            g = sim_ref[0].node.gpus[k.gpu]
            seen.append(g.used)
            assert 0 <= g.used <= g.capacity, f"GPU {k.gpu} holds {g.used} of {g.capacity} at {t}"

    sim_ref: list[Simulation] = []
    sim = Simulation(crowded, POLICIES[policy](CROWDED), int(CROWDED.gpu_gib * GiB), CROWDED.gpus,
                     CROWDED.transfer, observer=watch)
    sim_ref.append(sim)
    sim.run()
    assert seen, "no allocation happened: the check saw nothing"
    capacity = sim.node.gpus[0].capacity
    assert all(0 < used <= capacity for used in sim.counters.peak_used.values())


def test_the_crowded_node_exercises_releases_and_waiting_restores(crowded):
    sim = simulate(crowded, "gpushare")
    reasons = sim.counters.release_reasons
    assert reasons.get("idle") and reasons.get("memory pressure"), reasons
    assert any(r.delay > r.restore_seconds + 1 for r in sim.cells), "no restore waited for memory"


def test_a_released_kernels_cell_waits_at_least_the_restore(crowded):
    sim = simulate(crowded, "gpushare")
    restored = [r for r in sim.cells if r.restore_seconds > 0]
    assert len(restored) > 10
    model = CROWDED.transfer
    for r in restored:
        nbytes = sim.kernels[r.kernel].nbytes
        assert r.restore_seconds == pytest.approx(model.restore_seconds(nbytes))
        assert r.delay >= r.restore_seconds - 1e-9


def test_culling_never_delays_a_cell_but_loses_work(crowded):
    sim = simulate(crowded, "cull", replace(CROWDED, cull_after=1800))
    f = figures(sim)
    assert f["culls"] > 0 and f["restarts"] > 0
    assert f["work_lost_gpu_hours"] > 0
    assert all(r.delay == 0 for r in sim.cells)
    assert f["releases"] == f["restores"] == 0


@pytest.mark.parametrize("policy", ["exclusive", "static"])
def test_exclusive_and_static_never_delay_nor_lose_work(crowded, policy):
    f = figures(simulate(crowded, policy))
    assert f["cells_delayed"] == 0 and f["cell_delay_p99_s"] == 0
    assert f["work_lost_gpu_hours"] == 0 and f["releases"] == 0
    if policy == "exclusive":
        assert f["oom_failures"] == 0 and f["gpus"] == 10  # one GPU per user


def test_the_same_seed_gives_the_same_figures():
    def once(seed: int) -> dict:
        w = generate(8, days=1, seed=seed, gpu_gib=CROWDED.gpu_gib)
        return run(w, "gpushare", replace(CROWDED, seed=seed), series=True)

    assert once(5) == once(5)
    assert once(5) != once(6)


# -- a trace worked out by hand ------------------------------------------------------------------

def tiny() -> Workload:
    a = KernelWork("a", "A", 6 * GiB, (Session(0.0, (Cell(0, 10, 50), Cell(190, 10, 50),
                                                      Cell(150, 10, 50))),))
    b = KernelWork("b", "B", 6 * GiB, (Session(155.0, (Cell(0, 10, 50),)),))
    return Workload(500.0, (a, b), "tiny", ("A", "B"))


TINY_TRANSFER = TransferModel("tiny", 0.5, GiB, 0.5, GiB)  # 6 GiB move in 0.5 + 6 = 6.5 s


def tiny_run(policy) -> dict:
    sim = Simulation(tiny(), policy, 10 * GiB, 1, TINY_TRANSFER)
    return figures(sim.run())


def test_tiny_trace_gpushare_by_hand():
    """One GPU of 10 GiB; A's kernel and B's hold 6 GiB each; moving 6 GiB takes 6.5 s;
    idle_timeout 100 s, no pressure releases, polls every 1 ms (so a poll is "at once").

    - 0: A allocates 6 GiB (4 free), cell 0-10.  110: A idle 100 s, released; free at 116.5.
    - 155: B allocates 6 GiB, cell 155-165.  200: A's second cell arrives: A is released and
      needs 6 GiB, 4 are free; make_room may only take A's own server's kernels (none): waits.
    - 265: B idle 100 s, released; free at 271.5. A's server sees it at its next poll: restore
      271.5-278.0; the cell runs 278-288. Delay 78.0 s.
    - 388: A released again (free at 394.5). 438: A's third cell (gap 150): 10 GiB free,
      restore 438-444.5, runs 444.5-454.5. Delay 6.5 s.

    Cells' delays [0, 0, 78, 6.5]; p99 over all = 6.5 + 0.97 * (78 - 6.5) = 75.855 s.
    Releases 3, restores 2. Memory held: A 116.5 + 123 + 62 s, B 116.5 s = 418 s x 6 GiB
    -> 418 * 6 / (10 * 500) = 50.16 %. Off the GPU while alive: A 155 + 43.5 s, B 228.5 s =
    427 s x 0.6 GPU -> 0.07117 GPU-h. SM: 4 cells x 10 s x 50 % / 500 s = 4 %.
    """
    cfg = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=50)
    f = tiny_run(GPUShare(cfg, poll_interval=0.001))
    assert f["cells"] == 4 and f["cells_delayed"] == 2 and f["oom_failures"] == 0
    assert f["delay_max_s"] == pytest.approx(78.0, abs=0.01)
    assert f["delay_p50_s"] == pytest.approx((78.0 + 6.5) / 2, abs=0.01)
    assert f["cell_delay_p99_s"] == pytest.approx(75.855, abs=0.01)
    assert (f["releases"], f["restores"]) == (3, 2)
    assert f["mean_allocation_pct"] == pytest.approx(50.16, abs=0.01)
    assert f["reclaimed_gpu_hours"] == pytest.approx(427 * 0.6 / 3600, abs=1e-5)
    assert f["mean_sm_utilization_pct"] == pytest.approx(4.0)


def test_make_room_takes_the_same_users_idle_kernel_by_hand():
    """One user, two kernels of 6 GiB on one 10 GiB GPU; cells that do not use the GPU;
    idle_timeout 100 s, pressure_idle_timeout 50 s, no pressure releases.

    a2 allocates at 0 (cell 0-1), is released at 101 (free at 107.5). a1 allocates at 110
    (cell 110-111). a2's next cell comes at 171: it needs 6 GiB, 4 are free; make_room takes
    a1 (same server, idle 60 s >= 50, quiet): release 171-177.5, then restore a2 177.5-184.
    The cell starts at 184: delay 13 s = one release plus one restore.
    """
    a1 = KernelWork("a1", "A", 6 * GiB, (Session(110.0, (Cell(0, 1, 0),)),))
    a2 = KernelWork("a2", "A", 6 * GiB, (Session(0.0, (Cell(0, 1, 0), Cell(170, 1, 0))),))
    cfg = PolicyConfig(idle_timeout=100, pressure_free_fraction=0, pressure_idle_timeout=50)
    sim = Simulation(Workload(200.0, (a1, a2), "one user"), GPUShare(cfg, poll_interval=0.001),
                     10 * GiB, 1, TINY_TRANSFER).run()
    assert sim.counters.release_reasons == {"idle": 1, "making room": 1}
    assert [round(r.delay, 2) for r in sim.cells] == [0.0, 0.0, 13.0]


def test_tiny_trace_exclusive_and_cull_by_hand():
    """Exclusive: two GPUs, nothing waits; A holds 6 GiB 0-500 s, B 155-500 s:
    (500 + 345) * 6 / (2 * 10 * 500) = 50.7 % allocated.

    Cull after 100 s idle, checked every 40 s: A (idle from 10) is culled at the 120 s tick,
    having run 10 s. B allocates at 155. A's second cell at 200 needs 6 GiB, 4 free: out of
    memory, the cell fails; A's next cell comes 150 s later, at 350. B (idle from 165) is
    culled at 280. At 350 A starts again (10 free) and its 10 s of lost work count; it runs
    350-360 and is culled at the 480 s tick. Culls 3, one restart, 10 s of work lost, no delay.
    """
    f = tiny_run(Exclusive())
    assert f["gpus"] == 2 and f["cells_delayed"] == 0 and f["oom_failures"] == 0
    assert f["mean_allocation_pct"] == pytest.approx(50.7)
    f = tiny_run(Cull(cull_after=100, cull_interval=40))
    assert (f["oom_failures"], f["culls"], f["restarts"], f["cells"]) == (1, 3, 1, 3)
    assert f["work_lost_gpu_hours"] == pytest.approx(10 / 3600)
    assert f["cells_delayed"] == 0


# -- replay ----------------------------------------------------------------------------------------

def test_the_shipped_example_reads_as_exported(tmp_path):
    rep = read_replay(EXAMPLE)
    w = rep.workload
    assert len(w.users) == 6 and rep.node == {"gpus": 2, "gpu_gib": 80}
    for name in w.users:
        with gzip.open(EXAMPLE / f"{name}.history.json.gz", "rt") as f:
            history = json.load(f)
        with gzip.open(EXAMPLE / f"{name}.events.jsonl.gz", "rt") as f:
            events = [json.loads(line) for line in f]
        mine = [k for k in w.kernels if k.user == name]
        assert {k.kernel_id for k in mine} == set(history["kernels"])
        for k in mine:
            moved = [e["bytes"] for e in events if e["kernel_id"] == k.kernel_id and "bytes" in e]
            assert k.gpu_bytes == max(history["kernels"][k.kernel_id]["gpu_memory_bytes"] + moved)
    released = sum(1 for n in w.users for e in _events(n) if e["action"] == "released")
    assert rep.recorded["releases"] == released > 0
    f = run(w, "exclusive", Settings(gpus=2))
    assert f["cells"] > 500 and f["cells_delayed"] == 0


def _events(name: str) -> list[dict]:
    with gzip.open(EXAMPLE / f"{name}.events.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_replay_rebuilds_cells_from_samples_and_restores(tmp_path):
    """Samples every 2 s from t0: a run of two busy samples is one cell of 4 s at their mean SM %;
    a cell that triggered a restore (gate) is a cell at that moment; the kernel holds the most
    it was seen holding or moving (2 GiB in the release event, 1 GiB in the samples)."""
    t0 = 1767571200.0  # 2026-01-05 00:00 UTC
    history = {"now": t0 + 40, "interval": 2.0, "gpus": {}, "kernels": {"k1": {
        "t": [t0 + 2, t0 + 4, t0 + 6, t0 + 8, t0 + 10, t0 + 20, t0 + 30],
        "gpu_memory_bytes": [GiB, GiB, GiB, GiB, 0, 0, GiB],
        "sm_utilization": [0.0, 40.0, 60.0, 0.0, None, None, 0.0],
        "gpu": {"0": [GiB, GiB, GiB, GiB, 0, 0, GiB]}}}}
    (tmp_path / "ann.history.json").write_text(json.dumps(history))
    lines = [
        {"__timestamp__": "2026-01-05T00:00:09+00:00Z", "kernel_id": "k1", "action": "released",
         "bytes": 2 * GiB, "seconds": 1.0, "reason": "idle for 600 s (idle_timeout 600 s)"},
        {"__timestamp__": "2026-01-05T00:00:25.5+00:00Z", "kernel_id": "k1", "action": "restored",
         "bytes": 2 * GiB, "seconds": 0.5, "reason": "gate"},
        {"__timestamp__": "2026-01-05T00:00:26Z", "__schema__": "https://example.org/other",
         "kernel_id": "k1", "action": "released"},
        "not json",
    ]
    (tmp_path / "ann.events.jsonl").write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    rep = read_replay(tmp_path)
    (k,) = rep.workload.kernels
    assert k.user == "ann" and k.gpu_bytes == 2 * GiB
    (session,) = k.sessions
    assert session.start == pytest.approx(0.0)  # memory first seen in the sample at +2 s
    starts, t = [], session.start
    for c in session.cells:
        t += c.gap
        starts.append((round(t, 3), c.duration, c.utilization))
        t += c.duration
    assert starts == [(0.0, 1.0, 0.0), (2.0, 4.0, 50.0), (25.0, 1.0, 0.0)]
    assert rep.recorded["releases"] == 1 and rep.recorded["restores"] == 1
    assert parse_timestamp("2026-01-05T00:00:09+00:00Z") == t0 + 9


# -- the command line ------------------------------------------------------------------------------

def test_quick_run_writes_every_policy_for_both_traces(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short --out, so the last line's path is not what is measured
    assert main(["simulate", "--quick", "--out", "out"]) == 0  # as `jupyter gpushare`
    out = capsys.readouterr().out
    assert "most users per GPU" in out and "goal (" in out
    too_wide = [line for line in out.splitlines() if len(line) > 100]
    assert not too_wide, too_wide
    doc = json.loads((tmp_path / "out" / "simulate.json").read_text())
    assert [t["name"] for t in doc["traces"]] == ["default workload", "example replay"]
    for trace in doc["traces"]:
        assert set(trace["reference"]) == set(POLICIES) == set(trace["capacity"])
        assert trace["capacity"]["exclusive"]["users_per_gpu"] == 1.0
        for f in trace["reference"].values():
            assert len(f["series"]["allocation_pct"]) == len(f["series"]["sm_utilization_pct"]) > 0
    # the example replay's gpushare run keeps p99 within 1 s with a wait of an hour or more:
    # the report says so, with the run's own figures
    replay = doc["traces"][1]
    f = replay["capacity"]["gpushare"]["figures"]
    assert f["cell_delay_p99_s"] <= 1.0 and f["delay_max_s"] > 600
    assert f["worst_cell"]["delay_s"] == f["delay_max_s"]
    words = " ".join(out.split())
    over = f["cells_waited_over_s"]["60"]
    assert (f"p99 {f['cell_delay_p99_s']:.2f} s <= 1 s and 0.0 GPU-h of work lost. The p99 hides a "
            f"tail: the worst wait, {f['delay_max_s']:,.0f} s, was one cell of kernel "
            f"{f['worst_cell']['kernel'][:8]}") in words
    assert f"; {over} of {f['cells']:,} cells (" in words and over >= 1
    assert replay["goal"]["tail"] and replay["goal"]["tail"] in " ".join(out.split())
    pytest.importorskip("matplotlib")
    assert len(list((tmp_path / "out").glob("*.png"))) == 2 * len(POLICIES)


def test_wide_prints_each_table_on_one_line_per_row(tmp_path, capsys):
    args = ["simulate", "--quick", "--no-capacity", "--no-png", "--out", str(tmp_path)]
    assert main(args) == 0
    narrow = capsys.readouterr().out
    assert main([*args, "--wide"]) == 0
    wide = capsys.readouterr().out
    header = "delay p50/p95/p99 s (delayed cells)  p99 all cells s  worst delay s  work lost GPU-h"
    assert header not in narrow and "p99 all  worst" in narrow
    lines = [x for x in wide.splitlines() if header in x]
    assert len(lines) == 2 and all(x.startswith("policy") and len(x) > 100 for x in lines)
    gpushare = [x for x in wide.splitlines() if x.startswith("gpushare ")]
    assert len(gpushare) == 2 and all(len(x) > 100 for x in gpushare)  # both traces, one line each
    assert "Alibaba PAI 2020 (NSDI'22): about half of GPU memory-time is held by jobs that barely " \
           "compute" in wide


# -- the tail the p99 hides -------------------------------------------------------------------------

def tail_trace(duration: float = 500.0) -> Workload:
    """The tiny trace's A and B, whose second cell of A waits for room (78 s, of which 6.5 s
    restore), and C, whose 300 cells never use the GPU nor wait: one cell in 303 waits, so p99
    over all cells is 0 while the worst wait is 78 s. Users in the order C, A, B: the capacity
    search's 3 users are all three."""
    a = KernelWork("a", "A", 6 * GiB, (Session(0.0, (Cell(0, 10, 50), Cell(190, 10, 50))),))
    b = KernelWork("b", "B", 6 * GiB, (Session(155.0, (Cell(0, 10, 50),)),))
    c = KernelWork("c", "C", 0, (Session(0.0, tuple(Cell(1.0, 0.5, 0) for _ in range(300))),))
    return Workload(duration, (c, a, b), "tail", ("C", "A", "B"))


TAIL = Settings(gpus=1, gpu_gib=10.0, transfer=TINY_TRANSFER, poll_interval=0.001,
                config=PolicyConfig(idle_timeout=100, pressure_free_fraction=0,
                                    pressure_idle_timeout=50),
                delay_bound=1.0, max_users_per_gpu=3)


def test_figures_name_the_worst_cell_and_count_the_tail():
    f = run(tail_trace(), "gpushare", TAIL)
    assert f["cells"] == 303 and f["cells_delayed"] == 1 and f["cell_delay_p99_s"] == 0.0
    assert f["delay_max_s"] == pytest.approx(78.0, abs=0.01)
    assert f["cells_waited_over_s"] == {"10": 1, "60": 1, "600": 0, "3600": 0}
    worst = f["worst_cell"]
    assert (worst["kernel"], worst["user"], worst["gpu"], worst["still_waiting_at_end"]) == \
        ("a", "A", 0, False)
    assert worst["arrival_h"] == pytest.approx(200 / 3600)
    assert worst["restore_s"] == pytest.approx(6.5) and worst["delay_s"] == f["delay_max_s"]
    # cut at 250 s, before B is released (265 s): A's cell is still waiting, 50 s after it came
    f = run(tail_trace(250.0), "gpushare", TAIL)
    assert f["worst_cell"]["still_waiting_at_end"] and f["worst_cell"]["kernel"] == "a"
    assert f["delay_max_s"] == pytest.approx(50.0) == f["worst_cell"]["delay_s"]
    assert f["cells_waited_over_s"]["10"] == 1 and f["cells_waited_over_s"]["60"] == 0
    assert figures(simulate(tail_trace(), "exclusive", TAIL))["worst_cell"] is None


def test_the_report_explains_a_tail_the_p99_hides(capsys):
    from jupyter_gpushare.simulate.cli import compare, print_result

    r = compare("tail trace", "hand-made", lambda n: with_users(tail_trace(), n), 3, TAIL,
                ["exclusive", "gpushare"], True, {})
    assert r["capacity"]["gpushare"]["users"] == 3 and r["goal"]["met"]
    print_result(r, TAIL)
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines())
    words = " ".join(out.split())
    assert ("met: gpushare serves 3.00x exclusive's users per GPU with p99 0.00 s <= 1 s and 0.0 "
            "GPU-h of work lost. The p99 hides a tail: the worst wait, 78 s, was one cell of "
            "kernel a (user A) on GPU 0, arriving 0.1 h into the trace, that waited 72 s for room "
            "on its GPU, then 6.5 s for its restore; 1 of 303 cells (0.33 %) waited over 60 s."
            ) in words
    # a tail within ten times the bound is no tail
    r = compare("tail trace", "hand-made", lambda n: with_users(tail_trace(), n), 3,
                replace(TAIL, delay_bound=10.0), ["exclusive", "gpushare"], True, {})
    assert r["capacity"]["gpushare"]["users"] == 3
    assert r["goal"]["tail"] is None and r["tails"] == {"exclusive": None, "gpushare": None}
