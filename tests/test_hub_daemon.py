"""The hub service off the GPU nodes (as in Zero to JupyterHub): it measures no node itself and
checks servers' claims against each node's daemon, as safely as on one node.

A real JupyterHub whose service measures nothing (``backend = "off"``), two simulated nodes
(``gpu-a``: the GPU of 512 MiB alice's and bob's real servers use; ``gpu-b``) and a node
daemon for each, listening for the service with a shared secret. alice's and bob's servers
take their restore turns and read free memory from gpu-a's daemon. mallory runs a fake server
(tests/fake_server.py) that says what the test writes, and names node gpu-b while its GPU is
gpu-a's: the service asks gpu-a's daemon about it all the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jupyter_gpushare.demo.hub import free_port
from jupyter_gpushare.hub.daemons import Ask, NodeDaemons
from jupyter_gpushare.node.daemon_service import Unreachable, ask, proof, sealed
from jupyter_gpushare.sim.shared import SharedSimNode

from .hubharness import Hub, MiB, can_run, login_page, start_hub
from .scenarios import intact
from .test_hub import (
    BIG,
    admin_view,
    holding_kernel,
    idle_for,
    released_kernel,
    resident,
    shut,
    until,
)
from .test_hub_trust import FAKE, answers, fake, say, seen

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SECRET = "s3cret-shared-by-the-service-and-the-daemons"
SERVICE_CONFIG = """
c.GPUShareHub.backend = "off"  # the hub pod measures no node
c.GPUShareHub.node_daemons = {daemons!r}
c.GPUShareHub.node_daemon_secret_file = {secret!r}
c.GPUShareHub.node_daemon_timeout = 1
c.GPUShareHub.poll_interval = 1
c.GPUShareHub.pressure_idle_timeout = 2
c.GPUShareHub.min_release_bytes = 0
c.GPUShareHub.read_deadline = 1
"""


class Daemon:
    """One node's daemon, as the DaemonSet runs it (here as this user, on a simulated node)."""

    def __init__(self, directory: Path, node: str, node_path: str, secret: Path):
        self.node, self.port = node, free_port()
        self.socket = str(directory / f"{node}.sock")
        self.log = directory / f"daemon-{node}.log"
        self.args = [sys.executable, "-m", "jupyter_gpushare.node.daemon", "--socket", self.socket,
                     "--backend", "simulated", "--simulated-node", node_path, "--node", node,
                     "--listen", f"127.0.0.1:{self.port}", "--secret-file", str(secret)]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)

    async def answering(self) -> None:
        async def up() -> bool:
            try:
                await ask("127.0.0.1", self.port, SECRET.encode(), self.node, {"op": "measure"})
                return True
            except Unreachable:
                return False
        await until(up, bool, f"the node daemon of {self.node} listening", timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)


@pytest.fixture(scope="module")
def cluster():
    directory = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    secret = directory / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o400)
    node_a = str(directory / "simulated-node.sqlite")  # the harness's own node
    node_b = str(directory / "node-b.sqlite")
    SharedSimNode(node_a, (512 * MiB,)).close()
    SharedSimNode(node_b, (512 * MiB,)).close()
    daemons = {"gpu-a": Daemon(directory, "gpu-a", node_a, secret),
               "gpu-b": Daemon(directory, "gpu-b", node_b, secret)}
    on_a = {"JUPYTER_GPUSHARE_NODE": "gpu-a", "JUPYTER_GPUSHARE_NODE_DAEMON": daemons["gpu-a"].socket}
    env = {"alice": on_a, "bob": on_a,
           "mallory": {"GPUSHARE_FAKE": str(directory / "fake-mallory.json"), "JUPYTER_GPUSHARE_NODE": "gpu-b"}}
    config = SERVICE_CONFIG.format(daemons={n: f"127.0.0.1:{d.port}" for n, d in daemons.items()},
                                   secret=str(secret))
    hub = None
    try:
        for d in daemons.values():
            d.start()
            asyncio.run(d.answering())
        hub = start_hub(directory, ["alice", "bob", "mallory"], ["admin"], config, user_env=env,
                        user_cmd={"mallory": [sys.executable, str(FAKE)]}, gpus=(512 * MiB,))
        asyncio.run(_start(hub))
        yield hub, daemons
    finally:
        if hub is not None:
            hub.stop()
        for d in daemons.values():
            d.stop()
        if not os.environ.get("GPUSHARE_KEEP_HUB_DIR"):
            shutil.rmtree(directory, ignore_errors=True)


async def _start(hub: Hub) -> None:
    await asyncio.gather(hub.start_server("alice"), hub.start_server("bob"))


async def gpu_a(hub: Hub) -> dict:
    """The GPU of gpu-a on the admin page, once a server on it has reported it (the service
    learns of a GPU from the servers' reports, so just after the start it may not list it)."""
    uuid = uuid_of(hub)

    def listed(view: dict) -> list[dict]:
        return [g for n in view["nodes"] for g in n["gpus"] if g["uuid"] == uuid]

    return listed(await until(lambda: admin_view(hub), listed, "gpu-a's GPU listed"))[0]


def uuid_of(hub: Hub) -> str:
    node = SharedSimNode(hub.node_path)
    try:
        return node.uuid(0)
    finally:
        node.close()


async def weaker_while_stopped(hub: Hub, daemon: Daemon, page: bool = False) -> None:
    """With the node's daemon stopped the admin page says its GPU is in the weaker mode, and
    the metric too; started again, its GPU is checked again."""
    daemon.stop()
    try:
        gpu = await until(lambda: gpu_a(hub), lambda g: g["checked_by"] is None, "the weaker mode shown")
        assert gpu["unchecked"].startswith(f"the node daemon of gpu-a (127.0.0.1:{daemon.port}): "
                                           "cannot connect"), gpu["unchecked"]
        # the gauge is set at a poll: the page's word may come first
        await until(lambda: hub.metric("gpushare_hub_gpu_checked", f'uuid="{uuid_of(hub)}"'),
                    lambda n: n == 0, "the metric says gpu-a's GPU is not checked")
        nodes = (await admin_view(hub))["measured"]["daemons"]["nodes"]
        assert next(d for d in nodes if d["node"] == "gpu-a")["error"].startswith("cannot connect")
        if page:
            await asyncio.to_thread(page_says_weaker, hub)  # (Playwright's sync API: a thread of its own)
    finally:
        daemon.start()
        await daemon.answering()
    await until(lambda: gpu_a(hub), lambda g: g["checked_by"] == "the node daemon of gpu-a",
                "checked again once the daemon answers")


def page_says_weaker(hub: Hub) -> None:
    """The admin page, in a browser, says so on the GPU."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.path.exists("/usr/bin/chromium"):
        return  # the JSON said it; the browser tests need Debian's Chromium
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        try:
            page = login_page(browser, hub, "admin")
            page.wait_for_selector("body[data-loaded='true']", timeout=60_000)
            line = page.locator(f".gpu[data-uuid='{uuid_of(hub)}'] .check").inner_text()
            assert line.startswith("weaker mode: servers' claims are taken as they are (the node "
                                   "daemon of gpu-a"), line
        finally:
            browser.close()


async def test_a_fabricated_wait_releases_nobody_and_the_refusal_is_logged_with_its_reason(cluster):
    hub, daemons = cluster
    await until(lambda: gpu_a(hub), lambda g: g["checked_by"] == "the node daemon of gpu-a", "checked")
    bob = await holding_kernel(hub, "bob", BIG, "b")
    bob_pid = (await hub.kernel_status("bob", bob.id))["pids"][0]
    claim = {"need": BIG * MiB, "released": BIG * MiB,
             "waiting": "waiting for memory: needs 320.0 MiB on GPU 0 (192.0 MiB free)"}
    kernels = [{"kid": "m-self", "pids": ["self"], **claim},  # its own process: holds no such state
               {"kid": "m-other", "pids": [bob_pid], **claim}]  # bob's kernel process
    try:
        await idle_for(hub, "bob", bob, 2.5)  # idle past pressure_idle_timeout: releasable
        await fake(hub, "mallory", uuid=uuid_of(hub), kernels=kernels, push=["m-self", "m-other"], used=BIG * MiB)
        await until(lambda: asyncio.sleep(0, answers(hub, "mallory")), lambda a: len(a) >= 2,
                    "mallory's pushes answered")
        assert resident(await hub.kernel_status("bob", bob.id))
        refused = {k["id"]: k["claim_refused"] for k in
                   (await seen(hub, "mallory", lambda u: len(u["kernels"]) == 2, ""))["kernels"]}
        assert refused["m-self"].startswith("it needs 320.0 MiB on GPU 0, but its processes hold only "), refused
        assert refused["m-other"] == "the processes its server names are not mallory's", refused
        # the answers to pushes made before the refusal was decided say nothing of m-other:
        # wait for one made after it (a push a second)
        said = await until(lambda: asyncio.sleep(0, answers(hub, "mallory")),
                           lambda a: "m-other" in a[-1].get("waits", {}), "an answer with the refusal")
        assert all(a["released"] == [] for a in said), said[-1]
        assert said[-1]["waits"]["m-other"].startswith("no room is made for it from other people's kernels")
        log = (hub.dir / "hub.log").read_text(errors="replace")
        assert ("mallory's server claims a waiting restore of kernel m-other; not believed: the "
                "processes its server names are not mallory's") in log
        assert await hub.metric("gpushare_hub_claims_total", 'outcome="refused"') >= 2
        await weaker_while_stopped(hub, daemons["gpu-a"], page=True)
    finally:
        say(hub, "mallory")
        await shut(bob)


async def test_a_gpu_reported_empty_does_not_stop_room_being_made(cluster):
    hub, daemons = cluster
    await fake(hub, "mallory", uuid=uuid_of(hub), used=0, delay=0.3)  # the freshest reading, and false
    alice = await released_kernel(hub, "alice", BIG, "a")
    bob = await holding_kernel(hub, "bob", BIG, "b")
    try:
        await idle_for(hub, "bob", bob, 2.5)
        out = await alice.run(intact("a"), timeout=60)
        assert "intact" in out["text"] and "waiting for memory" in out["text"]
        await hub.wait_kernel("bob", bob.id, lambda s: s["state"] == "released", "bob released")
        # the service's own reading (the daemon's), once a poll has measured alice's state
        gpu = await until(lambda: gpu_a(hub), lambda g: g["memory_used"] >= BIG * MiB,
                          "the daemon's reading of alice's restored state")
        assert gpu["checked_by"] == "the node daemon of gpu-a"
        await weaker_while_stopped(hub, daemons["gpu-a"])
    finally:
        say(hub, "mallory", delay=0)
        await shut(alice, bob)


async def test_bad_input_to_the_daemon_is_refused_and_changes_nothing(cluster):
    hub, daemons = cluster
    d = daemons["gpu-b"]

    async def exchange(*lines: bytes) -> list[dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", d.port)
        out = [json.loads(await reader.readline())]
        for line in lines:
            try:
                writer.write(line)
                got = await reader.readline()
            except ConnectionError:
                break
            if not got:
                break
            out.append(json.loads(got))
        writer.close()
        return out

    # no secret, a wrong one, not JSON: refused before anything is read, and the connection closed
    for first in (b'{"op": "measure"}\n', b"not json\n",
                  json.dumps({"op": "auth", "nonce": "n" * 32, "proof": "0" * 64}).encode() + b"\n"):
        hello, refusal = await exchange(first, b'{"op": "measure"}\n')
        assert hello["op"] == "challenge" and hello["node"] == "gpu-b"
        assert refusal["ok"] is False and ("auth" in refusal["error"] or "proof" in refusal["error"]), refusal
    # proven, then bad JSON and an unsealed request: refused, and the next good request answered
    reader, writer = await asyncio.open_connection("127.0.0.1", d.port)
    nonce = json.loads(await reader.readline())["nonce"]
    mine = "m" * 32
    writer.write(json.dumps({"op": "auth", "nonce": mine, "proof": proof(SECRET.encode(), "service", nonce, mine)}).encode() + b"\n")
    assert json.loads(await reader.readline())["ok"] is True
    key = bytes.fromhex(proof(SECRET.encode(), "session", nonce, mine))
    good = {"op": "measure"}
    for n, bad in enumerate((b"{not json\n", b'{"op": "measure"}\n',
                             json.dumps(sealed(b"wrong key", "request:3", good)).encode() + b"\n",
                             json.dumps(sealed(key, "request:1", good)).encode() + b"\n",  # a replay
                             json.dumps(sealed(key, "request:5", {"op": "measure", "servers": "everyone"})).encode() + b"\n"),
                            start=1):
        writer.write(bad)
        reply = json.loads(await reader.readline())
        assert reply["msg"]["ok"] is False and reply["mac"] == sealed(key, f"reply:{n}", reply["msg"])["mac"], reply
    writer.write(json.dumps(sealed(key, "request:6", good)).encode() + b"\n")
    assert json.loads(await reader.readline())["msg"]["ok"] is True
    writer.close()
    # a service holding another secret is refused and leaves that node in the weaker mode
    wrong = hub.dir / "wrong-secret"
    wrong.write_text("another secret of sixteen bytes or more")
    wrong.chmod(0o400)
    other = NodeDaemons({"gpu-b": f"127.0.0.1:{d.port}"}, str(wrong), 1.0)
    per_server, per_gpu = await other.read([Ask(("x", ""), "gpu-b", {"SIM-x"}, [1])], ["x"])
    assert per_server == {} and per_gpu == {}
    assert other.why_not("SIM-x", "gpu-b").endswith("refused the service: wrong or missing proof of the shared secret")
    # a secret file others may read is refused by the service as by the daemon
    wrong.chmod(0o444)
    assert "others may read it" in NodeDaemons("{node}:1", str(wrong), 1.0).off
