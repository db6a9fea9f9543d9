"""A kernel provisioner that launches local kernels with the gpushare agent.

It is the stock LocalProvisioner plus, for each kernel: the agent channel's socket path
and the kernel id in the environment, the admin's ``kernel_env`` defaults (TensorFlow
allow-growth, JAX no-preallocate) where the user has not set them, and, for IPython
kernels, ``--ext=jupyter_gpushare.kernel`` so the agent loads in kernels the server
starts and nowhere else; the telemetry source's own variables (``Telemetry.launch_env``: the
simulated node's GPU sizes); with ``placement = "room"``, ``CUDA_VISIBLE_DEVICES`` set to the
GPU(s) :mod:`.placement` chooses (the choice is kept as ``gpushare_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jupyter_client.provisioning import LocalProvisioner

from ..node.placement import VISIBLE_ENV, Placement, PlacementError, Placer, requested_cap
from ..protocol import KERNEL_ID_ENV, PLACEMENT_NOTE_ENV, SOCKET_ENV

NAME = "gpushare-provisioner"
AGENT_EXTENSION = "jupyter_gpushare.kernel"


@dataclass
class LaunchSettings:
    socket_path: str
    kernel_env: dict[str, str] = field(default_factory=dict)
    #: set in every kernel, over its environment: the telemetry source's ``launch_env()``
    source_env: dict[str, str] = field(default_factory=dict)
    load_agent: bool = True
    placer: Placer | None = None  # None: placement = "off" (the environment decides)


#: set by the server extension at start; None when the extension is not running
settings: LaunchSettings | None = None


def is_ipykernel(cmd: list[str]) -> bool:
    return any("ipykernel" in part for part in cmd)


class GPUShareProvisioner(LocalProvisioner):
    #: where placement put this kernel (None: not placed)
    gpushare_placement: Placement | None = None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        kwargs = await super().pre_launch(**kwargs)
        if settings is None:
            return kwargs
        launch = settings  # the same settings throughout, whatever happens while placing
        requested_cap(self.kernel_spec)  # a bad memory_limit: the kernel does not start
        env = kwargs.setdefault("env", {})
        for key, value in settings.kernel_env.items():
            env.setdefault(key, str(value))
        env.update(settings.source_env)
        env[SOCKET_ENV] = settings.socket_path
        env[KERNEL_ID_ENV] = self.kernel_id
        env.pop(PLACEMENT_NOTE_ENV, None)  # only ever this launch's own
        self.gpushare_placement = None
        if launch.placer is not None:
            try:
                placement = await launch.placer.place(self.kernel_id, self.kernel_spec, env)
            except PlacementError:
                raise  # the kernel cannot start as asked: the reason goes to whoever started it
            except Exception:  # never keep a kernel from starting for want of a choice
                self.log.exception("gpushare: kernel %s: placement failed; it starts with the "
                                   "GPUs its environment gives it", self.kernel_id)
                placement = None
            if placement is not None:
                env[VISIBLE_ENV] = placement.value
                if placement.note:
                    env[PLACEMENT_NOTE_ENV] = placement.note
                self.gpushare_placement = placement
        cmd = kwargs.get("cmd") or []
        if launch.load_agent and is_ipykernel(cmd) and not any(AGENT_EXTENSION in c for c in cmd):
            kwargs["cmd"] = [*cmd, f"--ext={AGENT_EXTENSION}"]
        return kwargs
