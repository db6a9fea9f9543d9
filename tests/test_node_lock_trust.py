"""Restore turns across servers that another local user cannot take, and waits for a turn that
are visible and bounded per GPU.

A lock directory or file that another user could own, widen or redirect is refused (a clear
warning, no file created through it) and restores on that GPU then need room for twice their
state, so two of them never collide. A turn another process keeps is shown in the cell and in
``status``, and stalls restores on that GPU for at most the bound in all, not once per restore.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
import time

import pytest
from jupyter_core.paths import jupyter_runtime_dir

from benchmarks._server import Server
from jupyter_gpushare.node.node_locks import NodeLocks
from jupyter_gpushare.sim.node import GiB
from jupyter_gpushare.sim.shared import SharedSimNode

from .helpers import kernel_status, unix_user, wait_for
from .scenarios import hold, intact, rest
from .test_node_locks import post, released_on

MiB = 1 << 20
SQUATTER = "gpushare-squatter"

_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def other_user() -> int:
    """The uid of a real second Unix user (created with useradd when missing)."""
    return unix_user(SQUATTER, "a second Unix user must own the squatted directory")


def _squat(path: str, uid: int, mode: int) -> None:
    os.makedirs(path)
    os.chown(path, uid, uid)
    os.chmod(path, mode)


@pytest.mark.parametrize("case", ["other-user-0700", "other-user-1777", "own-0777", "symlink-dir",
                                  "symlink-file", "other-users-file"])
async def test_a_lock_directory_or_file_another_user_could_take_is_refused(
    case, tmp_path, other_user, caplog
):
    locks_dir = str(tmp_path / "locks")
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    if case == "other-user-0700":
        _squat(locks_dir, other_user, 0o700)
    elif case == "other-user-1777":
        _squat(locks_dir, other_user, 0o1777)
    elif case == "own-0777":
        os.makedirs(locks_dir)
        os.chmod(locks_dir, 0o777)
    elif case == "symlink-dir":
        os.symlink(target, locks_dir)
    else:
        os.makedirs(locks_dir, mode=0o700)
    locks = NodeLocks(locks_dir, timeout=5)
    if case == "symlink-file":
        os.symlink(target / "planted.lock", locks._path("GPU-1"))
    elif case == "other-users-file":
        with open(locks._path("GPU-1"), "w"):
            pass
        os.chown(locks._path("GPU-1"), other_user, other_user)
    caplog.set_level(logging.WARNING, logger="jupyter_gpushare")
    grant = await locks.acquire(["GPU-1"])
    assert grant._fds == [] and "refused" in grant.unguarded["GPU-1"], grant.unguarded
    assert "refused" in caplog.text and "stricter room check" in caplog.text
    assert list(target.iterdir()) == []  # nothing created where a link pointed
    if case in ("other-user-0700", "other-user-1777", "own-0777"):
        assert not os.path.exists(locks._path("GPU-1"))
    assert locks.refusal() is not None or case in ("symlink-file", "other-users-file")


async def test_a_root_owned_sticky_directory_and_a_private_one_are_used(tmp_path):
    shared = str(tmp_path / "shared")
    os.makedirs(shared)
    os.chmod(shared, 0o1777)  # root's (these tests run as root) and sticky: an admin's
    if os.geteuid() != 0:
        pytest.skip("needs root: the shared directory must be root's")
    for directory in (shared, str(tmp_path / "private" / "locks")):
        locks = NodeLocks(directory, timeout=5)
        grant = await locks.acquire(["GPU-1"])
        assert len(grant._fds) == 1 and grant.unguarded == {}
        grant.release()
        info = os.lstat(locks._path("GPU-1"))
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(tmp_path / "private" / "locks").st_mode) == 0o700


def test_the_default_lock_directory_is_the_users_own_not_a_shared_tmp_name(jp_serverapp):
    app = jp_serverapp.extension_manager.extension_points["jupyter_gpushare"].app
    default = app._default_node_lock_dir()
    assert default == os.path.join(jupyter_runtime_dir(), "gpushare-locks")
    assert not default.startswith("/tmp/jupyter-gpushare")


async def test_one_holder_stalls_a_gpu_for_the_bound_once_not_once_per_restore(tmp_path):
    locks = NodeLocks(str(tmp_path / "locks"), timeout=1.5)
    (await locks.acquire(["GPU-1"])).release()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, locks._path("GPU-1"), "60"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        heard: list[tuple[str, int | None, float]] = []
        started = time.monotonic()
        first = await locks.acquire(["GPU-1"], lambda *a: heard.append(a))
        # waited its bound, then went on while the holder (60 s) still holds the turn
        assert time.monotonic() - started > 1.4 and holder.poll() is None
        assert "GPU-1" in first.unguarded
        assert heard and heard[0][0] == "GPU-1" and heard[0][1] == holder.pid, heard
        waits: list = []  # a wait past half the bound would be told, as the first one was
        for _ in range(3):  # the same holder keeps it: no new full wait per restore
            later = await locks.acquire(["GPU-1"], lambda *a: waits.append(a))
            assert waits == [] and "held the restore turn" in later.unguarded["GPU-1"]
        holder.kill()
        holder.wait()
        again = await locks.acquire(["GPU-1"])  # the holder is gone: turns again
        assert len(again._fds) == 1 and again.unguarded == {}
        again.release()
    finally:
        holder.kill()
        holder.wait()


# -- on a real server: visible and bounded -----------------------------------------------------
@pytest.fixture
def gpushare_config(tmp_path):
    node = str(tmp_path / "node.sqlite")
    SharedSimNode(node, (2 * GiB, 2 * GiB)).close()
    return {"simulated_node": node, "node_lock_dir": str(tmp_path / "locks")}


async def test_a_turn_another_server_holds_is_shown_and_bounded_per_gpu(
    jp_fetch, kernels, gpushare_app
):
    locks = gpushare_app.controller.reservations.node_locks
    assert locks is not None
    locks.timeout = 4.0
    k = await kernels.start()
    await k.run(hold(256))
    await gpushare_app.poll_once()
    uuid = gpushare_app.controller._gpu_uuid(0)
    os.makedirs(locks.directory, mode=0o700, exist_ok=True)
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, locks._path(uuid), "60"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        msg_id = k.send(intact())
        info = await wait_for(lambda: _waiting(jp_fetch, k.id), timeout=3, what="status to say it waits")
        assert "another server's restore turn on GPU 0" in info, info
        ex = await k.wait(msg_id, timeout=30)  # restores after the bound, with the strict check
        assert ex.status == "ok" and "intact" in ex.stdout
        shown = json.dumps(ex.displays)
        assert "another server's restore turn on GPU 0" in shown, ex.displays
        # the same holder keeps the turn: the next restore on GPU 0 does not wait again (a
        # wait would be shown in the cell, as the first one was)
        assert (await rest(jp_fetch, k.id, "release"))[0] == 200
        ex = await k.run(intact())
        assert "intact" in ex.stdout
        assert "another server's restore turn" not in json.dumps(ex.displays), ex.displays
    finally:
        holder.kill()
        holder.wait()


async def _waiting(jp_fetch, kernel_id: str) -> str | None:
    info = await kernel_status(jp_fetch, kernel_id)
    return info["waiting"] if info else None


# -- two real servers whose lock files are refused: restores still never collide -----------------
async def test_refused_lock_files_never_let_two_servers_restores_collide(tmp_path):
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (256 * MiB,)).close()  # small: every byte is copied
    node = SharedSimNode(node_path)
    locks_dir = tmp_path / "locks"
    locks_dir.mkdir(mode=0o700)
    planted = tmp_path / "planted"
    os.symlink(planted, NodeLocks(str(locks_dir))._path(node.uuid(0)))  # a planted link: refused
    config = {"simulated_node": node_path, "node_lock_dir": str(locks_dir),
              "idle_timeout": 0, "pressure_idle_timeout": 3600, "poll_interval": 0.5}
    async with Server("trust-a", gpushare=config) as a, Server("trust-b", gpushare=config) as b:
        ka, kb = await released_on((a, b), 80)
        node.alloc(os.getpid(), 0, 128 * MiB)  # another user's process: 128 MiB free: room for one
        try:
            answers = await asyncio.gather(
                post(a, f"/api/gpushare/kernels/{ka.id}/restore"),
                post(b, f"/api/gpushare/kernels/{kb.id}/restore"),
            )
            assert sorted(code for code, _ in answers) == [202, 202], answers  # neither risks it
            for _, body in answers:
                assert "twice that without a restore turn" in body["waiting"], body
        finally:
            node.release(os.getpid(), 0, 128 * MiB)
        views = []
        for srv, k in ((a, ka), (b, kb)):
            views.append(await srv.kernel_status(k.id))
        assert [v["error"] for v in views] == [None, None], views
        # memory freed: one restores (room for twice its state); never a failed restore
        first = await _first_restored(a, ka, b, kb)
        for srv, k in ((a, ka), (b, kb)):
            view = await srv.kernel_status(k.id)
            assert view["error"] is None and "failed" not in view["state"], view
        name = first[2]
        same = (f"import json\nprint(json.dumps(int(np.asarray({name}.get(), dtype=np.uint64).sum())"
                f" == {name}_sum))")
        assert await first[1].value(same) is True  # every byte came back
    assert not planted.exists()


async def _first_restored(a, ka, b, kb, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for srv, k, name in ((a, ka, "x"), (b, kb, "y")):
            if (await srv.kernel_status(k.id))["state"] in ("active", "idle"):
                return srv, k, name
        await asyncio.sleep(0.2)
    raise TimeoutError("no restore in time")


# -- without a turn, room for twice the state is waited for a bounded time ---------------------
async def test_a_turnless_restore_that_fits_once_is_not_stalled_for_ever(
    jp_fetch, kernels, gpushare_app
):
    """A refused lock file leaves restores on GPU 0 without a turn: room for twice the state.
    A 384 MiB restore with 640 MiB free waits for that, says for how long, then settles for room
    for once (seen three times) and says so in the cell; every byte comes back."""
    gpushare_app.turnless_restore_after = 1.0
    k = await kernels.start()
    await k.run(hold(384, chunk=128))
    await gpushare_app.poll_once()
    locks = gpushare_app.controller.reservations.node_locks
    assert locks is not None
    os.makedirs(locks.directory, mode=0o700, exist_ok=True)
    os.symlink(str(locks.directory) + "-planted", locks._path(gpushare_app.controller._gpu_uuid(0)))
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    node = SharedSimNode(gpushare_app.simulated_node)
    other = 2 * GiB - 640 * MiB  # another user's process: 640 MiB free on GPU 0
    node.alloc(os.getpid(), 0, other)
    try:
        msg_id = k.send(intact())
        info = await wait_for(lambda: _waiting(jp_fetch, k.id), timeout=10,
                              what="status to say the restore waits")
        assert "twice that without a restore turn (room for once will do after 1 s)" in info, info
        ex = await k.wait(msg_id, timeout=30)
        assert ex.status == "ok" and "intact" in ex.stdout, ex
        shown = json.dumps(ex.displays)
        assert "no restore turn on GPU 0" in shown, ex.displays
        assert "restoring with room for it once, seen three times" in shown, ex.displays
        assert (await kernel_status(jp_fetch, k.id))["error"] is None
    finally:
        node.release(os.getpid(), 0, other)
