"""The server's own options (``c.GPUShareApp.NAME``): where GPU numbers come from, how memory
leaves the GPU, what the kernels the server starts get."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from traitlets import Bool, Dict, Int, List, TraitError, Type, Unicode, default, validate
from traitlets.config import Configurable

from ..policy.caps import CapError, parse_cap
from ..telemetry import SIMULATED_GPUS_DEFAULT, SIMULATED_NODE_ENV, Telemetry
from . import selection


def _checked(check: Callable[..., str], *args: Any) -> str:
    """What ``check`` answers; its refusal as the TraitError traitlets reports."""
    try:
        return check(*args)
    except selection.SettingError as e:
        raise TraitError(str(e)) from None


class SourceOptions(Configurable):
    """The telemetry backend and the release method."""

    backend = Unicode(
        help="""Where GPU numbers come from: "nvml" (the real GPUs), "simulated" (a simulated
        node, see simulated_gpus), "auto" (NVML when a GPU answers, else simulated; the log
        says which and why) or the name of a backend another installed package registers
        (entry point group jupyter_gpushare.telemetry_backends). Default: the environment
        variable JUPYTER_GPUSHARE_BACKEND (checked like this option: another value is
        refused), else "auto".""",
    ).tag(config=True)

    @default("backend")
    def _default_backend(self) -> str:
        return _checked(selection.backend_from_environment)

    @validate("backend")
    def _check_source_backend(self, proposal: Any) -> str:
        return _checked(selection.check_backend, proposal["value"])

    simulated_gpus = List(
        Int(),
        default_value=list(SIMULATED_GPUS_DEFAULT),
        help="""Memory of each GPU of the simulated node, in bytes, one entry per GPU.
        Default: two GPUs of 16 GiB. Used only by the simulated backend. An empty list is a
        node with no GPU.""",
    ).tag(config=True)

    @validate("simulated_gpus")
    def _check_source_sim(self, proposal: Any) -> list[int]:
        value = proposal["value"]
        if any(v <= 0 for v in value):
            raise TraitError("GPUShareApp.simulated_gpus: each GPU's memory must be > 0 bytes")
        return value

    simulated_node = Unicode(
        help="""A file that holds the simulated node's state, shared by every Jupyter server on
        this machine that names the same file (a JupyterHub of several users), so they see the
        same simulated GPUs as they would see the same real ones. The first server creates it
        with simulated_gpus; the others use the sizes in it. Default: the environment variable
        JUPYTER_GPUSHARE_SIMULATED_NODE, else "" = a node private to this server. Used only by
        the simulated backend.""",
    ).tag(config=True)

    @default("simulated_node")
    def _default_simulated_node(self) -> str:
        return os.environ.get(SIMULATED_NODE_ENV, "")

    release_method = Unicode(
        "auto",
        help="""How GPU memory leaves the GPU: "driver" (CUDA driver checkpoint: any framework,
        frees the CUDA context too; needs driver >= 570, not under MIG), "framework" (the kernel
        agent moves PyTorch/CuPy/JAX objects to host; frees all but the CUDA context), "auto"
        (driver where supported, else framework; "simulated" on the simulated backend), "off"
        (monitor only, never release), or the name of a method another package registers
        (entry point group jupyter_gpushare.release_methods). Default "auto".""",
    ).tag(config=True)

    @validate("release_method")
    def _check_source_method(self, proposal: Any) -> str:
        return _checked(selection.check_method, proposal["value"])

    telemetry_class = Type(
        klass=Telemetry,
        help="""The Telemetry subclass GPU numbers come from. Default: the class backend names
        (NVMLTelemetry for "nvml" and "auto", SimulatedTelemetry for "simulated"). Set it to
        use another source without registering it (it is then used as it is, whatever
        backend says).""",
    ).tag(config=True)

    @default("telemetry_class")
    def _default_telemetry_class(self) -> type[Telemetry]:
        return selection.telemetry_class(self.backend)


class KernelOptions(Configurable):
    """What kernels the server starts get: environment, agent, agent socket."""

    kernel_env = Dict(
        default_value={"TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        help="""Environment defaults for kernels the server starts, applied where the user has
        not set them. Default turns off TensorFlow's and JAX's grab-all-memory at start, so
        memory held is memory used. {} = none.""",
    ).tag(config=True)

    memory_limit = Unicode(
        "",
        help="""The most GPU memory one kernel may hold per GPU, as "8GiB" or "512MiB" (bytes
        per GPU; each framework the kernel uses is limited to it where it can be, and the
        server flags a kernel over it). A kernelspec's metadata.gpushare.memory_limit or the
        hub service's caps may lower it for a kernel; %gpushare cap may lower it, not raise
        it. Default "" = no cap.""",
    ).tag(config=True)

    @validate("memory_limit")
    def _check_memory_limit(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip()
        if value:
            try:
                parse_cap(value, "GPUShareApp.memory_limit")
            except CapError as e:
                raise TraitError(str(e)) from None
        return value

    load_agent = Bool(
        True,
        help="""Load the gpushare agent (and %gpushare magics) into IPython kernels the server
        starts, through the gpushare kernel provisioner. Default True. False = track by NVML
        only: no simulated backend, no framework method, no restore before nbclient cells.""",
    ).tag(config=True)

    socket_dir = Unicode(
        "",
        help="""Directory of the agent channel's Unix socket (gpushare-<pid>.sock, mode 0600).
        Default "" = Jupyter's runtime directory. Unix sockets cannot be created on some
        network file systems: point this at a local directory then. A directory where the
        socket cannot be created keeps the extension from loading (the log says why).""",
    ).tag(config=True)
