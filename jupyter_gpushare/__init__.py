"""jupyter-gpushare: reclaim idle GPU memory from Jupyter kernels, restore it before the next cell.

This module only exposes entry points; importing it touches no hardware.
"""

from typing import Any

from ._version import __version__


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .server.app import GPUShareApp

    return [{"module": "jupyter_gpushare.server.app", "app": GPUShareApp}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "jupyter-gpushare"}]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext jupyter_gpushare`: the agent and magics in any IPython."""
    from .kernel import load_ipython_extension as load

    load(ipython)


__all__ = ["__version__"]
