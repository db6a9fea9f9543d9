"""The node daemon: per-GPU restore turns owned by a trusted process, on a real Unix socket.

The daemon runs as a real subprocess (``jupyter gpushare node-daemon``) on a shared simulated
node; clients are real socket connections (other processes, another Unix user where the tests
run as root) and real Jupyter servers configured with ``node_daemon_socket``.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from benchmarks._server import Server
from jupyter_gpushare.node.daemon_client import NodeDaemonTurns
from jupyter_gpushare.sim.node import GiB
from jupyter_gpushare.sim.shared import SharedSimNode

from .helpers import unix_user
from .test_node_locks import hold_one, post, released_on

MiB = 1 << 20
PEER_USER = "gpushare-daemon-peer"


class Daemon:
    """``jupyter gpushare node-daemon`` in a subprocess, its log in a file."""

    def __init__(self, node: str, *args: str):
        # a short path of its own (a Unix socket path is at most 107 bytes), that other users
        # may reach (pytest's tmp_path is root's alone)
        self.dir = tempfile.mkdtemp(prefix="gpushare-daemon-")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "node.sock")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.node = node
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter_gpushare.cli", "node-daemon", "--socket",
                 self.socket, "--backend", "simulated", "--simulated-node", self.node,
                 *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon did not listen:\n{self.log()}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Client:
    """One connection to the daemon."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self._next: asyncio.Task[bytes] | None = None  # a line being read, kept for read()

    @classmethod
    async def open(cls, path: str) -> Client:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        return cls(reader, writer)

    async def send(self, msg: Any) -> None:
        data = msg if isinstance(msg, bytes) else json.dumps(msg).encode() + b"\n"
        self.writer.write(data)
        await self.writer.drain()

    def _line(self) -> asyncio.Task[bytes]:
        if self._next is None:
            self._next = asyncio.ensure_future(self.reader.readuntil(b"\n"))
        return self._next

    async def read(self, timeout: float = 30) -> dict[str, Any]:
        line = await asyncio.wait_for(asyncio.shield(self._line()), timeout)
        self._next = None
        return json.loads(line)

    async def ask(self, msg: Any, timeout: float = 30) -> dict[str, Any]:
        await self.send(msg)
        return await self.read(timeout)

    async def nothing_yet(self) -> bool:
        """No line has come in a short look (a line that comes later is read by read())."""
        done, _ = await asyncio.wait({self._line()}, timeout=0.3)
        return not done

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
        self.writer.close()


def two_gpu_node(tmp_path: Any) -> str:
    """A shared simulated node of two 2 GiB GPUs; its file's path."""
    path = str(tmp_path / "node.sqlite")
    SharedSimNode(path, (2 * GiB, 2 * GiB)).close()
    return path


def uuids_of(path: str) -> list[str]:
    n = SharedSimNode(path)
    try:
        return [n.uuid(0), n.uuid(1)]
    finally:
        n.close()


@pytest.fixture
def node(tmp_path) -> str:
    return two_gpu_node(tmp_path)


@pytest.fixture
def uuids(node) -> list[str]:
    return uuids_of(node)


@pytest.fixture
def start_daemon(node):
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        d = Daemon(node, *args).start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


# -- (a) one turn per GPU, several GPUs at once -------------------------------------------------
async def test_same_gpu_turns_go_one_after_another_and_other_gpus_at_once(start_daemon, uuids):
    d = start_daemon("--turn-timeout", "3600")
    g0, g1 = uuids
    a, b, c, both = [await Client.open(d.socket) for _ in range(4)]
    try:
        assert (await a.ask({"op": "turn", "gpus": [g0]}))["state"] == "granted"
        waiting = await b.ask({"op": "turn", "gpus": [g0], "id": 7})
        assert waiting["state"] == "waiting" and waiting["id"] == 7, waiting
        assert waiting["holders"][g0]["pid"] == os.getpid()
        assert (await c.ask({"op": "turn", "gpus": [g1]}))["state"] == "granted"  # another GPU: at once
        assert (await both.ask({"op": "turn", "gpus": [g1, g0]}))["state"] == "waiting"
        assert await b.nothing_yet()
        assert await a.ask({"op": "done"}) == {"ok": True, "op": "done", "released": [g0]}
        assert (await b.read())["state"] == "granted"  # next in line on GPU 0
        assert await both.nothing_yet()  # all or nothing: GPU 0 and GPU 1 are both held
        assert (await c.ask({"op": "done"}))["released"] == [g1]
        assert await both.nothing_yet()  # GPU 0 still b's
        assert (await b.ask({"op": "done"}))["released"] == [g0]
        granted = await both.read()
        assert granted["state"] == "granted" and granted["gpus"] == sorted([g0, g1])
    finally:
        for x in (a, b, c, both):
            x.close()
    log = d.log()
    assert log.count("granted to user root" if os.geteuid() == 0 else "granted to user") >= 4, log


# -- (b) a turn held too long is revoked, and the next one is served ---------------------------
async def test_a_turn_held_past_the_timeout_is_revoked_and_the_next_is_served(start_daemon, uuids):
    d = start_daemon("--turn-timeout", "1")
    g0 = uuids[0]
    hog, next_one = await Client.open(d.socket), await Client.open(d.socket)
    try:
        assert (await hog.ask({"op": "turn", "gpus": [g0]}))["state"] == "granted"
        assert (await next_one.ask({"op": "turn", "gpus": [g0]}))["state"] == "waiting"
        revoked = await hog.read(timeout=60)
        assert revoked["event"] == "revoked" and revoked["gpus"] == [g0], revoked
        assert "turn-timeout" in revoked["reason"]
        assert (await next_one.read(timeout=60))["state"] == "granted"
        # the revoked connection holds nothing, and may ask again (behind the new holder)
        assert await hog.ask({"op": "done"}) == {"ok": True, "op": "done", "released": []}
    finally:
        hog.close()
        next_one.close()
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert f"revoked from user {me} (uid {os.geteuid()}" in d.log(), d.log()


# -- (c) a dead client's turns are free at once ---------------------------------------------------
_HOLDER = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(json.dumps({"op": "turn", "gpus": [sys.argv[2]]}).encode() + b"\\n")
print(s.makefile().readline().strip(), flush=True)
time.sleep(3600)
"""


async def test_a_dead_clients_turns_are_given_back_at_once(start_daemon, uuids):
    d = start_daemon("--turn-timeout", "3600")  # far beyond the test: no revocation helps
    g0 = uuids[0]
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, d.socket, g0],
                              stdout=subprocess.PIPE, text=True)
    waiter = await Client.open(d.socket)
    try:
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline())["state"] == "granted"
        waiting = await waiter.ask({"op": "turn", "gpus": [g0]})
        assert waiting["holders"][g0]["pid"] == holder.pid
        holder.kill()
        holder.wait()
        assert (await waiter.read(timeout=60))["state"] == "granted"
    finally:
        holder.kill()
        holder.wait()
        waiter.close()


# -- (d) who is who: SO_PEERCRED ------------------------------------------------------------------
_HELLO = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b'{"op": "hello"}\\n')
print(s.makefile().readline().strip(), flush=True)
"""


@pytest.fixture(scope="module")
def peer_user() -> int:
    return unix_user(PEER_USER, "a connection must come from a second Unix user")


def python_of(uid: int) -> str:
    """A Python that user ``uid`` may run (the scripts it runs need only the standard library;
    this test's own interpreter may live in root's home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if subprocess.run([candidate, "-I", "-c", "pass"], user=uid,
                              capture_output=True, timeout=60).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip("no Python that another Unix user may run")


async def test_the_daemon_knows_the_caller_by_its_peer_credentials(start_daemon):
    d = start_daemon()
    c = await Client.open(d.socket)
    try:
        hello = await c.ask({"op": "hello", "uid": 0, "user": "someone-else"})  # claims are ignored
    finally:
        c.close()
    assert (hello["uid"], hello["pid"]) == (os.geteuid(), os.getpid()), hello
    assert hello["user"] == pwd.getpwuid(os.geteuid()).pw_name and hello["turn_timeout"] == 60


async def test_a_connection_of_another_unix_user_is_that_user(start_daemon, uuids, peer_user):
    d = start_daemon()
    python = python_of(peer_user)
    out = subprocess.run([python, "-I", "-c", _HELLO, d.socket], user=peer_user,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    hello = json.loads(out.stdout)
    assert (hello["uid"], hello["user"]) == (peer_user, PEER_USER), hello
    # and its turns are logged by its name
    holder = subprocess.Popen([python, "-I", "-c", _HOLDER, d.socket, uuids[0]],
                              user=peer_user, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline())["state"] == "granted"
    finally:
        holder.kill()
        holder.wait()
    assert f"granted to user {PEER_USER} (uid {peer_user}, pid {holder.pid})" in d.log()


async def test_too_many_connections_of_one_user_are_refused(start_daemon):
    d = start_daemon("--max-connections-per-user", "3")
    open_ = [await Client.open(d.socket) for _ in range(3)]
    try:
        for c in open_:
            assert (await c.ask({"op": "hello"}))["ok"] is True
        extra = await Client.open(d.socket)
        refused = await extra.read()
        assert refused["ok"] is False and "too many connections" in refused["error"], refused
        extra.close()
        open_.pop().close()
        deadline = time.monotonic() + 60  # the daemon sees the close: a place frees
        while True:
            again = await Client.open(d.socket)
            reply = await again.ask({"op": "hello"})
            again.close()
            if reply["ok"]:
                break
            assert time.monotonic() < deadline, reply
            await asyncio.sleep(0.1)
    finally:
        for c in open_:
            c.close()


# -- (e) bad input: an error line, nothing changes, the daemon goes on ----------------------------
async def test_garbage_gets_an_error_and_changes_nothing(start_daemon, uuids, node):
    d = start_daemon("--turn-timeout", "3600")
    g0, g1 = uuids
    c, other = await Client.open(d.socket), await Client.open(d.socket)
    try:
        assert (await c.ask({"op": "turn", "gpus": [g0]}))["state"] == "granted"
        bad = [
            (b"not json\n", "not a JSON line"),
            (b"\xff\xfe\n", "not a JSON line"),
            (b"[1, 2]\n", "JSON object"),
            ({"op": "grab"}, "unknown op"),
            ({"op": 5}, '"op"'),
            ({"no": "op"}, '"op"'),
            ({"op": "turn"}, "non-empty list"),
            ({"op": "turn", "gpus": g1}, "non-empty list"),
            ({"op": "turn", "gpus": [1]}, "GPU UUIDs"),
            ({"op": "turn", "gpus": ["../../etc"]}, "GPU UUIDs"),
            ({"op": "turn", "gpus": [g1] * 65}, "at most 64"),
            ({"op": "turn", "gpus": ["GPU-not-on-this-node"]}, "not a GPU of this node"),
            ({"op": "turn", "gpus": [g1]}, "already holds a turn"),  # one per connection
            (b"{" + b"x" * (100 * 1024) + b"}\n", "longer than 65536 bytes"),
            (b'{"op": "hello", "pad": "' + b"y" * (200 * 1024), "longer than 65536 bytes"),
        ]
        for line, why in bad:
            reply = await c.ask(line)
            assert reply["ok"] is False and why in reply["error"], (str(line)[:80], reply)
        await c.send(b'"}\n')  # the end of the last over-long line: skipped, no answer
        assert (await c.ask({"op": "hello", "id": "after"}))["id"] == "after"  # still serving
        # nothing changed: c still holds GPU 0, GPU 1 is free
        assert (await other.ask({"op": "turn", "gpus": [g1]}))["state"] == "granted"
        assert (await other.ask({"op": "done"}))["released"] == [g1]
        assert (await other.ask({"op": "turn", "gpus": [g0]}))["state"] == "waiting"
        assert (await c.ask({"op": "done"}))["released"] == [g0]
        assert (await other.read())["state"] == "granted"
        # the daemon's own reading of free memory
        sim = SharedSimNode(node)
        sim.alloc(os.getpid(), 1, 512 * MiB)
        try:
            free = await c.ask({"op": "free", "gpus": [g1, "GPU-unknown"]})
            assert free["free"] == {g1: 1536 * MiB, "GPU-unknown": None}, free
            everything = await NodeDaemonTurns(d.socket).free()
            assert everything == {g0: 2 * GiB, g1: 1536 * MiB}
        finally:
            sim.release(os.getpid(), 1, 512 * MiB)
            sim.close()
        for _ in range(50):  # a flood of bad lines: the log says it once, not 50 times
            await c.send(b"nonsense\n")
        for _ in range(50):
            await c.read()
    finally:
        c.close()
        other.close()
    assert d.proc is not None and d.proc.poll() is None
    log = d.log()
    assert log.count("refused: not a JSON line") < 10, log
    assert "similar lines left out" in log or log.count("refused:") < 10


async def test_the_daemon_refuses_a_bad_start(node, tmp_path):
    plain = tmp_path / "not-a-socket"
    plain.write_text("mine")
    for args, why in (
        (["--socket", str(plain), "--backend", "none"], "is not a socket"),
        (["--socket", str(tmp_path / "s"), "--turn-timeout", "0"], "must be a number of seconds > 0"),
        (["--socket", str(tmp_path / "s"), "--backend", "simulated"], "needs --simulated-node"),
        (["--socket", str(tmp_path / "s"), "--backend", "simulated", "--simulated-node",
          str(tmp_path / "missing.sqlite")], "no such file"),
    ):
        out = subprocess.run([sys.executable, "-m", "jupyter_gpushare.cli", "node-daemon", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr, (args, out.stderr)
    assert plain.read_text() == "mine"  # left as it was


# -- (f) two real servers take their turns from the daemon ----------------------------------------
def _same(name: str) -> str:
    return (f"import json\nimport numpy as np\nprint(json.dumps(int(np.asarray({name}.get(), "
            f"dtype=np.uint64).sum()) == {name}_sum))")


async def _restored(srv: Server, kernel_id: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = await srv.kernel_status(kernel_id)
        assert view["error"] is None and "failed" not in view["state"], view
        if view["state"] in ("active", "idle"):
            return view
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.2)


async def test_two_servers_restore_into_one_gpus_room_by_the_daemons_turns(tmp_path):
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (2 * GiB,)).close()
    node = SharedSimNode(node_path)
    d = Daemon(node_path, "--turn-timeout", "120").start()
    config = {"simulated_node": node_path, "node_daemon_socket": d.socket, "idle_timeout": 0,
              "pressure_idle_timeout": 3600, "poll_interval": 0.5}
    try:
        async with Server("daemon-a", gpushare=config) as a, Server("daemon-b", gpushare=config) as b:
            for srv in (a, b):
                with open(srv.log_path, errors="replace") as f:
                    assert "restore turns from the node daemon at" in f.read(), srv.log_tail()
            ka, kb = await released_on((a, b), 640)
            node.alloc(os.getpid(), 0, 1 * GiB)  # another user's process: room for one restore
            try:
                answers = await asyncio.gather(
                    post(a, f"/api/gpushare/kernels/{ka.id}/restore"),
                    post(b, f"/api/gpushare/kernels/{kb.id}/restore"),
                )
                codes = sorted(code for code, _ in answers)
                assert set(codes) <= {200, 202} and codes != [200, 200], answers
                views = [await a.kernel_status(ka.id), await b.kernel_status(kb.id)]
                assert [v["error"] for v in views] == [None, None], views
                restored = [v for v in views if v["state"] in ("active", "idle")]
                assert len(restored) <= 1, views  # the GPU holds one of them: never both
                for v in views:
                    assert "without a restore turn" not in (v.get("waiting") or ""), v
            finally:
                node.release(os.getpid(), 0, 1 * GiB)
            await _restored(a, ka.id)
            await _restored(b, kb.id)
            assert await ka.value(_same("x")) is True  # every byte came back, on both
            assert await kb.value(_same("y")) is True
            for srv in (a, b):
                with open(srv.log_path, errors="replace") as f:
                    text = f.read()
                assert "cannot be used" not in text and "without a turn" not in text, text[-3000:]
            log = d.log()
            for srv in (a, b):
                assert f"pid {srv.pid}) " in log or f"pid {srv.pid})\n" in log, log
    finally:
        node.close()
        d.stop()


# -- (g) the daemon cannot be reached: unguarded, said, nothing lost ------------------------------
async def test_an_unreachable_daemon_leaves_restores_unguarded_and_says_why(tmp_path):
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (2 * GiB,)).close()
    gone = str(tmp_path / "no-daemon.sock")
    config = {"simulated_node": node_path, "node_daemon_socket": gone, "idle_timeout": 0,
              "pressure_idle_timeout": 3600, "poll_interval": 0.5, "placement": "room"}
    async with Server("daemon-gone", gpushare=config) as srv:
        k = await srv.start_kernel()
        await k.run(hold_one(256, "x"))
        await srv.wait_kernel(k.id, lambda v: v["gpu_memory_bytes"] >= 256 * MiB, "memory seen")
        await srv.api("POST", f"/api/gpushare/kernels/{k.id}/release")
        assert await k.value(_same("x")) is True  # restored by the cell, every byte
        view = await srv.kernel_status(k.id)
        assert view["error"] is None and view["state"] in ("active", "idle"), view
        with open(srv.log_path, errors="replace") as f:
            text = f.read()
    assert f"the node daemon at {gone} cannot be used" in text, text[-3000:]
    assert "stricter room check" in text and "node_daemon_socket" in text
    # the kernel was placed by the server's own view; the daemon's silence said once, not
    # at every poll
    assert "kernel " in text and " placed on GPU " in text, text[-3000:]
    assert text.count("did not share the node's placements") == 1, text[-3000:]


def test_the_option_defaults_to_the_environment_and_else_to_unused(monkeypatch):
    from jupyter_gpushare.server.app import GPUShareApp

    monkeypatch.delenv("JUPYTER_GPUSHARE_NODE_DAEMON", raising=False)
    assert GPUShareApp().node_daemon_socket == ""
    monkeypatch.setenv("JUPYTER_GPUSHARE_NODE_DAEMON", "/run/gpushare/node.sock")
    assert GPUShareApp().node_daemon_socket == "/run/gpushare/node.sock"


async def test_a_daemon_of_another_user_is_not_trusted(tmp_path, peer_user):
    """A socket another user listens on at the path hands out no turns to this server."""
    directory = tempfile.mkdtemp(prefix="gpushare-fake-")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "node.sock")
    fake = subprocess.Popen(
        [python_of(peer_user), "-I", "-c", "import socket, sys, time\ns = socket.socket(socket.AF_UNIX)\n"
         "s.bind(sys.argv[1]); s.listen(); print('up', flush=True)\nc, _ = s.accept()\n"
         "c.sendall(b'{\"ok\": true, \"op\": \"turn\", \"state\": \"granted\"}\\n')\n"
         "time.sleep(3600)", path], user=peer_user, stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "up"
        turns = NodeDaemonTurns(path)
        grant = await turns.acquire(["GPU-1"])
        why = grant.unguarded["GPU-1"]
        assert f"runs as {PEER_USER}" in why and "not trusted" in why, why
        assert turns.refusal() is not None
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(directory, ignore_errors=True)


def test_nothing_at_the_socket_path_is_a_refusal_that_says_so(tmp_path):
    why = NodeDaemonTurns(str(tmp_path / "none.sock")).refusal()
    assert why is not None and "cannot be used" in why and "No such file" in why, why


# -- (h) room checks read free memory from the daemon ----------------------------------------------
async def test_room_checks_read_the_daemons_free_memory(tmp_path):
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (1 * GiB,)).close()
    # the daemon reads a copy of the node (the same GPU UUIDs), filled where the server's is not:
    # a restore that waits shows that the daemon's reading, not the server's own, decided
    daemons_view = str(tmp_path / "daemons-view.sqlite")
    shutil.copy(node_path, daemons_view)
    seen = SharedSimNode(daemons_view)
    d = Daemon(daemons_view).start()
    config = {"simulated_node": node_path, "node_daemon_socket": d.socket, "idle_timeout": 0,
              "pressure_idle_timeout": 3600, "poll_interval": 0.5}
    try:
        async with Server("daemon-free", gpushare=config) as srv:
            (k,) = await released_on((srv,), 256)
            seen.alloc(os.getpid(), 0, 900 * MiB)
            try:
                code, body = await post(srv, f"/api/gpushare/kernels/{k.id}/restore")
                assert code == 202 and "waiting for memory" in (body.get("waiting") or ""), body
            finally:
                seen.release(os.getpid(), 0, 900 * MiB)
            await _restored(srv, k.id)
            assert await k.value(_same("x")) is True
    finally:
        seen.close()
        d.stop()
