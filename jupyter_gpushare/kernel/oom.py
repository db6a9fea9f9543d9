"""What a framework's out-of-memory error says: the bytes it tried to allocate and the GPU.

Read from the error's message alone (no framework is imported to tell), for the agent's
``out_of_memory`` request: the server makes room on that GPU for that many bytes. Anything a
message does not say is None, and the server decides without it.
"""

from __future__ import annotations

import math
import os
import re

UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
         "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\b"

#: (pattern, group of the bytes or a size with its unit): first match wins
_BYTES = (
    re.compile(r"tried to allocate " + _SIZE, re.I),  # PyTorch, the simulated node
    re.compile(r"while trying to allocate (\d+) bytes", re.I),  # XLA (JAX)
    re.compile(r"Out of memory allocating ([\d,]+) bytes", re.I),  # CuPy
    re.compile(r"free, " + _SIZE + r" needed"),  # the simulated node's restore
)
#: TensorFlow: "OOM when allocating tensor with shape[1024,1024] and type float on ..."
_TF = re.compile(r"allocating tensor with shape\s*\[([\d,\s]*)\]\s*and type (\w+)", re.I)
TF_TYPE_BYTES = {"float": 4, "double": 8, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
                 "bool": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
                 "uint64": 8, "complex64": 8, "complex128": 16}

#: the node's GPU index (the simulated node's own messages)
_NODE_GPU = re.compile(r"simulated GPU (\d+)")
#: the process's device ordinal (PyTorch "GPU 0 has a total capacity", "(GPU 0; 15.8 GiB
#: total capacity", TensorFlow "device:GPU:0")
_DEVICE = re.compile(r"\bGPU (\d+)(?: has a total capacity|;)|device:GPU:(\d+)")


def size(number: str, unit: str) -> int:
    """``"2.00", "GiB"`` -> bytes."""
    return int(float(number) * UNITS[unit.upper()])


def failed_bytes(message: str) -> int | None:
    """The bytes the failed allocation asked for, when the message says (None otherwise)."""
    for pattern in _BYTES:
        m = pattern.search(message)
        if m is None:
            continue
        groups = [g for g in m.groups() if g is not None]
        if len(groups) >= 2 and groups[-1].upper() in UNITS:
            return size(groups[-2], groups[-1])
        return int(groups[0].replace(",", ""))
    m = _TF.search(message)
    if m is not None and m.group(2).lower() in TF_TYPE_BYTES:
        dims = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
        return math.prod(dims) * TF_TYPE_BYTES[m.group(2).lower()]
    return None


def visible_gpus(value: str | None) -> list[int] | None:
    """The node's GPU indices a process's ordinals stand for (``CUDA_VISIBLE_DEVICES``);
    None when an entry is not an index (a UUID: not known here)."""
    if value is None:
        return []  # every GPU, numbered as the node numbers them
    out: list[int] = []
    for part in value.split(","):
        token = part.strip()
        if not token.isdigit():
            return None if token else out
        out.append(int(token))
    return out


def failed_gpu(message: str, visible: str | None = None) -> int | None:
    """The node's index of the GPU the allocation failed on, when the message says and the
    process's numbering can be translated (``visible``: its ``CUDA_VISIBLE_DEVICES``)."""
    m = _NODE_GPU.search(message)
    if m is not None:
        return int(m.group(1))
    m = _DEVICE.search(message)
    if m is None:
        return None
    ordinal = int(m.group(1) or m.group(2))
    seen = visible_gpus(visible)
    if seen is None:
        return None
    if not seen:
        return ordinal
    return seen[ordinal] if ordinal < len(seen) else None


def parse(error: BaseException) -> dict[str, int | None]:
    """The ``out_of_memory`` request's fields from a framework's error."""
    message = str(error)
    return {"bytes": failed_bytes(message),
            "gpu": failed_gpu(message, os.environ.get("CUDA_VISIBLE_DEVICES"))}
