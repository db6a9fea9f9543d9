"""The agent's ``reload``: every framework's offloaded state back onto the GPU, or none.

Each adapter's own reload is all or nothing (it allocates everything before it re-points
anything). Across adapters this module keeps the same rule: when one fails, the adapters
already reloaded by this request are offloaded again, so the kernel is exactly as it was
released (their host copies were kept by the reload, so offloading them again copies little
or nothing). A failure that was the GPU running out of memory, undone completely, is said
with :class:`NoRoomToReload`: nothing of the state is on the GPU, so the server may wait for
room and try again. An undo that itself fails is :class:`ReloadIncomplete`, which names
which framework's objects are on the GPU and which are in host memory.
"""

from __future__ import annotations

from typing import Any

from ..units import format_bytes
from . import caps, oom

#: how a person knows each adapter's framework
NAMES = {"torch": "PyTorch", "cupy": "CuPy", "jax": "JAX"}


class NoRoomToReload(RuntimeError):
    """The GPU ran out of memory during a reload, and everything is back in host memory as
    released. Its text is the framework's word in a few words ("CuPy ran out of GPU memory
    allocating 1.0 MiB"); the framework method waits for room on it (``no_room``)."""


class ReloadIncomplete(RuntimeError):
    """A reload failed and putting the frameworks already reloaded back in host memory
    failed too: part of the state is on the GPU (the text says which)."""


def name(adapter: Any) -> str:
    raw = str(getattr(adapter, "name", "") or type(adapter).__name__)
    return NAMES.get(raw, raw)


def no_room(adapter: Any, error: BaseException) -> str:
    """``error`` in a few words when it is the GPU running out of memory ("PyTorch ran out
    of GPU memory allocating 2.0 GiB on GPU 0"), with the bytes and the GPU when it says
    them; "" when it is another error (a memory cap's refusal is one: room would not help)."""
    if not caps.is_oom(error) or "gpushare memory cap" in str(error):
        return ""
    said = oom.parse(error)
    text = f"{name(adapter)} ran out of GPU memory"
    if said["bytes"] is not None:
        text += f" allocating {format_bytes(said['bytes'])}"
    if said["gpu"] is not None:
        text += f" on GPU {said['gpu']}"
    return text


def reload_all(adapters: list[Any], namespace: dict[str, Any]) -> list[Any]:
    """Each adapter's reload report, in order; on a failure, the adapters reloaded before it
    are offloaded again (from ``namespace``) and the error raised says what holds: the
    adapter's own (everything as released), :class:`NoRoomToReload` (the same, and the GPU
    was full) or :class:`ReloadIncomplete` (the undo failed: part is on the GPU)."""
    reports: list[Any] = []
    for adapter in adapters:
        try:
            reports.append(adapter.reload())
        except Exception as error:
            _undo(adapters[:len(reports)], reports, adapter, error, namespace)
            short = no_room(adapter, error)
            if short:
                raise NoRoomToReload(short) from error
            raise
    return reports


def _undo(done: list[Any], reports: list[Any], failed: Any, error: BaseException,
          namespace: dict[str, Any]) -> None:
    """Offload again the adapters of ``done`` that moved something back, last first; raise
    :class:`ReloadIncomplete` when one of them cannot be (its objects stay on the GPU)."""
    on_gpu: list[str] = []
    undo_errors: list[str] = []
    for adapter, report in reversed(list(zip(done, reports, strict=True))):
        if not (report.count or report.bytes):
            continue  # nothing came back: nothing to send away again
        try:
            adapter.offload(namespace)
        except Exception as e:  # all or nothing per adapter: its objects stay on the GPU
            on_gpu.append(name(adapter))
            undo_errors.append(f"{name(adapter)}: {_said(e)}")
    if not on_gpu:
        return
    held = [n for n in dict.fromkeys([*(name(a) for a in done), name(failed)])
            if n not in on_gpu]
    raise ReloadIncomplete(
        f"{name(failed)} could not be moved back ({_said(error)}), and moving back to host "
        f"memory what was already on the GPU failed ({'; '.join(undo_errors)}): the "
        f"{' and '.join(on_gpu)} objects are on the GPU, the {' and '.join(held)} objects "
        "still in host memory; a restore brings the rest back") from error


def _said(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first[:300]


__all__ = ["NoRoomToReload", "ReloadIncomplete", "no_room", "reload_all"]
