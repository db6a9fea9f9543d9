"""What the controller asks of the world around it: two small ports.

The controller decides; it reads the node and the kernels only through these. The server
supplies them (:mod:`..server.ports`), the model test supplies its own fakes, and a remote or
second simulated node would supply others; none of them needs an edit to the controller.
"""

from __future__ import annotations

from typing import Any, Protocol

from .hostmem import HostRoom


class NodeRoom(Protocol):
    """GPU and host memory as the server sees them now."""

    async def read_free(self, gpus: list[int]) -> dict[int, int | None]:
        """Free bytes per GPU read now, off the event loop (None where unknown)."""

    def total_bytes(self) -> dict[int, int]:
        """Each known GPU's memory in bytes."""

    async def host_room(self, pid: int | None) -> HostRoom | None:
        """Host memory the kernel process ``pid`` may still use (None: not known)."""

    async def refresh(self) -> None:
        """One poll, so what status shows after an operation is of one moment."""

    async def node_view(self, gpus: list[int]) -> dict[int, tuple[int | None, bool]] | None:
        """Room per GPU as a party that sees every server of the node counts it (the hub
        service: other people's released kernels and waiting restores included), and whether
        this server's person is within their share there: {gpu: (bytes or None, within)}.
        None: no such party, or it did not answer."""


class KernelFacts(Protocol):
    """What the server knows of one kernel beyond GPU numbers."""

    def live_state(self, kernel_id: str) -> str:
        """The kernel's execution state now ("busy", "idle", ...; "unknown" if gone)."""

    def overrides(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's own settings (its kernelspec's ``metadata.gpushare``)."""

    def method_for(self, kernel_id: str) -> str | None:
        """The release method that can act on the kernel now (None: none can)."""

    def method_failed(self, kernel_id: str, method: str, why: str) -> None:
        """A release by ``method`` could not free the kernel's memory and was undone (``why``,
        in a few words): pick another method for this kernel from now on where one can act."""

    def agent(self, kernel_id: str) -> Any:
        """The kernel's agent connection (None: no agent is connected)."""
