"""One restore at a time per GPU across every Jupyter server on a machine.

Each server already lets one of its own restores at a time check and fill a GPU
(:mod:`.reservations`). Several servers on one node (a JupyterHub of many users) would still
check the same free memory at the same moment and both restore into it: the second runs out of
memory mid-way, which on a real GPU can leave its process locked for good. So a restore also
takes a lock file per GPU, named by the GPU's UUID, in a directory all servers on the machine
share (``GPUShareApp.node_lock_dir``), from before its room check until its bytes have landed
(then the GPU's free memory, which every server reads, shows them).

A lock file is an advisory ``flock``: the kernel drops it when its holder exits or dies, so a
crashed server leaves nothing held. A holder that keeps it longer than ``timeout`` (stuck, or
another user's process holding it on purpose) is not waited for: the restore goes on with its
own room check, as it would without the lock, and the log says so. A lock file that cannot be
opened (another user made it unreadable, a directory that is not writable) likewise.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import re
import stat
import time

log = logging.getLogger(__name__)

POLL_FIRST, POLL_MAX = 0.02, 0.25  # s between two tries of a held lock


class NodeGrant:
    """The lock files one restore holds; :meth:`release` is idempotent."""

    def __init__(self, fds: list[int]):
        self._fds = fds

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


class NodeLocks:
    def __init__(self, directory: str, timeout: float = 60.0):
        self.directory = directory
        self.timeout = timeout
        self._warned: set[str] = set()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".lock")

    def _open(self, key: str) -> int | None:
        """The lock file's descriptor, created readable and writable by all (every user's
        server must be able to lock it), never through a symbolic link; None when it cannot
        be used."""
        path = self._path(key)
        try:
            if not os.path.isdir(self.directory):
                os.makedirs(self.directory, exist_ok=True)
                os.chmod(self.directory, 0o1777)  # like /tmp: anyone adds, nobody removes others'
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as e:
            self._warn(path, f"cannot open {path} ({e.strerror}): restores on this GPU do not "
                             "take turns with other servers'")
            return None
        try:
            info = os.fstat(fd)
            if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o666:
                os.fchmod(fd, 0o666)  # the umask narrowed it
        except OSError:
            pass
        return fd

    def _warn(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("gpushare: %s", text)

    async def acquire(self, keys: list[str]) -> NodeGrant:
        """Lock every key's file, in sorted order (two restores never wait on each other
        crosswise). Cancellation leaves none of them held."""
        taken: list[int] = []
        try:
            for key in sorted(set(keys)):
                fd = self._open(key)
                if fd is None:
                    continue
                if await self._lock(fd, key):
                    taken.append(fd)
                else:
                    os.close(fd)
        except BaseException:
            NodeGrant(taken).release()
            raise
        return NodeGrant(taken)

    async def _lock(self, fd: int, key: str) -> bool:
        deadline = time.monotonic() + self.timeout
        delay = POLL_FIRST
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        self._warn(key, f"cannot lock {self._path(key)} ({e.strerror})")
                        return False
                if time.monotonic() >= deadline:
                    log.warning("gpushare: another server has held the restore lock of GPU %s "
                                "for over %.0f s; this restore goes on with its own room check",
                                key, self.timeout)
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, POLL_MAX)
        except BaseException:
            os.close(fd)
            raise
