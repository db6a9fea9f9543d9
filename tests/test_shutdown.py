"""Stopping the server (SIGTERM) while its kernels are in every state: it exits cleanly, the
kernels it can bring back are restored first, the ones without room are said so, and nothing
is left running, locked or half-done. A real ``jupyter server`` in a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil

from benchmarks._server import GiB, Server

MiB = 1 << 20


def _hold(mib: int, name: str, device: int = 0) -> str:
    return (
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        f"{name} = simgpu.array(np.arange({mib * MiB // 4}, dtype=np.uint32), device={device},"
        " copy=False)"
    )


async def test_sigterm_with_kernels_in_every_state_exits_cleanly():
    # GPUs of 256 MiB (1/8 of the 2 GiB this was written for: every byte is copied)
    async with Server("sigterm", gpushare={"simulated_gpus": [GiB // 4, GiB // 4], "idle_timeout": 0,
                                           "pressure_idle_timeout": 3600,
                                           "poll_interval": 0.5}) as srv:
        active = await srv.start_kernel()
        await active.run(_hold(32, "a"))
        has_room = await srv.start_kernel()
        await has_room.run(_hold(32, "b"))
        no_room = await srv.start_kernel()
        await no_room.run(_hold(160, "c"))
        releasing = await srv.start_kernel()
        await releasing.run(_hold(192, "d", device=1)  # its release is in flight at SIGTERM
                            + "\nfrom jupyter_gpushare.sim import device\n"
                            "_stall = device.get_device().stall('checkpoint', seconds=2.0)")
        for k in (has_room, no_room):
            await srv.wait_kernel(k.id, lambda v: v["gpu_memory_bytes"] > 0, "memory seen")
            await srv.api("POST", f"/api/gpushare/kernels/{k.id}/release")
        await active.run(_hold(160, "e"))  # now no_room's state cannot come back
        await srv.wait_kernel(releasing.id, lambda v: v["gpu_memory_bytes"] > 0, "memory seen")
        release = asyncio.ensure_future(
            srv.api("POST", f"/api/gpushare/kernels/{releasing.id}/release"))
        waiting = asyncio.ensure_future(no_room.execute("print('never')", timeout=60))
        await srv.wait_kernel(no_room.id, lambda v: bool(v["waiting"]), "a restore waiting")

        srv._note_tree()
        kernels = [p for p in srv.kernel_processes() if p.pid != srv.pid]
        socket_files = [f for f in os.listdir(os.path.join(srv.tmp, "rt")) if f.endswith(".sock")]
        assert socket_files
        srv.proc.send_signal(signal.SIGTERM)
        exit_code = await asyncio.wait_for(asyncio.to_thread(srv.proc.wait), 90)
        for task in (release, waiting):
            task.cancel()
        await asyncio.gather(release, waiting, return_exceptions=True)

        log = open(srv.log_path, errors="replace").read()
        assert exit_code == 0, srv.log_tail()
        assert "Traceback" not in log, log
        assert "Task was destroyed but it is pending" not in log, log
        assert "(shutdown)" in log  # the kernel with room was restored before the end
        assert f"at shutdown kernel {no_room.id} stays released" in log, log
        assert not [f for f in os.listdir(os.path.join(srv.tmp, "rt")) if f.endswith(".sock")]
        _, alive = psutil.wait_procs(kernels, timeout=20)
        assert not alive, [p.pid for p in alive]
