"""A cell that ran out of memory, where its server's own idle kernels cannot make room, asks
the hub service: what the server sends, and what the cell says when the service takes longer
than the kernel waits, or makes no room. A real server and real kernels on the simulated
node; the hub service is a small HTTP app on a local port, answering as the service's
``api/oom`` does (tests/test_hub.py runs the whole path with a real JupyterHub and service).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from .scenarios import MiB, hold

#: one 256 MiB GPU and a second; the product's release policy and pressure threshold
NODE = {"simulated_gpus": [256 * MiB, 256 * MiB], "release_policy": "needs",
        "idle_timeout": 3600, "pressure_free_fraction": 0.1, "pressure_idle_timeout": 120}
ALLOC = ("from jupyter_gpushare.sim import simgpu\n"
         "y = simgpu.zeros(({mib} * 2**18,), dtype='float32', device=0)")


class Service:
    """What the service was asked, and how it answers ``api/oom`` (after ``delay`` s)."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []
        self.delay = 0.0
        self.answer: dict[str, Any] = {"released": [], "why_not": None}
        sock, self.port = bind_unused_port()
        self.sock = sock

    def start(self) -> HTTPServer:
        service = self

        class OutOfMemory(web.RequestHandler):
            async def post(self) -> None:
                service.asked.append({"auth": self.request.headers.get("Authorization"),
                                      **json.loads(self.request.body)})
                await asyncio.sleep(service.delay)
                self.finish(service.answer)

        class Other(web.RequestHandler):  # api/me, api/placed, ...: nothing to say
            def get(self, *_: Any) -> None:
                self.finish({})

            def post(self, *_: Any) -> None:
                self.finish({})

        app = web.Application([(r"/services/gpushare/api/oom", OutOfMemory),
                               (r"/services/gpushare/(.*)", Other)])
        server = HTTPServer(app)
        server.add_sockets([self.sock])
        return server


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "server-token")
    return Service()


@pytest.fixture
def jp_server_config(jp_server_config, service):
    url = f"http://127.0.0.1:{service.port}/services/gpushare/"
    return {**jp_server_config, "GPUShareHubLink": {"url": url, "refresh_interval": 60}}


async def active_holder(kernels, mib: int = 192):
    """A kernel of this server holding ``mib`` MiB of GPU 0, just used: make-room may not
    take it, so this server has no idle kernel to release there."""
    a = await kernels.start()
    await a.run(hold(mib, name="a", chunk=64))
    return a


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_a_service_slower_than_the_kernel_waits_is_said_and_its_releases_go_on(
    kernels, gpushare_app, service
):
    server = service.start()
    try:
        service.delay = 8.0  # its releases take longer than the agent's 5 s
        await active_holder(kernels)
        b = await kernels.start()
        ex = await b.run(ALLOC.format(mib=128), ok=False)  # 64 MiB free
        assert ex.error is not None and ex.error["ename"] == "SimOutOfMemoryError", ex.error
        assert ("gpushare: GPU 0 was short of memory: the hub service is releasing idle kernels "
                "of other people: run the cell again in a moment") in ex.stderr, ex.stderr
        uuid = gpushare_app.tracker.gpus[0].info.uuid
        assert service.asked == [{"auth": "token server-token", "server": "", "kernel": b.id,
                                  "gpu": uuid, "bytes": 128 * MiB}], service.asked
    finally:
        server.stop()


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_why_the_service_made_no_room_is_said_after_the_servers_own_reason(
    kernels, gpushare_app, service
):
    server = service.start()
    try:
        service.answer = {"released": [], "why_not": "GPU 0 is full; the other kernel on it is active"}
        await active_holder(kernels)
        b = await kernels.start()
        ex = await b.run(ALLOC.format(mib=128), ok=False)
        assert ("gpushare: GPU 0 is short of memory and no idle kernel there can be released "
                "(1 kernel: 1 active)\n"
                "gpushare: the hub service made no room on GPU 0: GPU 0 is full; the other "
                "kernel on it is active") in ex.stderr, ex.stderr
        server.stop()  # a service that does not answer: the server's own reason, and that
        ex = await b.run(ALLOC.format(mib=128), ok=False)
        assert "gpushare: the hub service did not answer for GPU 0" in ex.stderr, ex.stderr
        assert len(service.asked) == 1
    finally:
        server.stop()
