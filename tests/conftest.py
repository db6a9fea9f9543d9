"""A real jupyter_server with the extension on the simulated node, and real kernels."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.sim.node import GiB

pytest_plugins = ("pytest_jupyter.jupyter_server",)

# kernels' logs stay quiet; python buffers would hide a kernel's crash
os.environ.setdefault("PYTHONUNBUFFERED", "1")
# the servers, Hubs and CLIs the tests start skip rfc3987-syntax's parser build (see the module)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).parent / "no_iri_check"), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture
def gpushare_config() -> dict:
    """Override per test (or per module) to change GPUShareApp traits."""
    return {}


@pytest.fixture
def jp_server_config(gpushare_config):
    cfg = {
        "backend": "simulated",
        "simulated_gpus": [16 * GiB, 16 * GiB],
        "poll_interval": 0.2,
        "idle_timeout": 0,  # no automatic releases unless a test asks for them
        "release_policy": "proactive",  # a test's idle_timeout is when its kernel is released
        "min_release_bytes": 0,
        "pressure_free_fraction": 0.0,
        # kernels see every GPU, numbered as the node numbers them (tests/test_placement.py
        # turns placement on)
        "placement": "off",
    }
    cfg.update(gpushare_config)
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpushare": True},
                      "reraise_server_extension_failures": True},
        "GPUShareApp": cfg,
    }


@pytest.fixture(autouse=True)
def _reset_clock():
    clock.reset()
    yield
    clock.reset()


@pytest.fixture
def jp_fetch(jp_fetch):
    """pytest-jupyter's ``jp_fetch``, checking every ``api/gpushare`` answer (errors included)
    against the REST contract (``jupyter_gpushare/server/openapi.yaml``)."""
    from .helpers import validating

    return validating(jp_fetch)


@pytest.fixture
def gpushare_app(jp_serverapp):
    return jp_serverapp.extension_manager.extension_points["jupyter_gpushare"].app


@pytest.fixture
def kernels(jp_fetch, jp_ws_fetch, gpushare_app, jp_asyncio_loop):
    """Start kernels over REST and talk to them over the websocket; all shut down after."""
    from .helpers import KernelFactory

    factory = KernelFactory(jp_fetch, jp_ws_fetch, gpushare_app)
    yield factory
    jp_asyncio_loop.run_until_complete(factory.close())


@pytest.fixture
def events(jp_serverapp) -> list[dict]:
    """Every gpushare kernel event the server emits during the test, in order."""
    from jupyter_gpushare.events import KERNEL_SCHEMA_ID

    seen: list[dict] = []

    async def listener(logger, schema_id, data):
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=KERNEL_SCHEMA_ID, listener=listener)
    return seen


@pytest.fixture
def restores(jp_serverapp) -> list[tuple[str, str]]:
    """(kernel_id, reason) of every restore, in order: which trigger restored."""
    from jupyter_gpushare.events import KERNEL_SCHEMA_ID

    seen: list[tuple[str, str]] = []

    async def listener(logger, schema_id, data):
        if data.get("action") == "restored":
            seen.append((data["kernel_id"], data.get("reason", "")))

    jp_serverapp.event_logger.add_listener(schema_id=KERNEL_SCHEMA_ID, listener=listener)
    return seen


@pytest.fixture
def fake_nvml(monkeypatch):
    """NVML faked at its library (``pynvml``): one GPU, no processes until a test adds them."""
    from .fakes.fake_pynvml import FakeGPU, FakePynvml

    fake = FakePynvml([FakeGPU(uuid="GPU-00000000-0000-0000-0000-000000000000")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.fixture
def watching():
    """The kernel agent's epoch watched, as in a kernel (kernel/offload/quiet.py): the threads
    alive now are "the kernel's"; tests bump it where a request would start and end
    (helpers.a_cell)."""
    from jupyter_gpushare.kernel.offload import quiet

    quiet.watch()
    yield
    quiet.unwatch()
