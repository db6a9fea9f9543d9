"""The gpushare JupyterHub service: one view of every user's GPU memory, fair shares, and
room made across users for a waiting restore. ``python -m jupyter_gpushare.hub``."""

from __future__ import annotations

__all__ = ["GPUShareHub", "main"]


def __getattr__(name: str):  # jupyterhub is imported only when the service is used
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
