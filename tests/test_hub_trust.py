"""The hub service on a node whose users do not trust each other: what one user's server
reports is a claim, checked against what the service measures itself (the shared simulated
node, as NVML on a real one), and one slow server costs only its own users.

A real JupyterHub, one simulated GPU of 512 MiB; alice and bob run real servers. mallory,
trudy and sam run a fake server that speaks the real REST contract (tests/fake_server.py)
and says what the test writes: fabricated waiting restores and GPU readings (mallory), a
claimed restore backed by memory it really holds but never uses (trudy), and status answers
that never come while a test runs (sam; the service's request timeout is longer than any
test, so room making that waited for them would never end).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from jupyter_gpushare.server import contract
from jupyter_gpushare.sim.shared import SharedSimNode

from . import fake_server
from .hubharness import Hub, MiB, can_run, start_hub
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

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SERVICE_CONFIG = """
c.GPUShareHub.poll_interval = 1
c.GPUShareHub.pressure_idle_timeout = 2
c.GPUShareHub.over_share_idle_timeout = 1
c.GPUShareHub.min_release_bytes = 0
c.GPUShareHub.claim_grace = 15
c.GPUShareHub.claim_penalty = 600
c.GPUShareHub.read_deadline = 1
c.GPUShareHub.request_timeout = 900
"""
FAKE = Path(__file__).with_name("fake_server.py")
FAKES = ("mallory", "trudy", "sam")


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gt-", dir="/tmp"))
    env = {u: {"GPUSHARE_FAKE": str(directory / f"fake-{u}.json")} for u in FAKES}
    env["trudy"]["GPUSHARE_FAKE_BALLAST_MIB"] = "400"  # a real state's worth of host memory
    hub = start_hub(directory, ["alice", "bob", *FAKES], ["admin"], SERVICE_CONFIG, user_env=env,
                    user_cmd={u: [sys.executable, str(FAKE)] for u in FAKES}, gpus=(512 * MiB,))
    try:
        asyncio.run(_start(hub, "alice", "bob"))
        yield hub
    finally:
        hub.stop()
        if not os.environ.get("GPUSHARE_KEEP_HUB_DIR"):
            shutil.rmtree(directory, ignore_errors=True)


async def _start(hub: Hub, *users: str) -> None:
    await asyncio.gather(*(hub.start_server(u) for u in users))


def uuid(hub: Hub) -> str:
    node = SharedSimNode(hub.node_path)
    try:
        return node.uuid(0)
    finally:
        node.close()


def say(hub: Hub, user: str, **cfg) -> None:
    """What ``user``'s fake server reports from now on (valid by the REST contract)."""
    cfg.setdefault("uuid", uuid(hub))
    contract.validate_response("/status", "GET", 200, fake_server.status(cfg))
    path = hub.dir / f"fake-{user}.json"
    path.with_suffix(".tmp").write_text(json.dumps(cfg))
    path.with_suffix(".tmp").rename(path)


def answers(hub: Hub, user: str) -> list[dict]:
    path = hub.dir / f"fake-{user}.json.answers"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def fake(hub: Hub, user: str, **cfg) -> None:
    say(hub, user, **cfg)
    await hub.start_server(user)


async def seen(hub: Hub, user: str, check, what: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        users = {u["name"]: u for u in (await admin_view(hub))["users"]}
        if user in users and check(users[user]):
            return users[user]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {users.get(user)}")
        await asyncio.sleep(0.2)


async def restore_measured(hub: Hub) -> None:
    """Until the service's own reading of the GPU holds a restored BIG state. A test shuts
    that kernel down only then: one that ends before the service saw its restore land may
    count as room made and not used, pausing its user's claims for the tests after."""
    await until(lambda: admin_view(hub),
                lambda v: v["nodes"][0]["gpus"][0]["memory_used"] >= BIG * MiB,
                "the service's reading of the restored state")


def a_pid_that_does_not_run() -> int:
    pid = 4_194_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


async def test_fabricated_waiting_restores_release_nobody_and_answers_name_nobody(hub):
    bob = await holding_kernel(hub, "bob", BIG, "b")
    bob_pid = (await hub.kernel_status("bob", bob.id))["pids"][0]
    waiting = "waiting for memory: needs 320.0 MiB on GPU 0 (192.0 MiB free)"
    claim = {"need": BIG * MiB, "released": BIG * MiB, "waiting": waiting}
    kernels = [
        {"kid": "m-self", "pids": ["self"], **claim},  # its own process: holds no such state
        {"kid": "m-other", "pids": [bob_pid], **claim},  # bob's kernel process
        {"kid": "m-none", "pids": [a_pid_that_does_not_run()], **claim},
        {"kid": "m-nopid", "pids": [], **claim},
    ]
    try:
        await fake(hub, "mallory", kernels=kernels, push=[k["kid"] for k in kernels], used=BIG * MiB)
        await idle_for(hub, "bob", bob, 1.5)  # over his (absent) share: releasable at once
        m = await seen(hub, "mallory", lambda u: len(u["kernels"]) == 4, "mallory's claims read")
        await asyncio.sleep(6)  # six polls, six pushes of each claim
        assert resident(await hub.kernel_status("bob", bob.id))
        refused = {k["id"]: k["claim_refused"] for k in
                   (await seen(hub, "mallory", lambda u: True, ""))["kernels"]}
        assert refused.pop("m-self").startswith(
            "it needs 320.0 MiB on GPU 0, but its processes hold only "), refused
        assert refused == {
            "m-other": "the processes its server names are not mallory's",
            "m-none": "none of the processes its server names runs on this node",
            "m-nopid": "its server names no process for it",
        }, refused
        assert await hub.metric("gpushare_hub_claims_total", 'outcome="refused"') >= 4
        said = answers(hub, "mallory")
        assert said and all(a["released"] == [] for a in said), said[-1]
        assert said[-1]["waits"]["m-other"].startswith("no room is made for it from other people's kernels")
        assert not any(b in json.dumps(a) for a in said for b in ("bob", bob.id)), said
        assert m["claims_paused_seconds"] == 0
    finally:
        say(hub, "mallory")
        await shut(bob)


async def test_a_fabricated_empty_reading_of_the_gpu_does_not_stop_room_being_made(hub):
    # mallory's server says the GPU is empty, and answers a little after the others: the
    # freshest reading, were the servers' readings trusted
    await fake(hub, "mallory", used=0, delay=0.3)
    await seen(hub, "mallory", lambda u: not u["servers"][0]["error"], "mallory's server read")
    alice = await released_kernel(hub, "alice", BIG, "a")
    bob = await holding_kernel(hub, "bob", BIG, "b")
    try:
        await idle_for(hub, "bob", bob, 1.5)
        out = await alice.run(intact("a"), timeout=60)
        assert "intact" in out["text"] and "waiting for memory" in out["text"]
        await hub.wait_kernel("bob", bob.id, lambda s: s["state"] == "released", "bob released")
        await restore_measured(hub)  # the service's own reading, not mallory's empty one
    finally:
        say(hub, "mallory", delay=0)
        await shut(alice, bob)


async def test_room_made_for_a_claim_that_goes_unused_costs_its_user_not_others(hub):
    bob = await holding_kernel(hub, "bob", BIG, "b")
    claim = {"kid": "t1", "pids": ["self"], "need": BIG * MiB, "released": BIG * MiB,
             "waiting": "waiting for memory: needs 320.0 MiB on GPU 0 (192.0 MiB free)"}
    unused = await hub.metric("gpushare_hub_claims_total", 'outcome="unused"')
    try:
        await idle_for(hub, "bob", bob, 1.5)
        await fake(hub, "trudy", kernels=[claim], push=["t1"])  # backed by 400 MiB it holds
        await hub.wait_kernel("bob", bob.id, lambda s: s["state"] == "released",
                              "room made once for trudy's believed claim")
        t = await seen(hub, "trudy", lambda u: u["claims_paused_seconds"] > 0,
                       "trudy's unused claim noticed after claim_grace", timeout=90)
        assert 590 < t["claims_paused_seconds"] <= 600
        assert await hub.metric("gpushare_hub_claims_total", 'outcome="unused"') == unused + 1
        action = next(r for r in (await admin_view(hub))["recent"] if r["action"] == "claim unused")
        assert action["user"] == "trudy" and action["kernel"] == "t1" and action["bytes"] == BIG * MiB
        await bob.run(intact("b"))  # bob works again, then idles: trudy's claim goes on
        await idle_for(hub, "bob", bob, 1.5)
        await asyncio.sleep(5)
        k = await hub.kernel_status("bob", bob.id)
        assert k["state"] in ("active", "idle") and k["releases"] == 1, k
        said = answers(hub, "trudy")
        served = [a for a in said if a.get("released")]
        assert [a["released"] for a in served] == [[{"what": "another user's idle kernel",
                                                     "bytes": BIG * MiB}]], said
        assert not any(b in json.dumps(a) for a in said for b in ("bob", bob.id)), said
        assert said[-1]["released"] == [] and "was not used" in said[-1]["waits"]["t1"], said[-1]
    finally:
        say(hub, "trudy")
        await shut(bob)


async def test_a_slow_server_does_not_slow_other_users_room_making(hub):
    # sam's server has a kernel on the same GPU, so it is among the servers read before room
    # is made there; it answers once, then never within the test (its next answer takes an
    # hour, the service waits up to 900 s): room making that waited for it would not end, and
    # alice's cell would outlive its bound
    sam_kernel = {"kid": "s1", "pids": ["self"], "state": "idle", "idle": 5.0}
    await fake(hub, "sam", kernels=[sam_kernel])
    await seen(hub, "sam", lambda u: u["kernels"], "sam's status read once", timeout=60)
    say(hub, "sam", kernels=[sam_kernel], delay=3600)
    alice = await released_kernel(hub, "alice", BIG, "a")
    bob = await holding_kernel(hub, "bob", BIG, "b")
    try:
        await idle_for(hub, "bob", bob, 1.5)
        out = await alice.run(intact("a"), timeout=120)
        assert "intact" in out["text"] and "waiting for memory" in out["text"]
        assert (await seen(hub, "sam", lambda u: True, ""))["kernels"]  # still its last word
        await restore_measured(hub)
    finally:
        say(hub, "sam")
        await shut(alice, bob)
        await hub.stop_server("sam")  # its read in flight ends with it, not 900 s later


async def test_room_made_for_an_out_of_memory_claim_that_goes_unused_costs_its_user(hub):
    """mallory's server says, every second, that a cell of its kernel failed to allocate 320
    MiB on the GPU: bob's idle kernel is released once for it; nothing lands on the GPU for
    mallory within claim_grace, so mallory's claims pause, and bob's kernel is not released
    again while mallory goes on saying it."""
    bob = await holding_kernel(hub, "bob", BIG, "b")
    claimer = {"kid": "m9", "pids": ["self"], "state": "idle", "idle": 5.0}
    try:
        await idle_for(hub, "bob", bob, 1.5)
        await fake(hub, "mallory", kernels=[claimer], oom=[{"kernel": "m9", "bytes": BIG * MiB}])
        await hub.wait_kernel("bob", bob.id, lambda s: s["state"] == "released",
                              "room made once for mallory's out-of-memory claim")
        m = await seen(hub, "mallory", lambda u: u["claims_paused_seconds"] > 0,
                       "mallory's unused room noticed after claim_grace", timeout=90)
        assert 590 < m["claims_paused_seconds"] <= 600
        action = next(r for r in (await admin_view(hub))["recent"]
                      if r["action"] == "claim unused" and r["user"] == "mallory")
        assert action["kernel"] == "m9" and action["bytes"] == BIG * MiB, action
        await bob.run(intact("b"))  # bob works again, then idles: mallory's claims go on
        await idle_for(hub, "bob", bob, 1.5)
        await asyncio.sleep(5)
        k = await hub.kernel_status("bob", bob.id)
        assert k["state"] in ("active", "idle") and k["releases"] == 1, k
        said = [a for a in answers(hub, "mallory") if "why_not" in a]
        assert [a["released"] for a in said if a["released"]] == [
            [{"what": "another user's idle kernel", "bytes": BIG * MiB}]], said
        assert "was not used" in said[-1]["why_not"], said[-1]
    finally:
        say(hub, "mallory")
        await shut(bob)
