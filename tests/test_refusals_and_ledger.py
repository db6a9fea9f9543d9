"""What another local user can do to a server without any right to it: flood its agent
socket with connections it refuses (the log says so once, then a count per interval), or
edit the simulated node's shared ledger (only its owner can; a ledger others can write is
refused, with why)."""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess

import pytest

from jupyter_gpushare.protocol import encode
from jupyter_gpushare.server.channel import AgentServer, Refused
from jupyter_gpushare.sim.node import GiB
from jupyter_gpushare.sim.shared import LedgerRefused, SharedSimNode

from .helpers import wait_for

SQUATTER = "gpushare-squatter"


async def test_a_flood_of_refused_connections_logs_one_line_then_a_count_per_interval(
    tmp_path, caplog
):
    async def refuse(kernel_id: str, pid: int) -> None:
        raise Refused(f"pid {pid} is not a process of kernel {kernel_id}")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "agent channel: refused" in r.getMessage()]

    def counted() -> int:
        return sum(int(m.group(1)) for line in lines()[1:]
                   if (m := re.search(r"refused (\d+) more peer", line)))

    server = AgentServer(str(tmp_path / "a.sock"), refuse, {})
    server.refusal_log_interval = 1.0
    caplog.set_level(logging.WARNING, logger="jupyter_gpushare")
    await server.start()
    n = 300
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        for i in range(n):
            reader, writer = await asyncio.open_unix_connection(server.path)
            writer.write(encode({"id": 0, "op": "hello", "kernel_id": f"k{i}", "pid": os.getpid()}))
            await writer.drain()
            await reader.read()  # refused and closed
            writer.close()
        intervals = (loop.time() - start) / server.refusal_log_interval
        # the interval ends: its count is logged by the interval's timer, not by stop()
        await wait_for(lambda: counted() == n - 1, what="the last interval's count")
    finally:
        await server.stop()
    assert server.refusals == n
    # one line, then one a started interval, not one a connection (the flood took 4 s, not
    # under 3, on 2 cores at a load of 15: count the intervals it took)
    assert len(lines()) <= 2 + intervals, lines()
    assert "refused a peer: pid" in lines()[0]
    assert counted() == n - 1, lines()  # every refusal is accounted for


def test_the_shared_ledger_is_created_writable_by_its_owner_only(tmp_path):
    path = tmp_path / "node.sqlite"
    node = SharedSimNode(path, (2 * GiB,))
    node.alloc(os.getpid(), 0, 1 << 20)  # WAL files exist now
    try:
        for name in (path, tmp_path / "node.sqlite-wal", tmp_path / "node.sqlite-shm"):
            if name.exists():
                mode = stat.S_IMODE(os.stat(name).st_mode)
                assert not mode & (stat.S_IWGRP | stat.S_IWOTH), (name, oct(mode))
    finally:
        node.close()
    SharedSimNode(path).close()  # its owner opens it again


def test_a_ledger_other_users_can_write_is_refused(tmp_path):
    path = tmp_path / "node.sqlite"
    SharedSimNode(path, (2 * GiB,)).close()
    os.chmod(path, 0o666)  # as the old default left it, or another user made it
    with pytest.raises(LedgerRefused, match=r"writable by other users.*chmod go-w"):
        SharedSimNode(path)
    link = tmp_path / "link.sqlite"
    os.symlink(path, link)
    with pytest.raises(LedgerRefused, match="symbolic link"):
        SharedSimNode(link)


def test_a_ledger_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the ledger must be given to a second Unix user")
    try:
        uid = pwd.getpwnam(SQUATTER).pw_uid
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("needs useradd to create a second Unix user")
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", SQUATTER],
                       check=True, capture_output=True)
        uid = pwd.getpwnam(SQUATTER).pw_uid
    path = tmp_path / "node.sqlite"
    SharedSimNode(path, (2 * GiB,)).close()
    os.chown(path, uid, uid)
    with pytest.raises(LedgerRefused, match="belongs to another user"):
        SharedSimNode(path)
