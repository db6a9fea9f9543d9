"""The kernel agent: progress lines in the cell that triggered a restore (both triggers),
the environment and kernelspec overrides of kernels the server starts, and the agent
channel refusing processes that are not the kernel they claim to be."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from jupyter_gpushare import clock

from .helpers import KernelConn, get_json, kernel_status, wait_for

MiB = 1 << 20


def hold(mib: int, name: str = "x") -> str:
    return (
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        f"{name} = simgpu.array(np.arange({mib} * 1024 * 256, dtype=np.uint32) % 97, copy=False)\n"
        f"{name}_sum = {name}.checksum()"
    )



def progress_lines(ex) -> list[tuple[str, str, str]]:
    """(message type, display id, text) of the gpushare progress outputs of a cell."""
    return [(d["type"], d.get("transient", {}).get("display_id", ""), d["data"]["text/plain"])
            for d in ex.displays if d["data"].get("text/plain", "").startswith("gpushare:")]


def assert_one_transient_line(lines: list[tuple[str, str, str]]) -> None:
    """One display_data with a transient display_id, then only updates of that id."""
    assert lines, "no progress shown"
    kinds = [kind for kind, _, _ in lines]
    assert kinds == ["display_data"] + ["update_display_data"] * (len(lines) - 1), kinds
    ids = {display_id for _, display_id, _ in lines}
    assert len(ids) == 1 and next(iter(ids)).startswith("gpushare-"), ids


# -- progress in the cell ---------------------------------------------------------------
@pytest.mark.parametrize("gpushare_config, trigger", [
    ({"restore_mode": "eager"}, "gate"),
    ({"restore_mode": "lazy"}, "agent"),
])
async def test_restore_shows_one_transient_progress_line(
    trigger, jp_fetch, kernels, gpushare_app, restores
):
    k = await kernels.start()
    await k.run(hold(256))
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    ex = await k.run("assert x.checksum() == x_sum\nprint('same')")
    assert ex.stdout == "same\n"
    lines = progress_lines(ex)
    assert_one_transient_line(lines)
    assert lines[0][2] == "gpushare: restoring 256.0 MiB to GPU 0 ..."
    assert lines[-1][2].startswith("gpushare: restored 256.0 MiB in ")
    assert lines[-1][2].endswith(" s")
    assert restores == [(k.id, trigger)]

    ex = await k.run("print('no restore, no line')")
    assert progress_lines(ex) == []


async def test_agent_restores_for_clients_that_bypass_the_websocket(
    jp_fetch, kernels, gpushare_app, restores
):
    """Eager mode, a client on the kernel's own ZMQ sockets (as nbclient is): no gate sees
    the cell, so the agent's pre_run_cell restores, with progress in that client's output."""
    k = await kernels.start()
    await k.run(hold(64))
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    client = gpushare_app.serverapp.kernel_manager.get_kernel(k.id).client()
    client.start_channels()
    outputs: list[dict] = []
    try:
        reply = await client.execute_interactive(
            "assert x.checksum() == x_sum\nprint('same')", timeout=60,
            output_hook=lambda msg: outputs.append(msg))
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok"
    assert restores == [(k.id, "agent")]
    kinds = [(m["header"]["msg_type"], m["content"].get("data", {}).get("text/plain", "")
              or m["content"].get("text", "")) for m in outputs
             if m["header"]["msg_type"] in ("display_data", "update_display_data", "stream")]
    assert kinds[0] == ("display_data", "gpushare: restoring 64.0 MiB to GPU 0 ...")
    assert kinds[1][0] == "update_display_data" and kinds[1][1].startswith("gpushare: restored 64.0 MiB")
    assert kinds[2] == ("stream", "same\n")


SMALL_NODE = {"simulated_gpus": [256 * MiB, 256 * MiB], "pressure_idle_timeout": 30.0}


@pytest.mark.parametrize("gpushare_config, trigger", [
    ({**SMALL_NODE, "restore_mode": "eager"}, "gate"),
    ({**SMALL_NODE, "restore_mode": "lazy"}, "agent"),
])
async def test_restore_waiting_for_memory_says_so_and_how_much(
    trigger, jp_fetch, kernels, gpushare_app, restores
):
    a = await kernels.start()
    b = await kernels.start()
    await a.run(hold(160, "a"))
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", a.id, "release", method="POST", body=b"")
    await b.run(hold(160, "b"))  # b was just used: never evicted to make room
    await gpushare_app.poll_once()

    msg_id = a.send("assert a.checksum() == a_sum\nprint('a back')")
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="waiting")
    await b.run("del b")
    ex = await a.wait(msg_id)
    assert ex.stdout == "a back\n"
    lines = progress_lines(ex)
    assert_one_transient_line(lines)
    assert lines[0][2] == ("gpushare: waiting for memory: needs 160.0 MiB on GPU 0 (96.0 MiB free); "
                           "the cell runs once memory frees (interrupt to stop waiting)")
    assert lines[-1][2].startswith("gpushare: restored 160.0 MiB in ")
    assert restores == [(a.id, trigger)]


# -- kernel environment and kernelspec overrides -----------------------------------------
ENV_PROBE = ("import os\nprint(os.environ.get('TF_FORCE_GPU_ALLOW_GROWTH'), "
             "os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), "
             "os.environ.get('JUPYTER_GPUSHARE_SOCKET'))")


async def start_kernel(jp_fetch, jp_ws_fetch, kernels, gpushare_app, name: str) -> KernelConn:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
    kid = json.loads(r.body)["id"]
    ws = await jp_ws_fetch("api", "kernels", kid, "channels")
    conn = KernelConn(kid, ws, gpushare_app.serverapp.kernel_manager)
    kernels.started.append(conn)  # shut down with the others
    await conn.run("1")
    await wait_for(lambda: kid in gpushare_app.channel.connections, what="the agent to connect")
    return conn


@pytest.fixture
def opted_out_spec(jp_data_dir):
    """A kernelspec that sets its own TensorFlow growth and opts out of automatic release."""
    spec_dir = jp_data_dir / "kernels" / "gpu-keep"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (GPU, never released)",
        "language": "python",
        "env": {"TF_FORCE_GPU_ALLOW_GROWTH": "false"},
        "metadata": {"gpushare": {"idle_timeout": 0}},
    }))
    return "gpu-keep"


@pytest.mark.parametrize("gpushare_config", [{"idle_timeout": 60.0}])
async def test_kernels_get_env_defaults_unless_set_and_honour_kernelspec_idle_timeout(
    opted_out_spec, jp_fetch, jp_ws_fetch, kernels, gpushare_app
):
    plain = await kernels.start()
    keep = await start_kernel(jp_fetch, jp_ws_fetch, kernels, gpushare_app, opted_out_spec)

    # the agent took the channel's address out of the environment (children cannot hijack it)
    assert (await plain.run(ENV_PROBE)).stdout == "true false None\n"
    assert (await keep.run(ENV_PROBE)).stdout == "false false None\n"  # the spec's own value wins

    for k in (plain, keep):
        await k.run(hold(256))
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, keep.id)
    assert info["idle_timeout"] == 0 and info["release_in_seconds"] is None
    assert (await kernel_status(jp_fetch, plain.id))["idle_timeout"] == 60.0
    clock.advance(61)
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[plain.id].state == "released",
                   what="the plain kernel's release")
    assert gpushare_app.controller.states[keep.id].state == "idle"


# -- the channel refuses foreign processes ------------------------------------------------
CONNECT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\\n")
print(s.makefile("rb").readline().decode().strip())
"""


async def foreign_hello(path: str, line: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CONNECT, path, line,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def test_channel_refuses_a_process_that_claims_to_be_a_kernel(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(64))
    channel = gpushare_app.channel
    conn = channel.connections[k.id]
    refusals = channel.refusals

    hello = json.dumps({"id": 0, "op": "hello", "kernel_id": k.id, "pid": 1, "frameworks": []})
    reply = await foreign_hello(gpushare_app.socket_path, hello)
    assert reply["ok"] is False
    assert reply["error"].startswith("refused: pid ") and f"is not a process of kernel {k.id}" in reply["error"]
    assert channel.refusals == refusals + 1

    reply = await foreign_hello(gpushare_app.socket_path, "hello, I am a kernel")
    assert reply["ok"] is False and reply["error"].startswith("refused: no valid hello (not JSON")
    reply = await foreign_hello(gpushare_app.socket_path, json.dumps({"id": 3, "op": "hello"}))
    assert reply == {"re": 3, "ok": False,
                     "error": "refused: the first message must be a hello with a kernel_id"}
    assert channel.refusals == refusals + 3

    # nothing changed for the real kernel: same connection, still serving its GPU calls
    assert channel.connections[k.id] is conn and not conn.closed.is_set()
    await k.run(hold(64, "y") + "\nassert x.checksum() == x_sum")
    await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, k.id))["gpu_memory_bytes"] == 128 * MiB
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert [kk["id"] for kk in status["kernels"]] == [k.id]
