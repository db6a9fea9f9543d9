"""`%gpushare` magics: this kernel's GPU share status and actions.

Usage::

    %gpushare                      this kernel's state, memory on GPU and host, utilization,
                                   idle time, method, next automatic release
    %gpushare release              release this kernel's GPU memory now (state kept on host)
    %gpushare restore              bring it back now, without running a cell
    %gpushare pin | unpin          never / again release this kernel automatically
    %gpushare idle-timeout SECONDS this kernel's idle timeout (0 = never; "default" = server's;
                                   a pin wins over it)
    %gpushare allow-background [off]  release automatically even though threads other than
                                   the cells use the GPU (they wait while it is released)
    %gpushare cap [SIZE | off]     this kernel's memory cap per GPU (8GiB, 512MiB; off = the
                                   default), applied through each framework it uses
    %%gpushare release-after       run the cell, then release at once

When a released kernel comes back depends on the server's ``restore_mode``: ``eager`` (the
default) restores before the next cell runs, whatever the cell, except a cell made only of
``%gpushare`` magics, which runs on the released kernel (see :data:`RESTORE_MODES`).
"""

from __future__ import annotations

import ast
import html
import math
import re
import time
from collections.abc import Callable
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from .. import states
from ..policy import caps
from ..protocol import RemoteError
from ..units import format_bytes
from . import agent as agent_module
from . import caps as kernel_caps

#: what brings a released kernel back, per restore_mode, as the magics say it (`code` shows
#: as code in HTML and plainly in text)
RESTORE_MODES = {
    "eager": "before the next cell runs, whatever it does (even `1 + 1`), except a cell made "
             "only of `%gpushare` magics",
    "lazy": "before the next cell that may use the GPU (others run at once)",
}

USAGE = ("usage: %gpushare [status | release | restore | pin | unpin | idle-timeout SECONDS | "
         "allow-background [off] | cap [SIZE or off]]  or  %%gpushare release-after")


_CODE = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` for a plain-text output: `code` without its backticks."""
    return _CODE.sub(r"\1", text)


def as_html(text: str) -> str:
    """``text`` escaped for HTML, `code` as <code>."""
    return _CODE.sub(r"<code>\1</code>", html.escape(text))


def _fmt_seconds(s: float | None) -> str:
    """Seconds as a person reads them, to the second below 90 min (two times shown side by
    side, "idle" and "next automatic release", add up as they are written)."""
    if s is None:
        return "-"
    s = float(s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        minutes, seconds = divmod(round(s), 60)
        return f"{minutes} min" + (f" {seconds} s" if seconds else "")
    return f"{s / 3600:.1f} h"


def _fmt_idle_timeout(seconds: float | None) -> str:
    """The kernel's idle timeout in effect, as the server reports it (its own, else the
    server's; 0 = never released automatically)."""
    if seconds is None:
        return "-"
    return "0 (never released automatically)" if seconds == 0 else _fmt_seconds(seconds)


class StatusView:
    """Rich (HTML table) in JupyterLab, plain text elsewhere."""

    def __init__(self, rows: list[tuple[str, str]], title: str):
        self.rows = rows
        self.title = title

    def __repr__(self) -> str:
        width = max(len(k) for k, _ in self.rows)
        return "\n".join([plain(self.title),
                          *(f"  {plain(k):<{width}}  {plain(v)}" for k, v in self.rows)])

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><th style='text-align:left'>{as_html(k)}</th><td style='text-align:left'>"
            f"{as_html(v)}</td></tr>" for k, v in self.rows
        )
        return f"<table class='gpushare-status'><caption>{as_html(self.title)}</caption>{body}</table>"


def _next_release(kernel: dict[str, Any], seconds: float | None, counted: str = "") -> str:
    """The "next automatic release" line: ``seconds`` to it (None: none is due), ``counted``
    what the time counts from. Under the server's release policy "needs" (the kernel's
    ``release_policy``, where the server says it) a kernel is released when its GPU needs
    the memory, and after a long idle (``seconds``; None: never) also once the GPU is short of
    room (the server's ``long_idle_free_fraction``), not before."""
    at = "" if seconds is None else f"in {_fmt_seconds(seconds)}{counted}"
    if kernel.get("release_policy") != "needs":
        return at or "never"
    if (kernel.get("pinned") or kernel.get("idle_timeout") == 0
            or kernel.get("state") not in states.RESIDENT):
        return at or "never"  # out of every automatic release, or nothing on the GPU to release
    need = "when its GPU needs the memory"
    return f"{need}; {at}, also once it runs short of room" if at else f"only {need}"


def _idle_rows(kernel: dict[str, Any], after_cell: Any) -> list[tuple[str, str]]:
    """Idle time and next automatic release, from the one idle clock the server's policy uses.

    ``after_cell``: seconds to the release counted from the end of the cell that asks (the
    server's ``release_in_after_cell``; that cell is use, so the clock starts again there);
    ``...`` when the server did not say (then the release is counted from the idle time)."""
    idle = _fmt_seconds(kernel.get("idle_seconds"))
    if after_cell is ...:
        return [("idle", idle),
                ("next automatic release", _next_release(kernel, kernel.get("release_in_seconds")))]
    return [("idle", f"{idle} before this cell (every cell counts as use, this one too)"),
            ("next automatic release",
             _next_release(kernel, after_cell, ", counted from the end of this cell"))]


def status_rows(kernel: dict[str, Any], restore_mode: str = "",
                after_cell: Any = ...) -> list[tuple[str, str]]:
    util = kernel.get("sm_utilization")
    idle, release = _idle_rows(kernel, after_cell)
    rows = [
        ("state", kernel.get("state", "?") + (" (pinned)" if kernel.get("pinned") else "")),
        ("GPU memory", format_bytes(kernel.get("gpu_memory_bytes") or 0)
         + (f" on GPU {', '.join(map(str, kernel.get('gpus') or []))}" if kernel.get("gpus") else "")),
        ("host memory (released)", format_bytes(kernel.get("released_bytes") or 0)),
        ("utilization", "-" if util is None else f"{util:.0f} % SM"),
        idle,
        ("method", str(kernel.get("method") or "none")),
        release,
        ("idle timeout", _fmt_idle_timeout(kernel.get("idle_timeout"))),
        ("memory cap", cap_text(kernel)),
        ("releases / restores", f"{kernel.get('releases', 0)} / {kernel.get('restores', 0)}"),
    ]
    if restore_mode in RESTORE_MODES:
        rows.append(("restore mode", f"{restore_mode}: {RESTORE_MODES[restore_mode]}"))
    if kernel.get("last_restore_seconds") is not None:
        rows.append(("last restore", f"{kernel['last_restore_seconds']:.2f} s"))
    copy = host_copy_text(kernel)
    if copy:
        rows.append(("host copy", copy))
    if kernel.get("waiting"):
        rows.append(("waiting", kernel["waiting"]))
    if kernel.get("release_blocked"):
        rows.append(("not released automatically", kernel["release_blocked"]))
    if kernel.get("error"):
        rows.append(("error", kernel["error"]))
    return rows


def cap_text(kernel: dict[str, Any]) -> str:
    """``8 GiB per GPU``, ``none``, or ``8 GiB per GPU: holds 9.1 GiB of its 8 GiB cap on
    GPU 0`` when the node sees it hold more."""
    cap = kernel.get("memory_cap")
    if not isinstance(cap, int) or isinstance(cap, bool):
        return "none (%gpushare cap 8GiB sets one)"
    text = f"{caps.describe(cap)} per GPU"
    return f"{text}: {kernel['over_cap']}" if kernel.get("over_cap") else text


def host_copy_text(kernel: dict[str, Any]) -> str:
    """``current: 12.0 GiB, to copy at release: 0.3 GiB`` while the kernel keeps a host copy
    of its GPU state (a release copies only the rest); empty when it keeps none."""
    current, to_copy = kernel.get("host_copy_bytes"), kernel.get("to_copy_bytes")
    if not isinstance(current, int) or not current or not isinstance(to_copy, int):
        return ""
    return f"current: {format_bytes(current)}, to copy at release: {format_bytes(to_copy)}"


def hub_rows(hub: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What the JupyterHub's gpushare service says about this user (nothing without one)."""
    if not isinstance(hub, dict):
        return []
    if not hub.get("connected"):
        return [("hub service", f"not reachable ({hub.get('error') or 'no answer yet'})")]
    share = hub.get("share") or "none guaranteed"
    rows = [("your share", share + (" (you are over it: your idle kernels go first)"
                                    if hub.get("over_share") else ""))]
    for u in hub.get("usage") or []:
        if not isinstance(u, dict):
            continue
        limit = u.get("guaranteed")
        rows.append((f"your GPU {u.get('index')} memory", format_bytes(u.get("bytes") or 0)
                     + (f" of {format_bytes(limit)} guaranteed" if isinstance(limit, int) else "")
                     + " (all your servers)"))
    if isinstance(hub.get("cap"), int):
        rows.append(("your cap", f"{caps.describe(hub['cap'])} per GPU for each kernel (the admin's)"))
    if hub.get("admin_url"):
        rows.append(("admin page", str(hub["admin_url"])))
    return rows


@magics_class
class GPUShareMagics(Magics):
    @line_cell_magic
    def gpushare(self, line: str = "", cell: str | None = None) -> Any:
        """This kernel's share of the GPU: status and actions.

        %gpushare                      this kernel's state, memory on the GPU and on the host,
                                       SM utilization, idle time, release method and the time
                                       of the next automatic release (an HTML table in
                                       JupyterLab, plain text elsewhere)
        %gpushare status               the same
        %gpushare release              release this kernel's GPU memory now; its GPU state is
                                       kept in host memory until it is restored (below)
        %gpushare restore              bring the GPU state back now, without running a cell
        %gpushare pin                  never release this kernel automatically
        %gpushare unpin                release it again when idle
        %gpushare idle-timeout SECONDS release this kernel after SECONDS idle (0 = never
                                       automatically; "default" = the server's idle_timeout);
                                       on a pinned kernel the pin wins until unpin
        %gpushare allow-background     release this kernel automatically even though threads
                                       other than the cells use the GPU (they wait while it
                                       is released); `allow-background off` undoes it
        %gpushare cap SIZE             this kernel's memory cap per GPU (8GiB, 512MiB): each
                                       framework it uses is limited to it where it can be
                                       (PyTorch, JAX and TensorFlow before they start, CuPy,
                                       the simulated GPU); `cap off` goes back to the
                                       default; `cap` alone shows it. A kernel may lower the
                                       admin's cap, not raise it
        %%gpushare release-after       run the cell, then release at once (not if it fails)

        A released kernel is restored before a cell runs, as the server's restore_mode says:
          eager (the default)  before the next cell, whatever it is: `1 + 1` waits for the
                               restore too (a cell of only %gpushare magics does not).
                               Always right, with every release method.
          lazy                 before the next cell that may use the GPU, judged from its
                               code; other cells run at once. A wrong guess makes the cell's
                               GPU calls wait until the server's watchdog restores the kernel
                               (restore_grace). Driver and simulated methods only.
        Eager is the default because it never depends on reading the cell right.
        `%gpushare` shows the mode in effect.

        In a kernel started by a Jupyter server with jupyter-gpushare enabled the magics are
        loaded already; elsewhere use `%load_ext jupyter_gpushare`, which reports the GPU
        memory of the frameworks imported here (no server: no release or restore).
        """
        words = line.split()
        command = words[0] if words else "status"
        if cell is not None:
            if command != "release-after" or len(words) > 1:
                print(f"gpushare: the cell form is `%%gpushare release-after`, not {line.strip()!r}\n"
                      + USAGE)
                return None
            return self._release_after(cell)
        if command == "idle-timeout":
            return self._idle_timeout(words[1:])
        if command == "allow-background":
            return self._allow_background(words[1:])
        if command == "cap":
            return self._cap(words[1:])
        handler = {
            "status": self._status, "release": self._release, "restore": self._restore,
            "pin": lambda: self._pin(True), "unpin": lambda: self._pin(False),
        }.get(command)
        if handler is None:
            print(f"gpushare: unknown subcommand {command!r}\n{USAGE}")
            return None
        if len(words) > 1:
            print(f"gpushare: {command} takes no arguments\n{USAGE}")
            return None
        return handler()

    # -- commands --------------------------------------------------------------------------
    def _client(self):
        agent = agent_module.get_agent()
        if agent is None or agent.client is None or not agent.client.connected:
            why = (agent.why_offline if agent else "") or "the gpushare agent is not loaded"
            return None, why
        return agent.client, ""

    def _ask(self, op: str, *, said: Callable[[], bool] | None = None,
             **args: Any) -> dict[str, Any] | None:
        """Ask the server; None (and a line that says why) when it fails. ``said``: True when
        the failure was shown in the cell already (a restore's progress line)."""
        client, why = self._client()
        if client is None:
            print(f"gpushare: no server: {why}")
            return None
        try:
            reply = client.request(op, timeout=None, **args)
        except (RemoteError, OSError, TimeoutError) as e:
            if said is None or not said():
                text = str(e)  # the server's "restore failed: ..." is not prefixed twice
                print(f"gpushare: {text}" if text.startswith(f"{op} failed")
                      else f"gpushare: {op} failed: {text}")
            return None
        agent = agent_module.get_agent()
        kernel = reply.get("kernel")
        if agent is not None and isinstance(kernel, dict) and kernel.get("state"):
            agent.note_state(kernel["state"])  # before the notification, which may lag
        return reply

    def _status(self) -> None:
        client, why = self._client()
        if client is None:
            agent = agent_module.get_agent()
            report = agent.report() if agent else {}
            rows = [("server", f"none: {why}"),
                    ("frameworks", ", ".join(report.get("frameworks") or []) or "none imported"),
                    ("framework GPU memory", format_bytes(report.get("framework_bytes") or 0))]
            if report.get("simulated_bytes"):
                rows.append(("simulated GPU memory", format_bytes(report["simulated_bytes"])))
            if report.get("error"):
                rows.append(("error", str(report["error"])))
            display(StatusView(rows, "gpushare: this kernel (no gpushare server)"))
            return None
        reply = self._ask("status")
        if reply is not None:
            agent = agent_module.get_agent()
            mode = agent.restore_mode if agent is not None else ""
            rows = status_rows(reply["kernel"], mode, reply.get("release_in_after_cell", ...))
            display(StatusView(rows + hub_rows(reply.get("hub")),
                               f"gpushare: this kernel ({reply.get('backend')} backend)"))
        return None

    def _release(self) -> None:
        started = time.monotonic()
        reply = self._ask("release")
        if reply is not None:
            k = reply["kernel"]
            agent = agent_module.get_agent()
            when = RESTORE_MODES.get(agent.restore_mode if agent is not None else "eager",
                                     RESTORE_MODES["eager"])
            detail = f" ({k['release_detail']})" if k.get("release_detail") else ""
            print(f"gpushare: released {format_bytes(k.get('released_bytes') or 0)} to host memory "
                  f"in {time.monotonic() - started:.2f} s{detail}; it comes back {plain(when)}")

    def _restore(self) -> None:
        before = self._ask("status")
        if before is None:
            return
        if before["kernel"].get("state") not in states.HELD:
            print("gpushare: this kernel's GPU state is already resident")
            return
        parent = getattr(self.shell, "parent_header", None) or {}
        agent = agent_module.get_agent()
        shown_before = set(agent.shown_in(parent)) if agent is not None and parent else set()

        def shown(start: str) -> bool:
            """This restore's progress line in this cell reads ``start...``."""
            now = agent.shown_in(parent) if agent is not None and parent else {}
            return any(t.startswith(start) for d, t in now.items() if d not in shown_before)

        started = time.monotonic()
        # The server shows the restore's progress in this cell, one line updated in place
        # (waiting, restoring, then "restored X in S s" or "restore failed, ..."): that line
        # is the answer. Said here only when it is not there (this restore joined one asked
        # elsewhere, whose line is in that cell).
        reply = self._ask("restore", trigger="magic", parent=parent,
                          said=lambda: shown("gpushare: restore failed"))
        if reply is not None and not shown("gpushare: restored "):
            moved = format_bytes(before["kernel"].get("released_bytes") or 0)
            print(f"gpushare: restored {moved} in {time.monotonic() - started:.2f} s")

    def _pin(self, pinned: bool) -> None:
        before = self._ask("status")
        if before is None:
            return
        if bool(before["kernel"].get("pinned")) == pinned:  # nothing changes: say so
            print("gpushare: already pinned: this kernel is never released automatically "
                  "(%gpushare unpin undoes it)" if pinned else
                  "gpushare: not pinned: this kernel is released automatically already")
            return
        if self._ask("pin", pinned=pinned) is not None:
            print("gpushare: pinned: this kernel is never released automatically" if pinned
                  else "gpushare: unpinned: this kernel is released again when idle")

    def _idle_timeout(self, args: list[str]) -> None:
        if len(args) != 1:
            print(f"gpushare: idle-timeout takes one value: seconds or 'default'\n{USAGE}")
            return
        seconds: float | None
        if args[0] == "default":
            seconds = None
        else:
            try:
                seconds = float(args[0])
            except ValueError:
                seconds = float("nan")
            if not math.isfinite(seconds) or seconds < 0:
                print("gpushare: idle-timeout takes seconds (a number >= 0; 0 = never release "
                      f"automatically) or 'default', not {args[0]!r}")
                return
        reply = self._ask("idle_timeout", seconds=seconds)
        if reply is not None:
            pinned = reply["kernel"].get("pinned")
            print("gpushare: idle timeout " + ("back to the server's default" if seconds is None
                  else "off (never released automatically)" if seconds == 0 else f"{seconds:g} s")
                  + ("; this kernel is pinned, and the pin wins: it is not released automatically "
                     "until %gpushare unpin" if pinned else ""))

    def _allow_background(self, args: list[str]) -> None:
        if args not in ([], ["on"], ["off"]):
            print(f"gpushare: allow-background takes nothing, 'on' or 'off'\n{USAGE}")
            return
        allow = args != ["off"]
        if self._ask("allow_background", allow=allow) is not None:
            print("gpushare: this kernel is released automatically when idle, even with threads "
                  "using the GPU" if allow else
                  "gpushare: this kernel is not released automatically while threads use the GPU")

    def _cap(self, args: list[str]) -> None:
        agent = agent_module.get_agent()
        if not args:
            reply = self._ask("status")
            if reply is not None:
                print(f"gpushare: memory cap: {cap_text(reply['kernel'])}")
                for line in kernel_caps.get().applied.values():
                    print(f"  {line}")
            return
        if len(args) != 1:
            print(f"gpushare: cap takes one value: an amount like 8GiB, or 'off'\n{USAGE}")
            return
        cap: int | None = None
        if args[0].lower() not in caps.OFF:
            try:
                cap = caps.parse_cap(args[0])
            except caps.CapError as e:
                print(f"gpushare: {e}; nothing changed")
                return
        reply = self._ask("cap", bytes=cap)
        if reply is None or agent is None:
            return
        lines = agent.apply_cap(reply)
        print(f"gpushare: memory cap: {cap_text(reply['kernel'])}")
        for line in lines:
            print(f"  {line}")

    def _release_after(self, cell: str) -> Any:
        """Run ``cell`` like a cell (its errors are the cell's), show its value, then release."""
        shell: Any = self.shell
        source = shell.transform_cell(cell)
        tree = ast.parse(source, filename="<cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        filename = shell.compile.cache(source)
        ns = shell.user_ns
        exec(compile(tree, filename, "exec"), shell.user_global_ns, ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), filename, "eval"),
                         shell.user_global_ns, ns)
            if value is not None:
                shell.displayhook(value)  # shown while the GPU state is still resident
        self._release()
        return None


def register(ipython: Any) -> None:
    ipython.register_magics(GPUShareMagics)
