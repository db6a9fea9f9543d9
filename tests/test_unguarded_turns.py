"""A restore turn that does not cover every party on the GPU is no turn.

The default lock directory (in this user's Jupyter runtime directory) serializes this user's
servers only. Another process on the GPU (here the test process, on the shared simulated node:
none of this server's kernels) may be another user's kernel, whose restore takes no turn with
ours: the GPU then gets the check of a restore without a turn (room for twice the state), and
the log says why once. No lock directory at all (``node_lock_dir = ""``: turns within this
server) is checked the same way. With a directory set for the machine's servers, the turn covers
them and room for once does.
"""

from __future__ import annotations

import logging
import os

import pytest

from jupyter_gpushare.sim.node import GiB
from jupyter_gpushare.sim.shared import SharedSimNode

from .helpers import kernel_status, wait_for
from .scenarios import hold, intact, rest

MiB = 1 << 20
OTHER = 2 * GiB - 640 * MiB  # another process's bytes on GPU 0: 640 MiB free, room for 384 once


@pytest.fixture(params=["default", "shared", "none"])
def gpushare_config(request, tmp_path):
    node = str(tmp_path / "node.sqlite")
    SharedSimNode(node, (2 * GiB,)).close()
    cfg = {"simulated_node": node, "turnless_restore_after": 0}  # 0: wait for twice, for ever
    if request.param == "shared":
        cfg["node_lock_dir"] = str(tmp_path / "locks")
    elif request.param == "none":  # turns within this server only: covers even less
        cfg["node_lock_dir"] = ""
    return cfg


async def test_a_turn_from_the_default_lock_directory_does_not_cover_other_processes(
    jp_fetch, kernels, gpushare_app, caplog
):
    shared = gpushare_app.node_lock_dir not in ("", gpushare_app.trait_defaults("node_lock_dir"))
    caplog.set_level(logging.WARNING)
    k = await kernels.start()
    await k.run(hold(384, chunk=128))
    await gpushare_app.poll_once()
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    node = SharedSimNode(gpushare_app.simulated_node)
    node.alloc(os.getpid(), 0, OTHER)
    freed = False
    try:
        msg_id = k.send(intact())
        if not shared:
            info = await wait_for(lambda: _waiting(jp_fetch, k.id), timeout=30,
                                  what="status to say the restore waits")
            assert "twice that without a restore turn" in info, info
            assert "share it with other users' processes" in caplog.text, caplog.text
            if gpushare_app.node_lock_dir == "":
                assert "node_lock_dir is empty; they cover this server only" in caplog.text
            node.release(os.getpid(), 0, OTHER)  # room for twice: it restores by itself
            freed = True
        ex = await k.wait(msg_id, timeout=60)
        assert ex.status == "ok" and "intact" in ex.stdout, ex
        assert (await kernel_status(jp_fetch, k.id))["error"] is None
        if shared:  # the turn covers the machine's servers: room for once did, nothing said
            assert "twice" not in str(ex.displays), ex.displays
            assert "share it with other users' processes" not in caplog.text
    finally:
        if not freed:
            node.release(os.getpid(), 0, OTHER)
        node.close()


async def _waiting(jp_fetch, kernel_id: str) -> str | None:
    info = await kernel_status(jp_fetch, kernel_id)
    return info["waiting"] if info else None
