"""Which node a new user server lands on: the hub service ranks nodes by the placement rule
(room for the server's kernels, SM load over a window, the user's share), and the spawner hook
turns the ranking into KubeSpawner's node affinity.

A real JupyterHub; two simulated nodes of one 1 GiB GPU each, told apart by the name their
servers report (``JUPYTER_GPUSHARE_NODE``, as a Kubernetes pod learns its node's name):
alice's server on ``gpu-a``, bob's on ``gpu-b``. carol has no server yet: the question is
where hers should go. KubeSpawner builds its pod manifest without a cluster (a kubeconfig that
points nowhere), so the affinity checked is the one it would send.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from jupyter_gpushare.hub.spawner_hook import affinity_terms, steer
from jupyter_gpushare.sim.shared import SharedSimNode

from .hubharness import MiB, can_run, login_page, running_hub
from .scenarios import hold
from .test_hub import admin_view, shut, until

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SERVICE_CONFIG = """
c.GPUShareHub.poll_interval = 0.5
c.GPUShareHub.load_window = 4
c.GPUShareHub.min_release_bytes = 0
"""
KUBECONFIG = """apiVersion: v1
kind: Config
current-context: nowhere
contexts: [{name: nowhere, context: {cluster: nowhere, user: nobody}}]
clusters: [{name: nowhere, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: nobody, user: {token: none}}]
"""


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gn-", dir="/tmp"))  # short: AF_UNIX paths fit
    second = str(directory / "node-b.sqlite")
    SharedSimNode(second, (1024 * MiB,)).close()
    with running_hub(directory, ["alice", "bob", "carol"], ["admin"], SERVICE_CONFIG,
                     ["alice", "bob"],
                     user_env={"alice": {"JUPYTER_GPUSHARE_NODE": "gpu-a"},
                               "bob": {"JUPYTER_GPUSHARE_NODE": "gpu-b",
                                       "JUPYTER_GPUSHARE_SIMULATED_NODE": second}},
                     gpus=(1024 * MiB,)) as running:
        yield running


async def ranking(hub, **body) -> list[dict]:
    code, answer = await hub.service("api/nodes", method="POST", token=await hub.token_for("carol"),
                                     body=body)
    assert code == 200, answer
    return answer["nodes"]


def order(nodes: list[dict]) -> list[str]:
    return [n["node"] for n in nodes]


def kube_spawner(hub, token: str, directory: Path, monkeypatch):
    """KubeSpawner as z2jh runs it, building manifests without a cluster."""
    kubespawner = pytest.importorskip("kubespawner")
    from kubernetes_asyncio.config import kube_config

    config = directory / "kubeconfig"
    config.write_text(KUBECONFIG)
    # read when the module is imported (KUBECONFIG then) and when a spawner loads it (this)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
    spawner = kubespawner.KubeSpawner(_mock=True)
    spawner.api_token = token
    spawner.environment = {"JUPYTER_GPUSHARE_HUB_URL": f"{hub.url}/services/gpushare/"}
    spawner.node_affinity_preferred = [{"weight": 5, "preference": {"matchExpressions": [
        {"key": "admins-own", "operator": "Exists"}]}}]  # an admin's own term survives
    return spawner


async def close_kube_clients() -> None:
    """KubeSpawner's shared API clients close when their task is cancelled, which JupyterHub
    does at its shutdown: here, in this test's loop (left to the loop's end, the task was
    collected during a later test and warned there)."""
    tasks = [t for t in asyncio.all_tasks()
             if getattr(t.get_coro(), "__qualname__", "").endswith("close_client_task")]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_new_server_goes_where_its_kernels_fit_and_kubespawner_is_steered_there(hub, tmp_path,
                                                                                      monkeypatch):
    alice, bob = await hub.kernel("alice"), await hub.kernel("bob")
    try:
        await bob.run(hold(900))  # gpu-b: 124 MiB left
        await alice.run(hold(100))
        nodes = await until(lambda: ranking(hub, memory=512 * MiB),
                            lambda ns: order(ns) == ["gpu-a", "gpu-b"] and not ns[1]["fits"],
                            "gpu-b full, gpu-a with room")
        assert nodes[0]["fits"] and nodes[0]["room"] >= 512 * MiB, nodes

        spawner = kube_spawner(hub, await hub.token_for("carol"), tmp_path, monkeypatch)
        assert await steer(spawner, memory=512 * MiB) == ["gpu-a", "gpu-b"]
        from kubernetes_asyncio.client import ApiClient

        # the pod as KubeSpawner would send it to the API server
        pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
        terms = pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        exprs = [(t["weight"], e["key"], e["operator"], e["values"] if "values" in e else None)
                 for t in terms for e in t["preference"]["matchExpressions"]]
        assert exprs == [(5, "admins-own", "Exists", None),
                         (100, "kubernetes.io/hostname", "In", ["gpu-a"]),
                         (100, "kubernetes.io/hostname", "NotIn", ["gpu-b"])]
        await steer(spawner, memory=512 * MiB)  # a respawn replaces the hook's terms, no pile-up
        assert len(spawner.node_affinity_preferred) == 3

        view = await admin_view(hub)
        assert {n["name"] for n in view["nodes"]} == {"gpu-a", "gpu-b"}
        assert view["spawns"][0]["spawner"] == "KubeSpawner" and view["spawns"][0]["steerable"]
    finally:
        await close_kube_clients()
        await shut(alice, bob)


async def test_among_nodes_with_room_the_least_loaded_wins(hub):
    alice, bob = await hub.kernel("alice"), await hub.kernel("bob")
    try:
        await asyncio.gather(alice.run(hold(100)), bob.run(hold(100)))
        await until(lambda: ranking(hub, memory=256 * MiB), lambda ns: {n["node"] for n in ns if n["fits"]}
                    == {"gpu-a", "gpu-b"}, "both nodes with room")
        burn = alice.send("from jupyter_gpushare.sim import simgpu\nsimgpu.burn(30)")
        nodes = await until(lambda: ranking(hub, memory=256 * MiB), lambda ns: order(ns) == ["gpu-b", "gpu-a"]
                            and ns[1]["load"] >= 50, "gpu-a loaded by alice's cell", timeout=40)
        assert nodes[0]["load"] < 10
        await alice.wait(burn, timeout=60)
    finally:
        await shut(alice, bob)


async def test_a_spawner_that_cannot_be_steered_is_told_apart_and_bad_requests_are_refused(hub):
    class LocalSpawner:  # any spawner without node affinity (LocalProcessSpawner, ...)
        environment = {"JUPYTER_GPUSHARE_HUB_URL": f"{hub.url}/services/gpushare/"}

    await until(lambda: ranking(hub), lambda ns: len(ns) == 2, "both nodes known to the service")
    local = LocalSpawner()
    local.api_token = await hub.token_for("carol")  # type: ignore[attr-defined]
    assert set(await steer(local)) == {"gpu-a", "gpu-b"}
    view = await admin_view(hub)
    assert view["spawns"][0] == {**view["spawns"][0], "spawner": "LocalSpawner", "steerable": False}

    token = await hub.token_for("carol")
    for body in ({"gpus": 0}, {"gpus": True}, {"memory": -1}, {"memory": "8GiB"}, {"who": "bob"},
                 {"steerable": "yes"}, [1]):
        code, answer = await hub.service("api/nodes", method="POST", token=token, body=body, ok=False)
        assert code == 400 and "body must be" in answer["message"], (body, code, answer)
    await asyncio.to_thread(page_says_so, hub)  # (Playwright's sync API wants a thread of its own)
    nowhere = type("S", (), {"api_token": token, "environment": {
        "JUPYTER_GPUSHARE_HUB_URL": "http://127.0.0.1:9/nowhere/"}})()
    assert await steer(nowhere, timeout=1) == []  # the spawn goes on, unsteered


def page_says_so(hub) -> None:
    """The admin page says the last spawner could not be steered, and each GPU's SM load."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.path.exists("/usr/bin/chromium"):
        return  # the JSON above said it; the browser tests need Debian's Chromium
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            page = login_page(browser, hub, "admin")
            page.wait_for_selector("body[data-loaded='true']", timeout=60_000)
            assert "LocalSpawner cannot be steered to a node" in page.locator("#spawns").inner_text()
            lines = page.locator(".gpu .contention").all_inner_texts()
            assert len(lines) == 2 and all(line.startswith("SM load ") for line in lines), lines
        finally:
            browser.close()


def test_affinity_terms_prefer_the_best_quiet_nodes_and_avoid_those_without_room():
    nodes = [{"node": "a", "fits": True, "contended": False}, {"node": "b", "fits": True, "contended": True},
             {"node": "c", "fits": True, "within_share": False}, {"node": "d", "fits": True},
             {"node": "e", "fits": False}, {"node": "f", "fits": False}]
    terms = affinity_terms(nodes)
    assert [(t["weight"], t["preference"]["matchExpressions"][0]["operator"],
             t["preference"]["matchExpressions"][0]["values"]) for t in terms] == [
        (100, "In", ["a"]), (80, "In", ["d"]), (100, "NotIn", ["e", "f"])]
    assert affinity_terms([]) == []
