"""pytest plugin for .ci/peer-suite: jupyter_server's own tests with jupyter-gpushare on.

The extension is enabled exactly as ``pip install jupyter-gpushare`` enables it: the package's
``jupyter_server_config.d/jupyter_gpushare.json`` in the environment's config path, which
pytest-jupyter points at a fresh directory per test (``jp_env_config_path``). Every test that
initializes a server is checked for the extension being loaded, so a run where it silently
failed to load cannot pass as "same as stock"; the counts go to ``$GPUSHARE_PEER_STATS``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

ENABLE = (Path(__file__).resolve().parents[2] / "jupyter-config" / "jupyter_server_config.d"
          / "jupyter_gpushare.json")
_stats: dict = {"servers": 0, "loaded": 0, "not_loaded": []}

# .ci/peer-suite sends SIGUSR1 to a run that does not end: every thread's stack to stderr
# (its log), so a hang outside any test's timeout (at exit, say) still says where it is
faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


@pytest.fixture(autouse=True)
def _gpushare_enabled_as_pip_enables_it(request):
    config_d = Path(request.getfixturevalue("jp_env_config_path")) / "jupyter_server_config.d"
    config_d.mkdir(parents=True, exist_ok=True)
    shutil.copy(ENABLE, config_d / ENABLE.name)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """While the test body runs, its server (if it made one) has the extension loaded."""
    from jupyter_server.serverapp import ServerApp

    if ServerApp.initialized():
        server = ServerApp.instance()
        manager = getattr(server, "extension_manager", None)
        if manager is not None and getattr(server, "web_app", None) is not None:
            _stats["servers"] += 1
            point = manager.extension_points.get("jupyter_gpushare")
            phase = getattr(point.app, "_phase", "") if point is not None else "not found"
            if phase in ("loaded", "starting", "running"):
                _stats["loaded"] += 1
            else:
                _stats["not_loaded"].append(f"{item.nodeid} ({phase or 'no app'})")
    yield


def pytest_sessionfinish(session):
    path = os.environ.get("GPUSHARE_PEER_STATS")
    if path:
        Path(path).write_text(json.dumps(_stats, indent=1))
