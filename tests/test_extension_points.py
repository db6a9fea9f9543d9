"""A release method and a telemetry backend from another package, through entry points.

The toy package below is a real installed-looking distribution: a module and a
``gpushare_toy-1.0.dist-info`` folder (METADATA, entry_points.txt) on ``sys.path``, as pip
leaves them. What adding a method or a backend takes:

- a release method: its own module (a ``ReclaimMethod`` subclass) + one line under
  ``[jupyter_gpushare.release_methods]`` in its package's entry points;
- a telemetry backend: its own module (a ``Telemetry`` subclass, with the server hooks it
  needs) + one line under ``[jupyter_gpushare.telemetry_backends]``;

that is 2 files of its own package (module, packaging metadata), 0 files of jupyter_gpushare.
A real server with the extension then takes them by name (``c.GPUShareApp.release_method``,
``c.GPUShareApp.backend``) and the REST API says they are in use; a plug-in that fails to
import is not available, with the reason, and the server runs on; a plug-in named like a
built-in is ignored with a warning.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpushare import doctor
from jupyter_gpushare.reclaim import MethodContext
from jupyter_gpushare.server import provisioner, selection
from jupyter_gpushare.server.app import GPUShareApp

from .helpers import KernelFactory

TOY_MODULE = '''
"""A release method and a telemetry backend of another package."""
import os

from jupyter_gpushare.reclaim import ReclaimMethod, ReclaimResult, Support
from jupyter_gpushare.telemetry import GPUInfo, Telemetry, TelemetryStatus

GiB = 1 << 30


class ToyMethod(ReclaimMethod):
    name = "toymethod"
    needs_agent = False
    auto_rank = -1  # never chosen by "auto" over the built-ins

    def support(self):
        return Support(True, "the toy method works anywhere")

    async def release(self, target, progress=None):
        return ReclaimResult(sum(target.gpu_bytes.values()), 0.0, "toy")

    async def restore(self, target, progress=None):
        return ReclaimResult(sum(target.gpu_bytes.values()), 0.0, "toy")


class ToySource(Telemetry):
    """One toy GPU, and every server hook."""

    name = "toysource"
    label = "the toy source"

    def open(self):
        return self.status()

    def close(self):
        pass

    def status(self):
        return TelemetryStatus(self.name, True, details={"gpus": "1"})

    def devices(self):
        return [GPUInfo(0, "GPU-toy-0", "Toy GPU", 8 * GiB, 1 * GiB, 0.0)]

    def free_bytes(self, index):
        return 7 * GiB if index == 0 else None

    def processes(self):
        return []

    def agent_handlers(self):
        return {"toy_ping": lambda conn, msg: {"pong": msg.get("n")}}

    def hello_extra(self):
        return {"toy": "hello"}

    def launch_env(self):
        return {"GPUSHARE_TOY_SOURCE": "on"}

    def context_bytes(self, configured):
        return 123

    def shares_node_locks(self):
        return False
'''

# a module of the same package whose import fails (a dependency that is not installed)
BROKEN_MODULE = '''
import gpushare_toy_dependency_that_is_not_installed  # noqa: F401
'''

ENTRY_POINTS = '''
[jupyter_gpushare.release_methods]
toymethod = gpushare_toy:ToyMethod
brokenmethod = gpushare_toy_broken:ToyMethod
driver = gpushare_toy:ToyMethod

[jupyter_gpushare.telemetry_backends]
toysource = gpushare_toy:ToySource
brokensource = gpushare_toy_broken:ToySource
'''


@pytest.fixture
def toy_dist(tmp_path_factory, monkeypatch):
    """The toy package, installed-looking, on sys.path for this test only."""
    root = tmp_path_factory.mktemp("site")
    (root / "gpushare_toy.py").write_text(textwrap.dedent(TOY_MODULE))
    (root / "gpushare_toy_broken.py").write_text(BROKEN_MODULE)
    info = root / "gpushare_toy-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gpushare-toy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(root))  # also invalidates the import caches
    importlib.invalidate_caches()
    monkeypatch.setattr(selection, "_warned", set())  # this test sees every warning
    yield root
    for name in ("gpushare_toy", "gpushare_toy_broken"):
        sys.modules.pop(name, None)


@pytest.fixture
def gpushare_config() -> dict:
    return {"backend": "toysource", "release_method": "toymethod"}


@pytest.fixture
def jp_server_config(toy_dist, jp_server_config):
    return jp_server_config  # the toy package is installed before the server starts


async def status(jp_fetch) -> dict:
    r = await jp_fetch("api", "gpushare", "status")
    assert r.code == 200
    return json.loads(r.body)


# -- names: what the options accept --------------------------------------------------------
def test_plugins_are_named_choices_and_a_builtin_name_stays_the_builtins(toy_dist, caplog):
    with caplog.at_level(logging.WARNING, logger="jupyter_gpushare.server.selection"):
        assert selection.method_names() == ["auto", "off", "driver", "framework", "simulated",
                                            "toymethod", "brokenmethod"]
        assert selection.backend_names() == ["auto", "nvml", "simulated", "toysource",
                                             "brokensource"]
        assert selection.methods()["driver"] == "jupyter_gpushare.reclaim.driver:DriverMethod"
    ignored = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert ignored == ['gpushare: the plug-in release method "driver" = gpushare_toy:ToyMethod '
                       '(from gpushare-toy 1.0) is ignored: "driver" is built in']
    app = GPUShareApp(config=Config({"GPUShareApp": {"backend": "toysource",
                                                     "release_method": "toymethod"}}))
    assert (app.backend, app.release_method) == ("toysource", "toymethod")
    assert app.telemetry_class.__name__ == "ToySource"


@pytest.mark.parametrize("name", ["backend", "release_method"])
def test_an_unknown_name_is_refused_with_what_is_available(toy_dist, name):
    with pytest.raises(TraitError) as e:
        GPUShareApp(config=Config({"GPUShareApp": {name: "toysourc"}}))
    message = str(e.value)
    assert f"GPUShareApp.{name} must be one of" in message and "not 'toysourc'" in message
    assert '"toymethod"' in message if name == "release_method" else '"toysource"' in message


def test_no_plugin_no_change():
    """Without the toy package, the names are the built-ins alone."""
    assert selection.method_names() == ["auto", "off", "driver", "framework", "simulated"]
    assert selection.backend_names() == ["auto", "nvml", "simulated"]
    assert [c.name for c in doctor.collect("simulated")].count("plug-ins") == 0


def test_a_broken_method_is_unusable_with_its_reason(toy_dist):
    choice = selection.choose_method("brokenmethod", "toysource", MethodContext())
    assert choice.name == "off"
    assert choice.reason.startswith("release_method = brokenmethod, but gpushare_toy_broken:"
                                    "ToyMethod failed to load (ModuleNotFoundError: ")
    assert "gpushare_toy_dependency_that_is_not_installed" in choice.reason
    auto = selection.choose_method("auto", "simulated", MethodContext())
    assert auto.name == "simulated" and "brokenmethod" in auto.unusable


def test_the_doctor_lists_the_plugins_and_their_trouble(toy_dist):
    report = doctor.diagnose("brokensource", "toymethod")
    checks = {c.name: c for c in report.checks}
    plugins = checks["plug-ins"]
    assert plugins.ok is False
    assert 'release method "toymethod" = gpushare_toy:ToyMethod (from gpushare-toy 1.0); ' \
        in plugins.detail
    assert 'release method "driver" = gpushare_toy:ToyMethod (from gpushare-toy 1.0): ' \
        'ignored: "driver" is built in' in plugins.detail
    assert 'telemetry backend "brokensource" = gpushare_toy_broken:ToySource ' \
        '(from gpushare-toy 1.0): gpushare_toy_broken:ToySource failed to load' in plugins.detail
    assert checks["telemetry backend"].ok is False
    assert report.backend_reason.startswith("configured, but gpushare_toy_broken:ToySource "
                                            "failed to load (ModuleNotFoundError")
    assert (report.method, report.method_reason) == ("toymethod", "configured")


# -- a real server with the toy method and the toy backend -------------------------------
async def test_the_server_uses_the_plugin_method_and_backend(
    capsys, jp_fetch, jp_ws_fetch, gpushare_app
):
    st = await status(jp_fetch)
    assert (st["backend"], st["method"], st["available"]) == ("toysource", "toymethod", True)
    assert [(g["index"], g["name"], g["memory_total"]) for g in st["gpus"]] == \
        [(0, "Toy GPU", 8 << 30)]
    assert type(gpushare_app.telemetry).__module__ == "gpushare_toy"
    # every hook the toy source overrides is what the server uses
    assert gpushare_app.channel.handlers["toy_ping"](None, {"n": 3}) == {"pong": 3}
    assert gpushare_app.channel.hello_extra == {"restore_mode": "eager", "toy": "hello"}
    assert provisioner.settings is not None
    assert provisioner.settings.source_env == {"GPUSHARE_TOY_SOURCE": "on"}
    assert gpushare_app.controller.context_bytes == 123
    assert gpushare_app._node_locks() is None  # shares_node_locks() is False
    assert gpushare_app.node is None  # no simulated node
    # a kernel the server starts gets the source's launch environment, and its agent
    factory = KernelFactory(jp_fetch, jp_ws_fetch, gpushare_app)
    try:
        k = await factory.start()
        ex = await k.run("import os\nprint(os.environ.get('GPUSHARE_TOY_SOURCE'))")
        assert ex.stdout == "on\n"
    finally:
        await factory.close()
    log = capsys.readouterr().err  # what the server logged (capsys came first)
    assert "gpushare: telemetry backend toysource (configured)" in log
    assert "gpushare: release method toymethod (configured)" in log


@pytest.mark.parametrize("gpushare_config", [
    {"backend": "toysource", "release_method": "brokenmethod"},
])
async def test_a_method_that_fails_to_import_is_refused_and_the_server_runs(
    capsys, jp_fetch, gpushare_app
):
    st = await status(jp_fetch)
    assert (st["backend"], st["method"], st["available"]) == ("toysource", "off", True)
    r = await jp_fetch("api", "status")  # the server itself
    assert r.code == 200
    assert "gpushare: release_method = brokenmethod, but gpushare_toy_broken:ToyMethod failed to load " \
        "(ModuleNotFoundError: No module named 'gpushare_toy_dependency_that_is_not_installed')" \
        "; nothing is released" in capsys.readouterr().err


@pytest.mark.parametrize("gpushare_config", [
    {"backend": "brokensource", "release_method": "toymethod"},
])
async def test_a_backend_that_fails_to_import_is_unavailable_and_the_server_runs(
    jp_fetch, jp_ws_fetch, gpushare_app
):
    st = await status(jp_fetch)
    assert (st["backend"], st["method"], st["available"]) == ("brokensource", "toymethod", False)
    assert st["reason"].startswith("gpushare_toy_broken:ToySource failed to load "
                                   "(ModuleNotFoundError: No module named ")
    assert st["gpus"] == []
    factory = KernelFactory(jp_fetch, jp_ws_fetch, gpushare_app)
    try:  # kernels still start and run, with their agent
        k = await factory.start()
        assert (await k.run("print(6 * 7)")).stdout == "42\n"
    finally:
        await factory.close()


def test_the_toy_files_are_all_it_takes(toy_dist: Path):
    """The toy package is one module per plug-in and its metadata: nothing of
    jupyter_gpushare names it."""
    import jupyter_gpushare

    package = Path(jupyter_gpushare.__file__).parent
    named = [p for p in package.rglob("*.py") if "toymethod" in p.read_text()
             or "toysource" in p.read_text()]
    assert named == []
    assert sorted(p.name for p in toy_dist.iterdir()) == \
        ["gpushare_toy-1.0.dist-info", "gpushare_toy.py", "gpushare_toy_broken.py"]
