"""Which node a new server of several GPUs lands on: the smallest node its kernels fit, so a
larger one stays for kernels wider than its own (best fit); a server of one GPU goes by the
GPUs alone. A real JupyterHub and its gpushare service; two simulated nodes told apart by the
name their servers report: ``gpu-a`` with three GPUs (alice's server), ``gpu-b`` with two
(bob's). carol asks where hers should go.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from jupyter_gpushare.sim.shared import SharedSimNode

from .hubharness import MiB, can_run, running_hub
from .scenarios import hold
from .test_hub import shut, until
from .test_hub_nodes import SERVICE_CONFIG, order, ranking

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gf-", dir="/tmp"))  # short: AF_UNIX paths fit
    second = str(directory / "node-b.sqlite")
    SharedSimNode(second, (1024 * MiB,) * 2).close()
    with running_hub(directory, ["alice", "bob", "carol"], ["admin"], SERVICE_CONFIG,
                     ["alice", "bob"],
                     user_env={"alice": {"JUPYTER_GPUSHARE_NODE": "gpu-a"},
                               "bob": {"JUPYTER_GPUSHARE_NODE": "gpu-b",
                                       "JUPYTER_GPUSHARE_SIMULATED_NODE": second}},
                     gpus=(1024 * MiB,) * 3) as running:
        yield running


async def test_a_server_of_several_gpus_takes_the_smallest_node_it_fits(hub):
    alice, bob = await hub.kernel("alice"), await hub.kernel("bob")
    try:
        await alice.run(hold(64))
        await bob.run(hold(64))
        nodes = await until(lambda: ranking(hub, gpus=2, memory=256 * MiB),
                            lambda ns: {n["node"] for n in ns} == {"gpu-a", "gpu-b"}
                            and all(n["fits"] for n in ns), "both nodes read, with room")
        assert order(nodes) == ["gpu-b", "gpu-a"], nodes  # two GPUs: the node of two
        assert [n["gpus"] for n in nodes] == [2, 3], nodes
        wide = await ranking(hub, gpus=3, memory=256 * MiB)
        assert order(wide) == ["gpu-a", "gpu-b"] and not wide[1]["fits"], wide  # only a fits
        # where the small node lacks room for them, the larger one
        await bob.run(hold(900, name="y"))
        nodes = await until(lambda: ranking(hub, gpus=2, memory=256 * MiB),
                            lambda ns: order(ns) == ["gpu-a", "gpu-b"], "gpu-b short of room")
        assert nodes[0]["fits"] and not nodes[1]["fits"], nodes
    finally:
        await shut(alice, bob)
