"""The simulated GPU's compute, shared as a real GPU's is: processes whose work asks more
than 100 % of a GPU's time in all each run slower in proportion, and the GPU's utilization
reads as NVML's (the share of the period in which any kernel ran).

The ledger's arithmetic is checked at set times on both ledgers (private and shared); the
device's ``compute`` on a private node and, through the agent channel, in a real kernel.
"""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.sim.device import LocalBackend, SimDevice
from jupyter_gpushare.sim.node import GiB, SimNode
from jupyter_gpushare.sim.shared import SharedSimNode


@pytest.fixture(params=["private", "shared"])
def node(request, tmp_path):
    if request.param == "private":
        yield SimNode((GiB, GiB))
        return
    shared = SharedSimNode(tmp_path / "node.sqlite", (GiB, GiB))
    yield shared
    shared.close()


def test_shares_over_100_percent_slow_each_process_and_read_as_a_full_gpu(node):
    t = clock.now() - 20.0
    node.busy_begin(1, 0, at=t, sm=60)
    node.busy_begin(2, 0, at=t, sm=90)  # 150 % asked: each runs at 100 / 150
    node.busy_end(2, 0, at=t + 6)  # then 1 runs alone at its 60 %
    node.busy_begin(3, 1, at=t, sm=30)
    node.busy_begin(4, 1, at=t, sm=40)
    assert node.busy_fraction(None, 0, t, t + 10) == pytest.approx((6 * 1.0 + 4 * 0.6) / 10)
    # each gets its share of the GPU's time: 60 / 150 and 90 / 150 of the first 6 s
    assert node.busy_fraction(1, 0, t, t + 6) == pytest.approx(0.4)
    assert node.busy_fraction(2, 0, t, t + 6) == pytest.approx(0.6)
    work, speed = node.busy_work(1, 0, until=t + 10)
    assert work == pytest.approx(6 / 1.5 + 4) and speed == 1.0
    # under 100 % in all: nobody slows, the GPU reads the sum (NVML: some kernel ran)
    assert node.busy_fraction(None, 1, t, t + 10) == pytest.approx(0.7)
    assert node.busy_work(3, 1, until=t + 10) == pytest.approx((10.0, 1.0))
    node.busy_begin(5, 1, at=t + 10, sm=80)  # now 150 %
    assert node.busy_work(3, 1, until=t + 13) == pytest.approx((10 + 3 / 1.5, 1 / 1.5))
    assert node.busy_work(9, 1) == (0.0, 1.0)  # not busy there


def test_a_busy_span_without_a_share_takes_the_whole_gpu(node):
    t = clock.now() - 10.0
    node.busy_begin(1, 0, at=t)
    node.busy_begin(2, 0, at=t + 5, sm=50)
    assert node.busy_work(2, 0, until=t + 8) == pytest.approx((3 / 1.5, 1 / 1.5))
    assert node.busy_fraction(None, 0, t, t + 10) == 1.0


@pytest.mark.parametrize("sm", [0, -5, 100.5, float("nan"), "50", True, None])
def test_a_share_that_is_not_a_percentage_is_refused_and_changes_nothing(node, sm):
    with pytest.raises(ValueError, match="sm must be a number of % > 0 and <= 100"):
        node.busy_begin(1, 0, sm=sm)
    assert node.busy_work(1, 0) == (0.0, 1.0)


def test_a_ledger_made_before_shares_reads_its_spans_as_whole(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('node_id', '0123456789abcdef0123456789abcdef'), "
        "('capacities', '[1073741824]');"
        "CREATE TABLE busy (pid INTEGER NOT NULL, gpu INTEGER NOT NULL, start REAL NOT NULL, "
        "stop REAL);")
    t = clock.now() - 10.0
    db.execute("INSERT INTO busy VALUES (1, 0, ?, ?)", (t, t + 5))
    db.commit()
    db.close()
    node = SharedSimNode(path)
    assert node.busy_fraction(None, 0, t, t + 10) == pytest.approx(0.5)
    node.busy_begin(2, 0, sm=25)
    assert node.busy_work(2, 0)[1] == 1.0
    node.close()


def test_compute_takes_as_long_as_its_share_of_a_shared_gpu_allows():
    node = SimNode((GiB,))
    other = 999_999  # another process computing at 75 % all along
    node.busy_begin(other, 0, sm=75)
    dev = SimDevice(LocalBackend(node), visible="")
    dev.visible_env = None
    started = time.monotonic()
    dev.compute(0.2, sm=75)  # 150 % asked: it runs at 2/3 speed
    assert time.monotonic() - started >= 0.3 - 1e-3
    me = dev.backend.pid  # type: ignore[attr-defined]
    assert node.busy_work(me, 0) == (0.0, 1.0)  # its span ended with its work
    dev.compute(0.0, sm=50)  # nothing to do: nothing asked
    with pytest.raises(ValueError, match="sm must be"):
        dev.compute(0.1, sm=0)


COMPUTE = """
import json, os, time
from jupyter_gpushare.sim.device import get_device
t0 = time.time()
get_device().compute({seconds}, sm={sm})
print(json.dumps({{"pid": os.getpid(), "t0": t0, "t1": time.time()}}))
"""


async def test_kernels_sharing_a_gpu_through_the_server_slow_each_other(kernels, gpushare_app):
    """Two real kernels: one keeps GPU 0 busy at 75 % (a span it leaves open across cells),
    the other computes 0.4 s at 75 % meanwhile, on the server's node through the agent
    channel: it takes at least 0.6 s, and the GPU reads as fully used while both compute.
    A share that is not a percentage is refused by the server and starts nothing."""
    a, b = await kernels.start(), await kernels.start()
    await a.run("from jupyter_gpushare.sim.device import get_device\n"
                "_span = get_device().busy(0, sm=75)\n_span.__enter__()")
    ex = await b.run(COMPUTE.format(seconds=0.4, sm=75))
    out = json.loads(ex.stdout.strip().splitlines()[-1])
    assert out["t1"] - out["t0"] >= 0.6 - 1e-3
    node = gpushare_app.node
    # at least the 0.6 s its work took at 100 %, the rest at a's 75 % alone
    span = out["t1"] - out["t0"]
    assert node.busy_fraction(None, 0, out["t0"], out["t1"]) >= 0.75 + 0.25 * 0.6 / span - 1e-6
    assert node.busy_work(out["pid"], 0) == (0.0, 1.0)  # its span ended
    await a.run("_span.__exit__(None, None, None)")

    ex = await b.run("from jupyter_gpushare.kernel.agent import get_agent\n"
                     "_c = get_agent().client\n"
                     "_c.notify('busy_begin', gpu=0, sm=500)\n"
                     "_r = _c.request('busy_work', gpu=0)\n"
                     "print(_r['work'], _r['speed'])")
    assert ex.stdout.strip().splitlines()[-1] == "0.0 1.0"
