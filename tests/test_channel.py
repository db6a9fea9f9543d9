"""The agent channel keeps working through bad input and faults: messages are bounded,
bad lines are skipped, bad fields are refused and change nothing, a request past its
deadline is not run, and an agent whose channel dropped reconnects (the server re-binds a
removed socket file) with its simulated GPU memory still accounted."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import time
import types

import pytest

from jupyter_gpushare.protocol import (
    EXPIRED,
    LIST_CAP,
    MAX_LINE,
    BadLine,
    LineBuffer,
    MessageTooLarge,
    RemoteError,
    cap_list,
    decode,
    encode,
)
from jupyter_gpushare.sim.node import GiB, SimNode

from .fakes.fake_pynvml import FakeProcess
from .helpers import kernel_status, wait_for

MiB = 1 << 20
AGENT = "from jupyter_gpushare.kernel.agent import get_agent\nagent = get_agent()\n"


def hold(mib: int, name: str = "x") -> str:
    """A cell that holds ``mib`` MiB in 64 MiB arrays of distinct data, with their checksums."""
    return (
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        f"{name} = [simgpu.array(np.arange(16 << 20, dtype=np.uint32) * (2 * i + 1), copy=False)"
        f" for i in range({mib // 64})]\n"
        f"{name}_sum = [a.checksum() for a in {name}]"
    )


def same_data(name: str = "x") -> str:
    return f"assert [a.checksum() for a in {name}] == {name}_sum\nprint('same data')"


# -- the wire format, on its own -------------------------------------------------------------
def test_encode_never_produces_a_line_over_the_limit():
    big = "x" * MAX_LINE
    line = encode({"re": 7, "ok": True, "data": big})
    assert len(line) <= MAX_LINE
    reply = decode(line)
    assert reply["re"] == 7 and reply["ok"] is False and reply["kind"] == "MessageTooLarge"
    framing = len(b'{"re":7,"ok":true,"data":""}\n')
    assert reply["error"] == (f"reply too large: {MAX_LINE + framing} bytes, over the channel's limit "
                              f"of {MAX_LINE} bytes per message")
    with pytest.raises(MessageTooLarge, match=r"^show too large: "):
        encode({"id": 1, "op": "show", "text": big})
    with pytest.raises(MessageTooLarge):
        encode({"op": "free", "pad": big})
    small = {"re": 1, "ok": True, "skipped": ["a"] * 10}
    assert decode(encode(small)) == small


def test_cap_list_says_how_many_were_left_out():
    assert cap_list(["a", "b"]) == ["a", "b"]
    capped = cap_list([f"t{i}: " + "y" * 1000 for i in range(LIST_CAP + 7)])
    assert len(capped) == LIST_CAP + 1 and capped[-1] == "... and 7 more"
    assert capped[0].startswith("t0: yyy") and capped[0].endswith("...") and len(capped[0]) == 300


def test_line_buffer_skips_an_overlong_line_without_keeping_it_and_reads_on():
    lines = LineBuffer(limit=64)
    out = lines.feed(b'{"op":"a"}\n{"re":12,"ok":true,"pad":"' + b"z" * 100)
    assert out == [b'{"op":"a"}\n']
    assert len(lines._buf) == 0  # the overlong line is dropped as it arrives, not buffered
    out = lines.feed(b"z" * 500 + b'"}\n{"op":"b"}\n')
    assert out == [BadLine(size=26 + 100 + 500 + 3, why="line over the limit", reply_to=12),
                   b'{"op":"b"}\n']
    # a line over the limit that arrives whole, and one that is exactly at it
    out = lines.feed(b"q" * 70 + b"\n" + b"w" * 63 + b"\n")
    assert out == [BadLine(size=71, why="line over the limit"), b"w" * 63 + b"\n"]


# -- bounded replies and bad lines through a real server and kernel ---------------------------
async def test_a_reply_over_the_limit_fails_that_request_and_the_channel_keeps_working(
    kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(AGENT + "agent.client.handlers['echo'] = lambda msg: {'data': 'x' * (2 << 20)}")
    conn = gpushare_app.channel.connections[k.id]
    with pytest.raises(RemoteError, match=r"^reply too large: \d+ bytes, over the channel's limit"):
        await conn.request("echo", timeout=20)
    assert gpushare_app.channel.connections[k.id] is conn and not conn.closed.is_set()
    assert (await conn.request("report", timeout=20))["ok"] is True
    ex = await k.run("%gpushare")
    assert "gpushare: this kernel (simulated backend)" in ex.text


async def test_garbage_and_overlong_lines_do_not_close_the_channel(kernels, gpushare_app, caplog):
    caplog.set_level(logging.WARNING, logger="jupyter_gpushare.server.channel")
    k = await kernels.start()
    await k.run(hold(64))
    conn = gpushare_app.channel.connections[k.id]

    # kernel -> server: not JSON, JSON that is no message, a line over the limit
    await k.run(AGENT + "with agent.client._send_lock:\n"
                "    agent.client._sock.sendall(b'not json\\n[1, 2]\\n{' + b'x' * (2 << 20) + b'\\n')")
    await wait_for(lambda: conn.bad_lines == 3, what="the server to skip three lines")
    # ... and a reply to a pending request that cannot be read fails that request at once
    await k.run(
        "def forged(msg):\n"
        "    with agent.client._send_lock:\n"
        "        agent.client._sock.sendall(b'{\"re\":%d,\"ok\":true,\"pad\":\"' % msg['id']"
        " + b'x' * (2 << 20) + b'\"}\\n')\n"
        "agent.client.handlers['forged'] = forged")
    with pytest.raises(RemoteError, match=r"^the agent's reply could not be read: line over the limit"):
        await conn.request("forged", timeout=20)
    assert conn.bad_lines == 4
    skipped = [r.getMessage() for r in caplog.records if "skipped a bad message" in r.getMessage()]
    assert len(skipped) == 3  # the 1st, 2nd and 4th: a flood costs a few lines, not one each

    # server -> kernel: the same kinds of garbage
    conn.writer.write(b"garbage\n" + b"{" + b"y" * (3 << 20) + b"\n" + b'"just a string"\n')
    assert (await conn.request("report", timeout=20))["ok"] is True
    ex = await k.run("print(agent.client.bad_lines, agent.client.reconnects)\n" + same_data())
    assert ex.stdout == "3 0\nsame data\n"
    assert gpushare_app.channel.connections[k.id] is conn and not conn.closed.is_set()
    assert "released" in (await k.run("%gpushare release")).stdout
    assert "same data" in (await k.run(same_data())).stdout


@pytest.mark.torch
def test_offload_reply_caps_the_skipped_list(monkeypatch):
    """Ten thousand tensors the offload must leave on the device: the reply lists 50 and says
    how many more, so it fits on one line (before, it closed the channel for good)."""
    torch = pytest.importorskip("torch")
    from jupyter_gpushare.kernel import agent as agent_module
    from jupyter_gpushare.kernel import offload
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter

    device = set()  # storages that count as device memory (a CPU stand-in for CUDA)
    namespace, outside = {}, []
    for i in range(10_000):
        t = torch.zeros(4)
        device.add(t.untyped_storage()._cdata)
        outside.append(t.view(2, 2))  # its storage is used outside the namespace: left alone
        namespace[f"tensor_number_{i}"] = t
    adapter = TorchAdapter(is_device=lambda t: t.untyped_storage()._cdata in device,
                           synchronize=lambda: None)
    monkeypatch.setattr(offload, "present_adapters", lambda: [adapter])
    agent = agent_module.Agent(types.SimpleNamespace(user_ns=namespace))

    reply = agent._offload({})
    assert reply["bytes"] == 0 and len(reply["skipped"]) == LIST_CAP + 1
    assert reply["skipped"][0].startswith("tensor_number_0: its storage is also used by 1 tensor")
    assert reply["skipped"][-1] == f"... and {10_000 - LIST_CAP} more"
    assert decode(encode({"re": 1, "ok": True, **reply}))["ok"] is True


# -- bad fields are refused with the reason and change nothing ------------------------------
BAD_REQUESTS = [
    ("alloc", {"gpu": 0, "bytes": -5}, "bytes must be >= 0, got -5"),
    ("alloc", {"gpu": 0, "bytes": "lots"}, "bytes must be an integer, got 'lots'"),
    ("alloc", {"gpu": 0, "bytes": 1.5}, "bytes must be an integer, got 1.5"),
    ("alloc", {"gpu": True, "bytes": 1}, "gpu must be an integer, got True"),
    ("alloc", {"gpu": "0", "bytes": 1}, "gpu must be an integer, got '0'"),
    ("alloc", {"gpu": 7, "bytes": 1}, "invalid device 7: this node has 2 simulated GPUs"),
    ("alloc", {"gpu": 0, "bytes": 17 * GiB}, "out of memory on simulated GPU 0"),
    ("sync", {"gpus": {"0": -1}}, "bytes must be >= 0, got -1"),
    ("sync", {"gpus": {"zero": 1}}, "gpus keys must be GPU indexes, got 'zero'"),
    ("sync", {"gpus": [1, 2]}, 'gpus must be an object {"GPU index": bytes}'),
    ("sync", {"gpus": {"0": 1}, "busy": [9]}, "invalid device 9"),
    ("pin", {"pinned": "yes"}, "pinned must be true or false, got 'yes'"),
    ("pin", {"pinned": 1}, "pinned must be true or false, got 1"),
    ("idle_timeout", {"seconds": -1}, "seconds must be a number of seconds >= 0, got -1"),
    ("idle_timeout", {"seconds": float("inf")}, "seconds must be a number of seconds >= 0, got inf"),
    ("idle_timeout", {"seconds": "60"}, "seconds must be a number of seconds >= 0, got '60'"),
    ("restore", {"trigger": "shutdown"}, "trigger must be one of agent, magic, background, got 'shutdown'"),
    ("restore", {"parent": "header"}, "parent must be a message header (an object)"),
    ("report", {"framework_bytes": "lots"}, "framework_bytes must be an integer, got 'lots'"),
    ("report", {"framework_bytes": 1, "frameworks": "torch"}, "frameworks must be a list of strings"),
    ("alloc", {"gpu": 0, "bytes": 1, "deadline": "soon"}, "deadline must be a number of epoch seconds"),
    ("alloc", {"gpu": 0, "bytes": 1, "deadline": time.time() - 60}, "expired: the agent stopped waiting"),
    ("no_such_op", {}, "unknown op 'no_such_op'"),
]
BAD_NOTES = [("free", {"gpu": 0, "bytes": -(1 << 30)}), ("free", {"gpu": 0, "bytes": "all"}),
             ("busy_begin", {"gpu": "0"}), ("busy_end", {"gpu": None}), ("free", {"gpu": -1, "bytes": 1})]


async def test_bad_fields_are_refused_with_the_reason_and_change_nothing(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(64))
    await gpushare_app.poll_once()
    node = gpushare_app.node
    before, info_before = node.pids(), await kernel_status(jp_fetch, k.id)
    conn = gpushare_app.channel.connections[k.id]

    cell = AGENT + (
        "import json\nfrom jupyter_gpushare.protocol import RemoteError\nerrors = []\n"
        f"for op, args, _ in json.loads({json.dumps(json.dumps(BAD_REQUESTS))}):\n"
        "    try:\n"
        "        agent.client.request(op, timeout=None, **args)\n"
        "        errors.append('accepted')\n"
        "    except RemoteError as e:\n"
        "        errors.append(str(e))\n"
        f"for op, args in json.loads({json.dumps(json.dumps(BAD_NOTES))}):\n"
        "    agent.client.notify(op, **args)\n"
        "agent.client.request('status', timeout=None)  # after the notifications, in order\n"
        "print(json.dumps(errors))"
    )
    errors = json.loads((await k.run(cell)).stdout)
    for (op, args, expected), error in zip(BAD_REQUESTS, errors, strict=True):
        assert error.startswith(expected), (op, args, error)
    assert conn.refused_notes == len(BAD_NOTES)

    await gpushare_app.poll_once()
    assert node.pids() == before  # no byte accounted or freed on a bad request's behalf
    info = await kernel_status(jp_fetch, k.id)
    for key in ("state", "pinned", "idle_timeout", "gpu_memory_bytes"):
        assert info[key] == info_before[key]
    # the agent's own report (asked every poll) still counts what the cell holds, and only that
    assert conn.report["simulated_bytes"] == 64 << 20 and not conn.closed.is_set()
    assert "same data" in (await k.run(same_data())).stdout


async def test_a_malformed_reply_fails_the_release_cleanly(jp_fetch, kernels, gpushare_app):
    """An agent that answers the checkpoint with a wrong-typed field: the release fails with
    the reason (409, never a 500), nothing stays "releasing", and the kernel runs on."""
    from tornado.httpclient import HTTPClientError

    k = await kernels.start()
    await k.run(hold(64) + "\n" + AGENT + "agent.client.handlers['sim_checkpoint'] = "
                "lambda msg: {'bytes': 'lots', 'arrays': 1}")
    await gpushare_app.poll_once()
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert refused.value.code == 409
    assert ("bad reply from the agent to sim_checkpoint: bytes must be an integer, got 'lots'"
            in refused.value.response.body.decode())
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] not in ("releasing", "released") and "got 'lots'" in info["error"]
    assert "same data" in (await k.run(same_data(), timeout=20)).stdout  # unlocked, running


BAD_MAPPINGS = [
    ({"0": 1}, "gpu_mapping must be a list of [from, to] pairs of GPU indices, got {'0': 1}"),
    ([[0, 1, 2]], "gpu_mapping must be a list of [from, to] pairs of GPU indices, got [0, 1, 2] in it"),
    ([[0, "1"]], "gpu_mapping must be a list of [from, to] pairs of GPU indices, got [0, '1'] in it"),
    ([[0, True]], "gpu_mapping must be a list of [from, to] pairs of GPU indices, got [0, True] in it"),
    ([[0, 7]], "gpu_mapping: 7 is not a GPU of this node (it has 2 simulated GPUs)"),
    ([[-1, 0]], "gpu_mapping: -1 is not a GPU of this node (it has 2 simulated GPUs)"),
    ([[0, 1], [0, 0]], "gpu_mapping: GPU 0 is named twice as a source"),
    ([[0, 1], [1, 1]], "gpu_mapping: GPU 1 is named twice as a target"),
]


async def test_a_bad_gpu_mapping_is_refused_by_the_agent_and_changes_nothing(
    jp_fetch, kernels, gpushare_app
):
    """The agent's sim_resume with a gpu_mapping that is not [[from, to], ...] of the node's
    GPUs: an error reply that says why, the kernel stays checkpointed, nothing accounted."""
    k = await kernels.start()
    await k.run(hold(64))
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    node, conn = gpushare_app.node, gpushare_app.channel.connections[k.id]
    before = node.pids()
    for mapping, error in BAD_MAPPINGS:
        with pytest.raises(RemoteError, match=f"^{re.escape(error)}$"):
            await conn.request("sim_resume", timeout=20, gpu_mapping=mapping)
    assert node.pids() == before and not conn.closed.is_set()
    assert (await kernel_status(jp_fetch, k.id))["state"] == "released"

    assert "same data" in (await k.run(same_data(), timeout=20)).stdout  # restored as before
    await gpushare_app.poll_once()
    used = node.pids()
    with pytest.raises(RemoteError, match=r"^cannot restore onto other GPUs: process is running"):
        await conn.request("sim_resume", timeout=20, gpu_mapping=[[0, 1]])  # never left GPU 0
    assert node.pids() == used


# -- one agent's bad report affects only its own kernel -------------------------------------
def report_answer(nbytes) -> str:
    """A cell that makes this kernel's agent report ``nbytes`` of framework memory."""
    return AGENT + (
        "answer = globals().setdefault('answer', {'frameworks': ['torch']})\n"
        f"answer['framework_bytes'] = {nbytes!r}\n"
        "agent.client.handlers['report'] = lambda msg: dict(answer)"
    )


@pytest.mark.parametrize("gpushare_config", [{"backend": "auto"}])
async def test_one_agents_bad_report_leaves_the_other_kernels_tracking_intact(
    fake_nvml, jp_fetch, kernels, gpushare_app
):
    """NVML shows pids of another namespace (a container), so memory is attributed from the
    agents' own reports. A garbage report is refused and the kernel keeps its last one; the
    poll goes on for every other kernel (before, it aborted for all of them)."""
    a, b = await kernels.start(), await kernels.start()
    await a.run(report_answer(512 * MiB))
    await b.run(report_answer(1 * GiB))
    fake_nvml.gpus[0].processes = [FakeProcess(2**22 + 12345, 3 * GiB)]
    for _ in range(2):
        await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, a.id))["gpu_memory_bytes"] == 512 * MiB
    assert (await kernel_status(jp_fetch, b.id))["gpu_memory_bytes"] == 1 * GiB

    await a.run(report_answer("lots"))
    await b.run(report_answer(2 * GiB))
    await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, a.id))["gpu_memory_bytes"] == 512 * MiB  # the last good one
    assert (await kernel_status(jp_fetch, b.id))["gpu_memory_bytes"] == 2 * GiB
    conn = gpushare_app.channel.connections[a.id]
    assert conn.report == {"framework_bytes": 512 * MiB, "frameworks": ["torch"]}

    ex = await a.run(AGENT + "from jupyter_gpushare.protocol import RemoteError\ntry:\n"
                     "    agent.client.request('report', framework_bytes=-1)\n"
                     "except RemoteError as e:\n    print(e)")
    assert ex.stdout == "framework_bytes must be >= 0, got -1\n"
    assert conn.report["framework_bytes"] == 512 * MiB


# -- a request the server gave up on never runs late ------------------------------------------
async def test_a_request_past_its_deadline_is_not_run(kernels, gpushare_app):
    """A lock queued behind another on the agent's handler thread, whose asker timed out:
    run late, it would lock the kernel's GPU with nobody left to unlock it."""
    k = await kernels.start()
    await k.run(hold(64) + "\nimport threading, time\nfrom jupyter_gpushare.sim.device import get_device\n"
                "burn = threading.Thread(target=simgpu.burn, args=(2.0,))\nburn.start()\n"
                "while not get_device()._inflight:\n    time.sleep(0.01)")
    conn = gpushare_app.channel.connections[k.id]
    first = asyncio.ensure_future(conn.request("sim_lock", timeout=20, lock_timeout=0.5))
    await asyncio.sleep(0)  # let it be sent first
    with pytest.raises(asyncio.TimeoutError):  # waits in line behind the first
        await conn.request("sim_lock", timeout=0.2, lock_timeout=20)
    with pytest.raises(RemoteError, match="GPU work still running after the lock timeout"):
        await first
    with pytest.raises(RemoteError, match=f"^{re.escape(EXPIRED)}$"):
        await conn.request("sim_lock", timeout=20, deadline=time.time() - 1, lock_timeout=1)

    ex = await k.run("burn.join()\n" + same_data() + "\nprint(get_device().state)", timeout=20)
    assert ex.stdout == "same data\nrunning\n"


# -- reconnection ------------------------------------------------------------------------------
async def test_removed_socket_is_bound_again_and_a_dropped_agent_reconnects_with_its_memory(
    jp_fetch, kernels, gpushare_app, caplog
):
    caplog.set_level(logging.WARNING, logger="jupyter_gpushare.server.channel")
    channel, node = gpushare_app.channel, gpushare_app.node
    k = await kernels.start()
    await k.run(hold(256))
    pid = gpushare_app.tracker.kernel_pid(k.id)
    assert node.held_by(pid) == {0: 256 * MiB}

    os.unlink(channel.path)  # an admin cleans the runtime directory ...
    old = channel.connections[k.id]
    old._close()  # ... and the channel drops
    await wait_for(lambda: channel.connections.get(k.id) is not old, what="the server to see the drop")
    await gpushare_app.poll_once()  # the socket file is back on the next poll
    assert channel.rebinds == 1 and stat.S_IMODE(os.stat(channel.path).st_mode) == 0o600
    assert sum("was removed or replaced; listening there again" in r.getMessage()
               for r in caplog.records) == 1

    await wait_for(lambda: k.id in channel.connections, what="the agent to reconnect")
    assert channel.connections[k.id] is not old
    assert node.held_by(pid) == {0: 256 * MiB}  # the process still holds its memory
    await gpushare_app.poll_once()
    assert channel.rebinds == 1  # all well: nothing to do
    assert (await kernel_status(jp_fetch, k.id))["gpu_memory_bytes"] == 256 * MiB

    # managed again: released and restored with its data intact
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert node.used(0) == 0
    ex = await k.run(AGENT + same_data() + "\nprint(agent.client.reconnects)")
    assert ex.stdout == "same data\n1\n"
    assert node.held_by(pid) == {0: 256 * MiB}

    await jp_fetch("api", "kernels", k.id, method="DELETE")
    await gpushare_app.poll_once()
    assert node.pids() == {}  # freed when the process is gone


async def test_reconnected_agent_learns_its_state_and_its_lost_frees_are_corrected(
    jp_fetch, kernels, gpushare_app
):
    """The channel drops on the kernel's side; meanwhile a free is lost and the agent missed
    a state change. On reconnection the hello reply gives the state and the agent's sync sets
    the server's count to exactly what the process holds."""
    channel, node = gpushare_app.channel, gpushare_app.node
    k = await kernels.start()
    await k.run(hold(256) + "\n" + AGENT + "import gc, socket, time\n"
                "agent.client.handlers['probe'] = lambda msg: {'released': agent.released}\n"
                "agent.client.handlers['forget'] = lambda msg: agent.note_state('active')")
    pid = gpushare_app.tracker.kernel_pid(k.id)
    old = channel.connections[k.id]

    # the channel drops (a transient error on the kernel's side) while the kernel runs a cell
    # that frees memory: the free cannot be sent
    ex = await k.run("agent.client.backoff = (1.0, 5.0)  # the free below happens first\n"
                     "agent.client._sock.shutdown(socket.SHUT_RDWR)\n"
                     "while agent.client.connected:\n    time.sleep(0.01)\n"
                     "gone = x.pop(); x_sum.pop(); del gone\ngc.collect()\n"
                     "print(simgpu.memory_allocated(), agent.client.connected)")
    assert ex.stdout == f"{192 * MiB} False\n"
    await wait_for(lambda: channel.connections.get(k.id) not in (None, old), what="reconnection")
    await wait_for(lambda: node.held_by(pid) == {0: 192 * MiB}, what="the sync")

    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    conn = channel.connections[k.id]
    assert (await conn.request("probe"))["released"] is True
    await conn.request("forget")  # as if the "released" notification had been lost
    assert (await conn.request("probe"))["released"] is False
    conn._close()
    await wait_for(lambda: channel.connections.get(k.id) not in (None, conn), what="reconnection")
    assert (await channel.connections[k.id].request("probe"))["released"] is True

    ex = await k.run(same_data())
    assert ex.stdout == "same data\n"
    assert node.held_by(pid) == {0: 192 * MiB}
    assert gpushare_app.controller.states[k.id].state == "active"


# -- the simulated node -----------------------------------------------------------------------
def test_set_usage_is_all_or_nothing_and_dead_pids_are_dropped():
    node = SimNode((1 * GiB, 1 * GiB))
    node.alloc(101, 0, 512 * MiB)
    node.alloc(102, 1, 256 * MiB)
    node.busy_begin(102, 1)
    with pytest.raises(MemoryError, match=re.escape("cannot hold 768.0 MiB for pid 102: 512.0 MiB free")):
        node.set_usage(102, {1: 1, 0: 768 * MiB})
    with pytest.raises(ValueError, match="invalid device 2"):
        node.set_usage(102, {0: 1, 2: 1})
    assert node.pids() == {101: {0: 512 * MiB}, 102: {1: 256 * MiB}}
    node.set_usage(102, {0: 128 * MiB})
    assert node.pids() == {101: {0: 512 * MiB}, 102: {0: 128 * MiB}}
    assert node.drop_gone(lambda pid: pid != 102) == [102]
    assert node.pids() == {101: {0: 512 * MiB}}
    assert node.busy_fraction(102, 1, 0, time.time() + 1) == 0


def test_a_socket_in_a_directory_made_for_it_leaves_no_directory_behind(tmp_path):
    """A runtime directory too deep for AF_UNIX gets the socket in a private temporary
    directory; removing the socket removes that directory too (nothing piles up in /tmp)."""
    from jupyter_gpushare.server.channel import AgentServer, socket_path

    async def allow(kernel_id: str, pid: int) -> None:
        return None

    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    path = socket_path(str(deep))
    assert not path.startswith(str(deep)) and os.path.isdir(os.path.dirname(path))
    server = AgentServer(path, allow, {})
    server.bind()
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    server.close_now()
    server.remove_file()
    assert not os.path.exists(os.path.dirname(path))


def test_a_server_abandoned_after_its_event_loop_ended_closes_its_agents_sockets(tmp_path):
    """A server left for another one in the same process after its event loop has ended (as
    pytest-jupyter leaves each test's server) closes its agents' sockets when dropped, not
    the garbage collector later with a ResourceWarning (an error in the next test)."""
    import gc
    import socket
    import warnings

    from jupyter_gpushare.server.channel import AgentServer

    async def allow(kernel_id: str, pid: int) -> None:
        return None

    path = str(tmp_path / "a.sock")
    box = {"server": AgentServer(path, allow, {})}  # dropped below: all it held is collected
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = asyncio.new_event_loop()

    async def connect() -> None:
        await box["server"].start()
        client.connect(path)
        client.sendall(encode({"id": 0, "op": "hello", "kernel_id": "k1", "pid": os.getpid(),
                               "frameworks": []}))
        deadline = time.monotonic() + 10
        while "k1" not in box["server"].connections:
            assert time.monotonic() < deadline, "the agent's hello was not accepted"
            await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(connect())
    finally:
        loop.close()  # the loop ends with the server still serving
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box["server"].close_now()
        box.clear()
        gc.collect()
    client.close()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
