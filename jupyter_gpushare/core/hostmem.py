"""How much more host memory a kernel's process may use: its memory cgroup and the machine.

A release moves the kernel's GPU state into host memory *inside the kernel's process* (the
driver checkpoint keeps it in driver-managed memory of that process; the framework method in
pinned host tensors; the simulated GPU in numpy buffers), so it counts against the kernel's
memory cgroup and the machine. Releasing more than fits gets the kernel OOM-killed, which is
the loss this product exists to prevent, so every release asks here first.

What is read (no hardware, plain files; cheap enough for every poll):

- cgroup v2 (``0::/path`` in ``/proc/PID/cgroup``): ``memory.max`` minus ``memory.current``
  at the kernel's cgroup and every ancestor; ``max`` means no limit.
- cgroup v1 (a ``memory`` line): ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``
  along the same path; a limit near 2**63 means none.
- Reclaimable page cache (``inactive_file`` in ``memory.stat``) counts as free: the kernel
  drops it before it OOM-kills anything.
- The machine: ``MemAvailable`` in ``/proc/meminfo``.

The tightest of these wins; ``HostRoom.scope`` names it, so releases in flight in the same
scope can be subtracted by the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from ..units import format_bytes

T = TypeVar("T")

_size = partial(format_bytes, whole_below_gib=True)

_NO_LIMIT = 1 << 62  # cgroup v1 writes "unlimited" as a huge page-aligned number


@dataclass(frozen=True)
class HostRoom:
    available: int | None  # bytes the process may still use; None when nothing could be read
    scope: str  # the tightest limit: "machine" or the cgroup directory
    detail: str  # for a person: where the number comes from


class HostMemory:
    """Reads host memory room; ``proc`` and ``cgroup_root`` are parameters so tests can
    point it at a fake tree."""

    def __init__(self, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup"):
        self.proc = proc
        self.cgroup_root = cgroup_root
        self._cache: dict[str, str | None] | None = None
        self._memo: dict[tuple[Any, ...], Any] | None = None

    @contextmanager
    def one_moment(self) -> Iterator[None]:
        """Read each file once inside, and work out each cgroup's room once: a poll asks for
        every kernel, and kernels share the machine's numbers and their cgroups (200 kernels
        in one cgroup parsed its memory.stat 600 times a poll, two thirds of the poll)."""
        self._cache, self._memo = {}, {}
        try:
            yield
        finally:
            self._cache = self._memo = None

    def _once(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        memo = self._memo
        if memo is None:
            return compute()
        if key not in memo:
            memo[key] = compute()
        return cast(T, memo[key])

    # -- reading files --------------------------------------------------------------------
    def _read(self, path: str) -> str | None:
        cache = self._cache
        if cache is not None and path in cache:
            return cache[path]
        try:
            with open(path) as f:
                text: str | None = f.read().strip()
        except OSError:
            text = None
        if cache is not None:
            cache[path] = text
        return text

    def _int(self, path: str) -> int | None:
        text = self._read(path)
        if text is None:
            return None
        if text == "max":
            return _NO_LIMIT
        try:
            return int(text)
        except ValueError:
            return None

    def _stat(self, directory: str, key: str) -> int:
        return self._once(("stat", directory), lambda: self._parse_stat(directory)).get(key, 0)

    def _parse_stat(self, directory: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in (self._read(os.path.join(directory, "memory.stat")) or "").splitlines():
            name, _, value = line.partition(" ")
            try:
                out[name] = int(value)
            except ValueError:
                out[name] = 0
        return out

    def machine_available(self) -> int | None:
        return self._once(("meminfo",), self._machine_available)

    def _machine_available(self) -> int | None:
        text = self._read(os.path.join(self.proc, "meminfo")) or ""
        for line in text.splitlines():
            if line.startswith("MemAvailable:"):
                parts = line.split()
                try:
                    return int(parts[1]) * 1024  # kB
                except (IndexError, ValueError):
                    return None
        return None

    def _cgroup_dirs(self, pid: int) -> tuple[str, list[str]]:
        """("v1"|"v2"|"", the cgroup directories from the process's own up to the root)."""
        text = self._read(os.path.join(self.proc, str(pid), "cgroup")) or ""
        v1_path = v2_path = None
        for line in text.splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, path = parts
            if "memory" in controllers.split(","):
                v1_path = path
            elif parts[0] == "0" and controllers == "":
                v2_path = path
        if v1_path is not None and os.path.isdir(os.path.join(self.cgroup_root, "memory")):
            root = os.path.join(self.cgroup_root, "memory")
            return "v1", self._once(("walk", root, v1_path), lambda: self._walk(root, v1_path))
        if v2_path is not None and os.path.exists(os.path.join(self.cgroup_root, "cgroup.controllers")):
            root = self.cgroup_root
            return "v2", self._once(("walk", root, v2_path), lambda: self._walk(root, v2_path))
        return "", []

    @staticmethod
    def _walk(root: str, path: str) -> list[str]:
        """``root/path`` and each ancestor up to ``root``; a path not visible here (another
        cgroup namespace) is read from the root, which then is the process's own cgroup."""
        parts = [p for p in path.split("/") if p]
        dirs = []
        while parts:
            d = os.path.join(root, *parts)
            if os.path.isdir(d):
                dirs.append(d)
            parts.pop()
        dirs.append(root)
        return dirs

    def _cgroup_free(self, version: str, directory: str) -> tuple[int, int, int] | None:
        """(free, limit, used) of one cgroup directory, None when it sets no limit."""
        return self._once(("free", version, directory),
                          lambda: self._read_cgroup_free(version, directory))

    def _read_cgroup_free(self, version: str, directory: str) -> tuple[int, int, int] | None:
        if version == "v2":
            limit, used = self._int(f"{directory}/memory.max"), self._int(f"{directory}/memory.current")
            cache = self._stat(directory, "inactive_file")
        else:
            limit = self._int(f"{directory}/memory.limit_in_bytes")
            used = self._int(f"{directory}/memory.usage_in_bytes")
            cache = self._stat(directory, "total_inactive_file")
        if limit is None or used is None or limit >= _NO_LIMIT:
            return None
        used = max(0, used - cache)
        return max(0, limit - used), limit, used

    # -- the answer ----------------------------------------------------------------------
    def room(self, pid: int | None) -> HostRoom:
        best: HostRoom | None = None
        available = self.machine_available()
        if available is not None:
            best = HostRoom(available, "machine",
                            f"the machine has {_size(available)} available")
        if pid is not None:
            version, dirs = self._cgroup_dirs(pid)
            for directory in dirs:
                got = self._cgroup_free(version, directory)
                if got is None:
                    continue
                free, limit, _ = got
                if best is None or best.available is None or free < best.available:
                    best = HostRoom(free, directory, f"its memory cgroup ({directory}) has "
                                    f"{_size(free)} free of a {_size(limit)} limit")
        return best or HostRoom(None, "machine", "host memory could not be read")
