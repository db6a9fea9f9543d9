"""The gpushare JupyterHub service: one view of every user's GPU memory, fair shares, and
room made across users for a waiting restore. ``python -m jupyter_gpushare.hub``."""

from __future__ import annotations

from pathlib import Path

#: the jupyterhub_config.py lines that add the service, its role and the servers' link:
#: ``load_subconfig(SNIPPET)`` in jupyterhub_config.py
SNIPPET = str(Path(__file__).with_name("jupyterhub_gpushare.py"))

__all__ = ["SNIPPET", "GPUShareHub", "main"]


def __getattr__(name: str):  # jupyterhub is imported only when the service is used
    if name in ("GPUShareHub", "main"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
