"""Whether any code can have written the kernel's memory since a moment: the agent's epoch.

A write behind PyTorch's version counters (through ``.data``, DLPack, NumPy, another
library's kernel) needs code to run in the kernel process. Code runs there through a request
(a cell, silent or not, a comm message, a completion or an inspection, the debugger), on a
Python thread, or as a task or callback on the kernel's event loop. The agent bumps the epoch
when a request that may run code starts and again when it ends (:func:`bump`, see
``kernel/agent.py``); :func:`epoch` answers the epoch only while nothing else can run code:
no Python thread but the kernel's and ours, nothing waiting on the kernel's event loop, no
GUI event loop (``%gui``). A kept host copy made current at epoch E, with E still the epoch
when it is used, was written by no one since: the release trusts it without reading it.

Not covered, and said in the docs: native threads a C extension started on its own (they
are invisible to Python: an asynchronous data loader written in C++ that writes into a
tensor while no cell runs), a thread started before the agent loaded that later gets a
tensor, and a signal handler or a finalizer that writes a tensor. Until :func:`watch` is
called (the agent could not wrap the kernel's request handlers) the answer is None: every
kept copy is checked as the configured check says.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

#: modules whose threads run no code of the person's (the kernel's channels, its output
#: pipes, IPython's history writer, this package's agent, pre-copy and simulated GPU)
OUR_THREADS = ("jupyter_gpushare.", "ipykernel.heartbeat", "ipykernel.iostream",
               "ipykernel.control", "ipykernel.shellchannel", "ipykernel.subshell",
               "ipykernel.parentpoller", "ipykernel.thread", "IPython.core.history")


#: requests that run none of the person's code (the rest bump the epoch around them)
CODE_FREE = frozenset({
    "kernel_info_request", "connect_request", "is_complete_request", "interrupt_request",
    "history_request", "comm_info_request", "usage_request", "shutdown_request",
    "create_subshell_request", "delete_subshell_request", "list_subshell_request",
})


class _Watch:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0
        self.watching = False
        self.known: set[threading.Thread] = set()  # alive when the agent loaded
        self.loop: Callable[[], Any] = lambda: None  # the kernel's event loop, if any
        self.other: Callable[[], str] = lambda: ""  # anything else that can run code now


_watch = _Watch()


def watch(loop: Callable[[], Any] | None = None, other: Callable[[], str] | None = None) -> None:
    """Start answering :func:`epoch`: the threads alive now are the kernel's; ``loop()``
    gives the kernel's asyncio loop (or None), ``other()`` says what else can run code now
    ("" when nothing)."""
    with _watch.lock:
        _watch.known = set(threading.enumerate())
        _watch.loop = loop or (lambda: None)
        _watch.other = other or (lambda: "")
        _watch.watching = True


def watch_kernel(shell: Any) -> bool:
    """Bump the epoch around every request of ``shell``'s kernel (ipykernel) that may run
    code, on its shell and control channels, and around every cell IPython runs; then start
    answering :func:`epoch`. False (and nothing watched) when the kernel's request handlers
    cannot be found: every kept copy is then checked as the configured check says."""
    kernel = getattr(shell, "kernel", None)
    tables = [getattr(kernel, name, None) for name in ("shell_handlers", "control_handlers")]
    if kernel is None or not all(isinstance(table, dict) for table in tables):
        return False
    for table in tables:
        for msg_type, handler in list(table.items()):
            if msg_type not in CODE_FREE and not getattr(handler, "_gpushare_bumps", False):
                table[msg_type] = _bumping(handler)
    shell.events.register("pre_execute", bump)  # a cell run some other way, too
    shell.events.register("post_execute", bump)

    def other() -> str:
        if getattr(kernel, "eventloop", None) is not None:
            return "a GUI event loop"
        for table in tables:  # a handler added since (another extension): not watched
            for msg_type, handler in list(table.items()):
                if msg_type not in CODE_FREE and not getattr(handler, "_gpushare_bumps", False):
                    return f"the {msg_type} handler is not watched"
        return ""

    watch(lambda: getattr(getattr(kernel, "io_loop", None), "asyncio_loop", None), other)
    return True


def _bumping(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` with a bump before it runs and after it ends (awaited, if it is async)."""
    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def bumped_async(*args: Any, **kwargs: Any) -> Any:
            bump()
            try:
                return await handler(*args, **kwargs)
            finally:
                bump()

        bumped_async._gpushare_bumps = True  # type: ignore[attr-defined]
        return bumped_async

    @functools.wraps(handler)
    def bumped(*args: Any, **kwargs: Any) -> Any:
        bump()
        try:
            result = handler(*args, **kwargs)
        except BaseException:
            bump()
            raise
        if not inspect.isawaitable(result):
            bump()
            return result

        async def finish() -> Any:
            try:
                return await result
            finally:
                bump()

        return finish()

    bumped._gpushare_bumps = True  # type: ignore[attr-defined]
    return bumped


def unwatch() -> None:
    """Stop answering (:func:`epoch` is None again): tests, and an agent that unloads."""
    with _watch.lock:
        _watch.watching = False
        _watch.known = set()


def bump() -> None:
    """A request that may run code starts, or ends."""
    with _watch.lock:
        _watch.epoch += 1


def epoch() -> int | None:
    """The epoch while no code but the requests the agent sees can run, else None."""
    if not _watch.watching or others_running():
        return None
    with _watch.lock:
        return _watch.epoch


def same_epoch(began: int | None) -> int | None:
    """The epoch a copy made since ``began`` (the epoch read before it read any byte) is
    current at: ``began`` if no request ran meanwhile and nothing else can run code now,
    else None (its next use checks it)."""
    return began if began is not None and epoch() == began else None


def others_running() -> str:
    """What besides the kernel's requests can run code now ("" when nothing can)."""
    for thread in threading.enumerate():
        if thread not in _watch.known and not _ours(thread):
            return f"thread {thread.name}"
    try:
        said = _watch.other()
        if said:
            return said
        loop = _watch.loop()
    except Exception:
        return "the kernel cannot be read"
    if loop is not None:
        try:  # read from another thread: a copy of each (the GIL keeps them whole)
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            timers = [h for h in list(getattr(loop, "_scheduled", ())) if not h.cancelled()]
        except RuntimeError:  # changed while read: something runs there
            return "the kernel's event loop is busy"
        if pending:
            return f"{len(pending)} task(s) on the kernel's event loop"
        if timers:
            return f"{len(timers)} callback(s) scheduled on the kernel's event loop"
    return ""


def _ours(thread: threading.Thread) -> bool:
    """Whether ``thread`` runs the kernel's or this package's code (its target's module, or
    its class's when it has none)."""
    target = getattr(thread, "_target", None)
    module = getattr(target, "__module__", None) if target is not None else type(thread).__module__
    return isinstance(module, str) and module.startswith(OUR_THREADS)
