"""Loading is all or nothing, stopping is safe in any state.

A bad option, a bad environment variable, a socket directory that cannot hold the socket or
a telemetry source that fails at start leave the server exactly as stock (kernels start, run
cells and shut down over REST and the websocket, with no agent), and the log says why once.
A schema registered already, a second load, a second server in the process and a stop before
the start are no errors and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import threading

import pytest
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server.serverapp import ServerApp
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from jupyter_server.utils import url_path_join
from tornado.httpclient import HTTPClientError

from jupyter_gpushare.events import KERNEL_SCHEMA_ID, KERNEL_SCHEMA_PATH
from jupyter_gpushare.server import app as app_module
from jupyter_gpushare.server import provisioner
from jupyter_gpushare.server.app import GPUShareApp
from jupyter_gpushare.server.gate import SETTINGS_KEY, GateConnection
from jupyter_gpushare.telemetry import Telemetry, TelemetryStatus

from .helpers import KernelFactory, wait_for

BASE = {"backend": "simulated", "poll_interval": 0.2, "idle_timeout": 0, "min_release_bytes": 0}
PKG_LOGGER = logging.getLogger("jupyter_gpushare")


class TelemetryThatFails(Telemetry):
    """A source whose start raises (a broken driver binding, a bug in a custom source)."""

    name = "broken"

    def open(self) -> TelemetryStatus:
        raise RuntimeError("the device library crashed")

    def close(self) -> None:
        pass

    def status(self) -> TelemetryStatus:
        return TelemetryStatus(self.name, False, "never opened")

    def devices(self) -> list:
        return []

    def free_bytes(self, index: int) -> int | None:
        return None

    def processes(self) -> list:
        return []


@pytest.fixture
def setup(request) -> dict:
    """Per test: {"config": GPUShareApp options (None: unset), "env": environment,
    "socket_dir_file": bool, "extensions": more server extensions, "server": ServerApp options}."""
    return getattr(request, "param", {})


@pytest.fixture
def stock() -> dict:
    """What the process looks like before the server loads the extension."""
    return {
        "provisioner": KernelProvisionerFactory.instance().default_provisioner_name,
        "settings": provisioner.settings,
        "log": (list(PKG_LOGGER.handlers), PKG_LOGGER.propagate, PKG_LOGGER.level),
    }


@pytest.fixture
def jp_server_config(setup, monkeypatch, request):
    for key, value in setup.get("env", {}).items():
        monkeypatch.setenv(key, value)
    config = {k: v for k, v in {**BASE, **setup.get("config", {})}.items() if v is not None}
    if setup.get("socket_dir_file"):  # a "directory" that is a file: nothing can go under it
        short = tempfile.mkdtemp(prefix="gs-")  # short: AF_UNIX paths are at most 108 bytes
        request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
        blocker = os.path.join(short, "file")
        open(blocker, "w").close()
        config["socket_dir"] = os.path.join(blocker, "sockets")
    server = {"jpserver_extensions": {"jupyter_gpushare": True, **setup.get("extensions", {})},
              "reraise_server_extension_failures": False, **setup.get("server", {})}
    return {"ServerApp": server, "GPUShareApp": config}


def ext(serverapp: ServerApp) -> GPUShareApp:
    return serverapp.extension_manager.extension_points["jupyter_gpushare"].app


def sockets(directory: str) -> list[str]:
    return glob.glob(os.path.join(directory, "gpushare-*.sock"))


def assert_stock(serverapp: ServerApp, stock: dict) -> None:
    """Nothing of the extension is left in the server or the process."""
    assert KernelProvisionerFactory.instance().default_provisioner_name == stock["provisioner"]
    assert provisioner.settings is stock["settings"]
    assert serverapp.kernel_websocket_connection_class is ZMQChannelsWebsocketConnection
    settings = serverapp.web_app.settings
    assert settings.get("kernel_websocket_connection_class", ZMQChannelsWebsocketConnection) \
        is ZMQChannelsWebsocketConnection
    assert SETTINGS_KEY not in settings
    assert (list(PKG_LOGGER.handlers), PKG_LOGGER.propagate, PKG_LOGGER.level) == stock["log"]
    assert sockets(serverapp.runtime_dir) == []
    assert app_module._active is None
    assert not [t for t in threading.enumerate() if t.name.startswith("gpushare-sample")]


async def assert_kernels_work_as_stock(jp_fetch, jp_ws_fetch, serverapp: ServerApp) -> None:
    """A kernel and a session start over REST, run a cell over the websocket, shut down;
    the kernel has no gpushare agent in it."""
    factory = KernelFactory(jp_fetch, jp_ws_fetch, ext(serverapp))
    try:
        k = await factory.start(agent=False)
        ex = await k.run("import sys\nprint(6 * 7, 'jupyter_gpushare' in sys.modules)")
        assert ex.stdout == "42 False\n"
        r = await jp_fetch("api", "sessions", method="POST", body=json.dumps(
            {"path": "a.ipynb", "type": "notebook", "kernel": {"name": "python3"}}))
        assert r.code == 201
        session = json.loads(r.body)
        r = await jp_fetch("api", "sessions", session["id"], method="DELETE")
        assert r.code == 204
    finally:
        await factory.close()
    assert serverapp.kernel_manager.list_kernel_ids() == []


def said_once(capsys, words: str) -> str:
    """The server's log (on stderr while it initializes) says once why gpushare is off."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "gpushare is off" in ln and "ExtensionOff:" not in ln]
    assert len(lines) == 1, err
    assert words in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def not_routed(http_server_client, jp_auth_header, jp_base_url):
    """Asserts that the gpushare REST API is not there (jupyter_server's own 404)."""

    async def check() -> None:
        with pytest.raises(HTTPClientError) as e:
            await http_server_client.fetch(url_path_join(jp_base_url, "api/gpushare/status"),
                                           headers=jp_auth_header)
        assert e.value.code == 404

    return check


# -- a load that fails leaves the server stock ------------------------------------------------
@pytest.mark.parametrize("setup, words", [
    ({"config": {"idle_timeout": -1}}, "GPUShareApp.idle_timeout must be >= 0"),
    ({"config": {"release_method": "magic"}}, "GPUShareApp.release_method must be one of"),
], indirect=["setup"])
async def test_a_bad_option_leaves_the_server_stock(
    capsys, stock, jp_serverapp, jp_fetch, jp_ws_fetch, not_routed, words
):
    said_once(capsys, words)
    assert_stock(jp_serverapp, stock)
    await not_routed()
    await assert_kernels_work_as_stock(jp_fetch, jp_ws_fetch, jp_serverapp)


@pytest.mark.parametrize("setup", [
    {"config": {"backend": None}, "env": {"JUPYTER_GPUSHARE_BACKEND": "NVML"}},
], indirect=True)
async def test_a_bad_backend_environment_variable_leaves_the_server_stock(
    capsys, stock, jp_serverapp, jp_fetch, jp_ws_fetch
):
    line = said_once(capsys, "JUPYTER_GPUSHARE_BACKEND must be one of")
    assert "(did you mean \"nvml\"?)" in line
    assert_stock(jp_serverapp, stock)
    await assert_kernels_work_as_stock(jp_fetch, jp_ws_fetch, jp_serverapp)


@pytest.mark.parametrize("setup", [{"socket_dir_file": True}], indirect=True)
async def test_a_socket_directory_that_cannot_hold_the_socket_leaves_the_server_stock(
    capsys, stock, jp_serverapp, jp_fetch, jp_ws_fetch, not_routed
):
    said_once(capsys, "cannot create the agent socket")
    assert_stock(jp_serverapp, stock)
    await not_routed()
    await assert_kernels_work_as_stock(jp_fetch, jp_ws_fetch, jp_serverapp)


@pytest.mark.parametrize("setup", [
    {"config": {"telemetry_class": TelemetryThatFails}},
], indirect=True)
async def test_a_telemetry_source_that_fails_at_start_leaves_the_server_stock(
    capsys, stock, jp_serverapp, jp_fetch, jp_ws_fetch
):
    said_once(capsys, "TelemetryThatFails failed to start: RuntimeError: the device library crashed")
    assert_stock(jp_serverapp, stock)
    await assert_kernels_work_as_stock(jp_fetch, jp_ws_fetch, jp_serverapp)


# -- no errors: a schema registered already, a second load, a second server, stops -----------
class RegistersOurSchemaFirst:
    """A server extension that loads before ours and registers gpushare's event schema."""

    @staticmethod
    def _jupyter_server_extension_points() -> list[dict]:
        return [{"module": "aaa_registers_gpushare_schema"}]

    @staticmethod
    def _load_jupyter_server_extension(serverapp: ServerApp) -> None:
        serverapp.event_logger.register_event_schema(KERNEL_SCHEMA_PATH)


@pytest.fixture
def schema_first(monkeypatch):
    monkeypatch.setitem(sys.modules, "aaa_registers_gpushare_schema", RegistersOurSchemaFirst)


async def release_and_restore(jp_fetch, k, app: GPUShareApp) -> None:
    await k.run("from jupyter_gpushare.sim import simgpu\nx = simgpu.zeros((1024, 1024))")
    await app.poll_once()
    r = await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert json.loads(r.body)["state"] == "released"
    assert (await k.run("print(x.sum().get())")).stdout == "0.0\n"


@pytest.mark.parametrize("setup", [{"extensions": {"aaa_registers_gpushare_schema": True}}],
                         indirect=True)
async def test_a_schema_registered_already_and_a_second_load_are_no_errors(
    capsys, schema_first, jp_serverapp, jp_fetch, jp_ws_fetch
):
    assert KERNEL_SCHEMA_ID in jp_serverapp.event_logger.schemas.schema_ids
    app = ext(jp_serverapp)
    jp_serverapp.extension_manager.load_extension("jupyter_gpushare")  # loaded a second time
    assert "gpushare is off" not in capsys.readouterr().err
    assert sockets(jp_serverapp.runtime_dir) == [app.socket_path]
    seen: list[dict] = []

    async def listener(logger, schema_id, data):
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=KERNEL_SCHEMA_ID, listener=listener)
    factory = KernelFactory(jp_fetch, jp_ws_fetch, app)
    try:
        k = await factory.start()  # with its agent
        await release_and_restore(jp_fetch, k, app)
    finally:
        await factory.close()
    await wait_for(lambda: [e["action"] for e in seen] == ["released", "restored"], what="events")


@pytest.mark.parametrize("setup", [{}], indirect=True)
async def test_a_second_server_in_the_process_leaves_no_orphan(
    capsys, jp_serverapp, jp_configurable_serverapp
):
    first = ext(jp_serverapp)
    await first.ready()
    first_socket, first_task = first.socket_path, first.poller.task
    assert os.path.exists(first_socket) and first_task is not None

    ServerApp.clear_instance()
    second_server = jp_configurable_serverapp()  # initialized in the same process, never stopped
    second = ext(second_server)
    assert second is not first and second._phase == "loaded"
    await asyncio.sleep(0)
    assert first._phase == "stopped" and first_task.done()
    assert not os.path.exists(first_socket) and os.path.exists(second.socket_path)
    assert "the extension of the earlier server stops" in capsys.readouterr().err
    assert provisioner.settings is not None and provisioner.settings.socket_path == second.socket_path
    assert second_server.web_app.settings[SETTINGS_KEY] is second.controller

    await second.ready()  # the new server's kernels get its agent
    kid = await second_server.kernel_manager.start_kernel(kernel_name="python3")
    try:
        await wait_for(lambda: kid in second.channel.connections, what="the agent on the new server")
    finally:
        await second_server.kernel_manager.shutdown_kernel(kid, now=True)
    await second.stop_extension()
    assert not [t for t in asyncio.all_tasks() if "Poller._loop" in repr(t.get_coro())]


@pytest.mark.parametrize("setup", [{}], indirect=True)
async def test_stop_releases_everything_and_kernels_then_start_as_stock(
    stock, jp_serverapp, jp_fetch, jp_ws_fetch
):
    app = ext(jp_serverapp)
    await app.ready()
    assert jp_serverapp.kernel_websocket_connection_class is GateConnection
    assert provisioner.settings is not None and os.path.exists(app.socket_path)
    await app.stop_extension()
    await app.stop_extension()  # twice is fine
    assert app.poller.task is None and not app.poller.running
    assert_stock(jp_serverapp, stock)
    await assert_kernels_work_as_stock(jp_fetch, jp_ws_fetch, jp_serverapp)


@pytest.mark.parametrize("setup", [{}], indirect=True)
async def test_stop_before_start_is_safe(jp_serverapp, jp_fetch, jp_ws_fetch):
    loaded = ext(jp_serverapp)
    never_linked = GPUShareApp()
    await never_linked.stop_extension()
    linked_only = GPUShareApp()  # as when the server fails its own start after linking us
    linked_only._link_jupyter_server_extension(jp_serverapp)
    await linked_only.stop_extension()
    assert app_module._active is loaded  # the loaded one goes on, untouched
    factory = KernelFactory(jp_fetch, jp_ws_fetch, loaded)
    try:
        k = await factory.start()
        await release_and_restore(jp_fetch, k, loaded)
    finally:
        await factory.close()


@pytest.mark.parametrize("setup", [{"server": {"allow_origin_pat": "(unclosed"}}], indirect=True)
async def test_a_server_that_fails_its_own_start_after_linking_cleans_up(
    stock, jp_configurable_serverapp
):
    ServerApp.clear_instance()
    with pytest.raises(Exception, match="missing \\)"):  # the server's own error, not ours
        jp_configurable_serverapp()
    server = ServerApp.instance()  # linked us, then failed before loading extensions
    await server._cleanup()  # calls stop_extension on our linked, never loaded app
    assert app_module._active is None and provisioner.settings is stock["settings"]
    assert KernelProvisionerFactory.instance().default_provisioner_name == stock["provisioner"]
