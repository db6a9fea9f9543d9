"""Jupyter server configuration for the jupyter-gpushare UI tests (galata).

Runs JupyterLab on the simulated GPU node (two simulated GPUs) with a short poll interval.
Never use this configuration in production: galata turns off authentication.
"""

import os

from jupyterlab.galata import configure_jupyter_server

configure_jupyter_server(c)  # noqa: F821 (c is provided by the config loader)

c.ServerApp.port = int(os.environ.get("GPUSHARE_UI_PORT", "8895"))  # noqa: F821
c.ServerApp.allow_root = True  # noqa: F821 (CI containers run as root)
# Enabled explicitly so the tests also run from a checkout whose config.d file is not installed.
c.ServerApp.jpserver_extensions = {"jupyter_gpushare": True}  # noqa: F821
# "simulated" for the main specs; the second server of playwright.config.js uses "nvml", which
# on a machine without NVIDIA GPUs shows how the panel reports unavailable telemetry.
c.GPUShareApp.backend = os.environ.get("GPUSHARE_UI_BACKEND", "simulated")  # noqa: F821
c.GPUShareApp.poll_interval = 0.5  # noqa: F821
c.GPUShareApp.placement = "off"  # noqa: F821  # the tests use simulated GPUs 0 and 1
# No automatic release during a test: the specs release and restore explicitly.
c.GPUShareApp.idle_timeout = 0  # noqa: F821
