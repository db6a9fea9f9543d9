"""The simulator's side of the twin, played against what the product did in a recorded run of
the multi-GPU example (tests/twin_multigpu_run.json: each kernel's first cell as it came,
the transfer model fitted to the run, where each kernel was placed and every move the
server's rebalancer made). The simulator makes the same moves, of the same kernels onto the
same GPUs, within a poll or a few of the server's, and places every kernel where the server
did. In that run the server moved a 4-GPU kernel at 8014 s, in a window of about 10 s
in which one GPU had reached 90 % of its 600 s window and the GPUs it went to were still
quiet; a simulator that looked every 30 s missed it, and every move after it differed.

Seconds: runs the simulator alone (no server)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import twin as driver
from jupyter_gpushare.simulate import twin
from jupyter_gpushare.simulate.trace import read_trace
from jupyter_gpushare.simulate.transfer import TransferModel

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((Path(__file__).parent / "twin_multigpu_run.json").read_text())
WITHIN = 30.0  # s of trace: a move a few polls from the server's is the same move


def moves_of(run: twin.Run) -> list[tuple[float, str, list[int]]]:
    """(trace s, kernel, its GPUs after the move) of each move the simulator made."""
    return [(t, kid, json.loads(what.removeprefix("moved (").removesuffix(")")))
            for t, kid, what in run.timeline if what.startswith("moved (")]


def test_the_simulator_moves_what_the_products_rebalancer_moved():
    trace = ROOT / RECORD["trace"]
    workload, _ = read_trace(trace)
    workload = driver.window(workload, RECORD["start_hours"] * 3600.0, RECORD["hours"] * 3600.0)
    s = twin.TwinSettings(gpus=RECORD["gpus"], gpu_gib=RECORD["gpu_gib"], scale=RECORD["scale"])
    fitted = RECORD["transfer"]
    transfer = TransferModel("fitted", fitted["release_overhead"], s.rate,
                             fitted["restore_overhead"], s.rate, incremental=True)
    leads = twin.leads_of(json.loads(trace.read_text()))
    sim = twin.simulate(twin.with_first_arrivals(workload, RECORD["first_arrivals"]), s,
                        transfer, leads)

    assert {k: list(v.placed) for k, v in sim.kernels.items()} == RECORD["placed"]
    expected = []
    gpus = {k: list(v) for k, v in RECORD["placed"].items()}
    for t, kid, mapping in RECORD["moves"]:
        gpus[kid] = [mapping.get(str(g), g) for g in gpus[kid]]
        expected.append((t, kid, gpus[kid]))
    # each kernel's moves in turn (one pass may move several: in whichever order)
    made = sorted(moves_of(sim), key=lambda m: (m[1], m[0]))
    expected.sort(key=lambda m: (m[1], m[0]))
    assert [(k, g) for _, k, g in made] == [(k, g) for _, k, g in expected], made
    assert all(abs(a[0] - b[0]) <= WITHIN for a, b in zip(made, expected, strict=True)), made
    figures = sim.figures()
    assert (figures["releases"], figures["restores"], figures["moves"]) == (10, 10, 10)
    assert figures["restores_by_trigger"] == {"rebalance": 10}
