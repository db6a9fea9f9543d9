"""A server tells the hub service of a kernel it placed at once (``POST api/placed``), so a
kernel another user starts seconds later counts it, without waiting for the service's poll.

A real JupyterHub whose service reads the servers every 10 minutes only (so a placement
reaches it by the server's word or not at), one shared simulated node of two 512 MiB GPUs,
servers with placement on. alice's kernel is placed on GPU 0 and allocates nothing: bob's
server cannot see it (nothing is allocated), the service can once alice's server told it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .hubharness import MiB, can_run, running_hub
from .test_hub import admin_view, shut, until
from .test_hub_placement import kernels_of, visible

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SERVICE_CONFIG = """
c.GPUShareHub.poll_interval = 600
c.GPUShareHub.min_release_bytes = 0
"""


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))  # short: AF_UNIX paths fit
    with running_hub(directory, ["alice", "bob"], ["admin"], SERVICE_CONFIG, ["alice", "bob"],
                     server_args=["--GPUShareApp.placement=room"],
                     gpus=(512 * MiB, 512 * MiB)) as hub:
        yield hub


async def test_a_kernel_placed_after_another_users_goes_to_the_other_gpu_without_a_service_poll(hub):
    alice = await hub.kernel("alice")
    assert await visible(alice) == "0"  # both GPUs empty: the first
    # only alice's server's word can have told the service: it polls every 10 minutes
    await until(lambda: admin_view(hub),
                lambda v: any(k.get("id") == alice.id for k in kernels_of(v, "alice")),
                "the service hears of alice's new kernel from her server", timeout=30)
    bob = await hub.kernel("bob")
    assert await visible(bob) == "1"
    log = (hub.dir / "hub.log").read_text(errors="replace")
    assert "with the hub service's view" in "\n".join(
        line for line in log.splitlines() if bob.id in line)
    await shut(alice, bob)


async def test_the_service_refuses_a_bad_placed_request_and_changes_nothing(hub):
    token = await hub.token_for("bob")
    before = await admin_view(hub)
    for body in ({"server": 5}, {"server": "", "kernels": []}, {"server": "x" * 300}, [1]):
        code, answer = await hub.service("api/placed", "POST", token=token, ok=False, body=body)
        assert code == 400, (body, code, answer)
    code, _ = await hub.service("api/placed", "POST", token="not-a-token", ok=False,
                                body={"server": ""})
    assert code in (401, 403), code
    # a server name the caller has no server of: nothing to read, an answer all the same
    code, answer = await hub.service("api/placed", "POST", token=token, body={"server": "other"})
    assert code == 200 and "me" in answer, answer
    after = await admin_view(hub)
    assert [u["name"] for u in after["users"]] == [u["name"] for u in before["users"]]
