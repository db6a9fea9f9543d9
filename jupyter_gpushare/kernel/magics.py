"""`%gpushare` magics: this kernel's GPU share status and actions.

Usage::

    %gpushare                      this kernel's state, memory on GPU and host, utilization,
                                   idle time, method, next automatic release
    %gpushare release              release this kernel's GPU memory now (state kept on host)
    %gpushare restore              bring it back now (cells also restore automatically)
    %gpushare pin | unpin          never / again release this kernel automatically
    %gpushare idle-timeout SECONDS this kernel's idle timeout (0 = never; "default" = server's)
    %%gpushare release-after       run the cell, then release at once
"""

from __future__ import annotations

import html
import time
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..protocol import RemoteError
from ..sim.node import format_bytes
from . import agent as agent_module

USAGE = ("usage: %gpushare [status | release | restore | pin | unpin | idle-timeout SECONDS]  "
         "or  %%gpushare release-after")


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


class StatusView:
    """Rich (HTML table) in JupyterLab, plain text elsewhere."""

    def __init__(self, rows: list[tuple[str, str]], title: str):
        self.rows = rows
        self.title = title

    def __repr__(self) -> str:
        width = max(len(k) for k, _ in self.rows)
        return "\n".join([self.title, *(f"  {k:<{width}}  {v}" for k, v in self.rows)])

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
            f"{html.escape(v)}</td></tr>" for k, v in self.rows
        )
        return f"<table class='gpushare-status'><caption>{html.escape(self.title)}</caption>{body}</table>"


def status_rows(kernel: dict[str, Any]) -> list[tuple[str, str]]:
    util = kernel.get("sm_utilization")
    rows = [
        ("state", kernel.get("state", "?") + (" (pinned)" if kernel.get("pinned") else "")),
        ("GPU memory", format_bytes(kernel.get("gpu_memory_bytes") or 0)
         + (f" on GPU {', '.join(map(str, kernel.get('gpus') or []))}" if kernel.get("gpus") else "")),
        ("host memory (released)", format_bytes(kernel.get("released_bytes") or 0)),
        ("utilization", "-" if util is None else f"{util:.0f} % SM"),
        ("idle", _fmt_seconds(kernel.get("idle_seconds"))),
        ("method", str(kernel.get("method") or "none")),
        ("next automatic release", "never" if kernel.get("release_in_seconds") is None
         else f"in {_fmt_seconds(kernel.get('release_in_seconds'))}"),
        ("releases / restores", f"{kernel.get('releases', 0)} / {kernel.get('restores', 0)}"),
    ]
    if kernel.get("last_restore_seconds") is not None:
        rows.append(("last restore", f"{kernel['last_restore_seconds']:.2f} s"))
    if kernel.get("waiting"):
        rows.append(("waiting", kernel["waiting"]))
    if kernel.get("error"):
        rows.append(("error", kernel["error"]))
    return rows


@magics_class
class GPUShareMagics(Magics):
    @line_cell_magic
    def gpushare(self, line: str = "", cell: str | None = None) -> Any:
        """%gpushare [status|release|restore|pin|unpin|idle-timeout SECONDS]; %%gpushare release-after

        %gpushare                      this kernel's state, memory on GPU and host, utilization,
                                       idle time, method and the next automatic release time
        %gpushare release              release this kernel's GPU memory now (kept on the host)
        %gpushare restore              bring it back now (a cell restores it anyway)
        %gpushare pin / unpin          never (again) release this kernel automatically
        %gpushare idle-timeout S       this kernel's idle timeout in seconds (0 = never;
                                       "default" = the server's)
        %%gpushare release-after       run the cell, then release at once
        """
        words = line.split()
        command = words[0] if words else "status"
        if cell is not None:
            if command != "release-after" or len(words) > 1:
                print(USAGE)
                return None
            self.shell.run_cell(cell, store_history=False)
            return self._release()
        handler = {
            "status": self._status, "release": self._release, "restore": self._restore,
            "pin": lambda: self._pin(True), "unpin": lambda: self._pin(False),
        }.get(command)
        if command == "idle-timeout":
            return self._idle_timeout(words[1:])
        if handler is None or len(words) > 1:
            print(USAGE)
            return None
        return handler()

    # -- commands --------------------------------------------------------------------------
    def _client(self):
        agent = agent_module.get_agent()
        if agent is None or agent.client is None or not agent.client.connected:
            why = agent.why_offline if agent else "the gpushare agent is not loaded"
            return None, why
        return agent.client, ""

    def _ask(self, op: str, **args: Any) -> dict[str, Any] | None:
        client, why = self._client()
        if client is None:
            print(f"gpushare: no server: {why}")
            return None
        try:
            return client.request(op, timeout=None, **args)
        except (RemoteError, OSError, TimeoutError) as e:
            print(f"gpushare: {op} failed: {e}")
            return None

    def _status(self) -> Any:
        client, why = self._client()
        if client is None:
            agent = agent_module.get_agent()
            report = agent.report() if agent else {}
            rows = [("server", why),
                    ("frameworks", ", ".join(report.get("frameworks") or []) or "none imported"),
                    ("framework GPU memory", format_bytes(report.get("framework_bytes") or 0))]
            return StatusView(rows, "gpushare: this kernel (no server)")
        reply = self._ask("status")
        if reply is None:
            return None
        return StatusView(status_rows(reply["kernel"]), f"gpushare: this kernel ({reply.get('backend')})")

    def _release(self) -> None:
        started = time.monotonic()
        reply = self._ask("release")
        if reply is not None:
            k = reply["kernel"]
            print(f"gpushare: released {format_bytes(k.get('released_bytes') or 0)} to host memory "
                  f"in {time.monotonic() - started:.2f} s; the next cell restores it")

    def _restore(self) -> None:
        parent = getattr(self.shell, "parent_header", None) or {}
        agent = agent_module.get_agent()
        if agent is not None and not agent.released:
            print("gpushare: this kernel's GPU state is already resident")
            return
        started = time.monotonic()
        reply = self._ask("restore", trigger="magic", parent=parent)
        if reply is not None:
            print(f"gpushare: resident again after {time.monotonic() - started:.2f} s")

    def _pin(self, pinned: bool) -> None:
        if self._ask("pin", pinned=pinned) is not None:
            print("gpushare: pinned: this kernel is never released automatically" if pinned
                  else "gpushare: unpinned: this kernel is released again when idle")

    def _idle_timeout(self, args: list[str]) -> None:
        if len(args) != 1:
            print(USAGE)
            return
        seconds: float | None
        if args[0] == "default":
            seconds = None
        else:
            try:
                seconds = float(args[0])
            except ValueError:
                print(f"gpushare: idle-timeout takes seconds (a number >= 0) or 'default', not {args[0]!r}")
                return
            if seconds < 0:
                print("gpushare: idle-timeout must be >= 0 (0 = never release automatically)")
                return
        if self._ask("idle_timeout", seconds=seconds) is not None:
            print("gpushare: idle timeout " + ("back to the server's default" if seconds is None
                  else "off (never released automatically)" if seconds == 0 else f"{seconds:g} s"))


def register(ipython: Any) -> None:
    ipython.register_magics(GPUShareMagics)
