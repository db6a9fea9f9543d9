"""Runs inside the kernel: the agent and the %gpushare magics."""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    from .agent import load
    from .magics import register

    load(ipython)
    register(ipython)
