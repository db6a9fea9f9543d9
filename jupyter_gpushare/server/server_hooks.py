"""What the extension changes outside itself, each change with the undo that puts it back.

The Jupyter server's kernel websocket class, the default kernel provisioner (a process-wide
singleton) and this package's launch settings, the server's event schemas, the package's log
routing, an exit hook: every function here makes one such change and pushes its undo onto an
``ExitStack``. The app makes them only once everything that can fail has succeeded, and
unwinds the stack when a later step fails or when the extension stops, so a failed or
stopped extension leaves the server exactly as stock.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, MutableMapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from jupyter_core.utils import ensure_async

from . import provisioner
from .gate import GateConnection, Gates

PACKAGE_LOGGER = "jupyter_gpushare"
WEBSOCKET_CLASS = "kernel_websocket_connection_class"


def register_schema(event_logger: Any, schema_id: str, path: Path, undo: ExitStack) -> None:
    """Register an event schema; one registered already (the extension loaded again in one
    process) is left as it is, not an error."""
    if schema_id in event_logger.schemas.schema_ids:
        return
    event_logger.register_event_schema(path)
    undo.callback(event_logger.schemas.remove, schema_id)


def route_logs(server_log: logging.Logger, undo: ExitStack) -> None:
    """The package's module loggers write through the server's log (its format, its level),
    not Python's bare last-resort handler."""
    pkg = logging.getLogger(PACKAGE_LOGGER)
    saved = (list(pkg.handlers), pkg.propagate, pkg.level)
    pkg.handlers = list(server_log.handlers)
    # still propagate: a root handler (pytest's, an admin's logging config) sees them too;
    # the server's own loggers do not sit under the root's handlers, so nothing doubles
    pkg.propagate = True
    pkg.setLevel(server_log.getEffectiveLevel())

    def restore() -> None:
        pkg.handlers, pkg.propagate = saved[0], saved[1]
        pkg.setLevel(saved[2])

    undo.callback(restore)


def install_provisioner(settings: provisioner.LaunchSettings, log: logging.Logger,
                        undo: ExitStack) -> None:
    """Kernels the server starts from now on get the agent (unless another provisioner is
    the default: then they start without it, and the log says how to have both)."""
    from jupyter_client.provisioning.factory import KernelProvisionerFactory

    previous_settings = provisioner.settings
    provisioner.settings = settings

    def restore_settings() -> None:
        provisioner.settings = previous_settings

    undo.callback(restore_settings)
    factory = KernelProvisionerFactory.instance()
    previous_name = factory.default_provisioner_name
    if previous_name in ("local-provisioner", provisioner.NAME):
        factory.default_provisioner_name = provisioner.NAME

        def restore_default() -> None:
            factory.default_provisioner_name = previous_name

        undo.callback(restore_default)
    else:
        log.warning(
            "gpushare: kernels use provisioner %s, so they start without the gpushare agent "
            "(tracking by NVML only). Subclass jupyter_gpushare.server.provisioner.GPUShareProvisioner "
            "in yours to keep both.", previous_name)


def install_gate(server: Any, app_settings: MutableMapping[str, Any], log: logging.Logger,
                 undo: ExitStack) -> None:
    """The gate becomes the server's kernel websocket class, unless another class is
    configured (then cells restore through the kernel agent only, and the log says so)."""
    from jupyter_server.services.kernels.connection.channels import (
        ZMQChannelsWebsocketConnection,
    )

    current = server.kernel_websocket_connection_class
    if current is ZMQChannelsWebsocketConnection:
        web_settings = server.web_app.settings
        # ExtensionApp merges the app's settings into the web app's after initialize_settings:
        # set both, and put both back
        server.kernel_websocket_connection_class = GateConnection
        web_settings[WEBSOCKET_CLASS] = GateConnection
        app_settings[WEBSOCKET_CLASS] = GateConnection

        def restore() -> None:
            server.kernel_websocket_connection_class = current
            web_settings[WEBSOCKET_CLASS] = current
            app_settings[WEBSOCKET_CLASS] = current

        undo.callback(restore)
    elif not (isinstance(current, type) and issubclass(current, GateConnection)):
        log.warning(
            "gpushare: ServerApp.kernel_websocket_connection_class is %s; the gate is off, so "
            "cells restore through the kernel agent only", current,
        )


def hook_kernel_manager(km: Any, gates: Gates, log: logging.Logger, undo: ExitStack) -> None:
    """The server's kernel manager tells the gate about interrupts, restarts and shutdowns
    (REST: JupyterLab's buttons, the culler), so held cells are stopped by them too. Each
    method is wrapped on the instance; the undo puts the class's (or the earlier wrapper) back."""

    def wrap(name: str, before: Callable[[str], None],
             after: Callable[[str], None] | None = None) -> None:
        original = getattr(km, name)
        own = name in vars(km)  # someone wrapped it on the instance before us

        async def hooked(*args: Any, **kwargs: Any) -> Any:
            kernel_id = args[0] if args else kwargs.get("kernel_id")
            if isinstance(kernel_id, str):
                try:
                    before(kernel_id)
                except Exception:  # the kernel manager's own work goes on regardless
                    log.exception("gpushare: before %s of kernel %s", name, kernel_id)
            result = await ensure_async(original(*args, **kwargs))
            if after is not None and isinstance(kernel_id, str):
                try:
                    after(kernel_id)
                except Exception:
                    log.exception("gpushare: after %s of kernel %s", name, kernel_id)
            return result

        setattr(km, name, hooked)

        def restore() -> None:
            if own:
                setattr(km, name, original)
            else:
                vars(km).pop(name, None)

        undo.callback(restore)

    controller = gates.controller
    wrap("interrupt_kernel", gates.interrupted)
    wrap("restart_kernel",
         lambda kid: gates.ending(kid, "the kernel is being restarted: its released GPU state is gone"),
         lambda kid: controller.drop_held(kid, "the kernel restarted"))
    wrap("shutdown_kernel",
         lambda kid: gates.ending(kid, "the kernel is shutting down: its released GPU state is gone"))


def publish(key: str, value: Any, app_settings: MutableMapping[str, Any],
            web_settings: MutableMapping[str, Any], undo: ExitStack) -> None:
    """Put ``value`` in the web app's settings (where the gate and handlers find it)."""
    app_settings[key] = value

    def remove() -> None:
        app_settings.pop(key, None)
        if web_settings.get(key) is value:
            del web_settings[key]

    undo.callback(remove)


def at_exit(fn: Callable[[], None], undo: ExitStack) -> None:
    """Run ``fn`` when the process exits without stopping the extension (a SIGINT with no
    terminal makes jupyter_server return from its loop without its cleanup)."""
    atexit.register(fn)
    undo.callback(atexit.unregister, fn)
