"""One restore at a time per GPU across the Jupyter servers of a machine.

Each server already lets one of its own restores at a time check and fill a GPU
(:mod:`.reservations`). Several servers on one machine would still check the same free memory
at the same moment and both restore into it: the second runs out of memory mid-way, which on a
real GPU can leave its process locked for good. So a restore also takes a lock file per GPU,
named by the GPU's UUID, in a directory the servers share (``GPUShareApp.node_lock_dir``), from
before its room check until its bytes have landed (then the GPU's free memory, which every
server reads, shows them). A lock file is an advisory ``flock``: the kernel drops it when its
holder exits or dies, so a crashed server leaves nothing held.

Only lock files nobody else can take are used. The directory is opened without following a
symbolic link and must be owned by this server's user and writable by nobody else (one
person's servers), or owned by root and either writable by nobody else or sticky (an admin's
directory for a node's servers); a lock file is opened with ``O_NOFOLLOW`` inside it and must
be a regular file owned by this user or by root (a file another user owns could be deleted
and re-created by them, and two servers would then lock two different files). Anything else
is refused with a message that says why, once, and the restore goes on *without a turn*.

A restore without a turn (refused, or waited for too long) does not simply trust its room
check: :attr:`NodeGrant.unguarded` names those GPUs, and the caller then asks for room for
twice the state, seen twice (:mod:`.controller`), so that two such restores started at the
same moment both fit.

Waiting for a turn is bounded per GPU, not per restore: once the lock has stayed with one
holder for ``timeout`` seconds, later restores on that GPU do not wait for it again while the
same holder keeps it. The caller hears when a restore has waited for a turn a moment
(``on_wait``, after ``WAIT_NOTICE`` seconds), so the cell and ``status`` can say so.
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
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_FIRST, POLL_MAX = 0.02, 0.25  # s between two tries of a held lock
#: s a restore waits for a turn before it says so (another server's restore moving its bytes
#: usually ends sooner; a cell's line and a REST 202 for that would only flicker)
WAIT_NOTICE = 2.0

#: on_wait(key, holder pid or None, seconds it may still wait)
OnWait = Callable[[str, "int | None", float], None]


class NodeGrant:
    """The lock files one restore holds (:meth:`release` is idempotent), and the keys it
    holds no turn for, with why (``unguarded``)."""

    def __init__(self, fds: list[int], unguarded: dict[str, str] | None = None):
        self._fds = fds
        self.unguarded = dict(unguarded or {})

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def check_directory(info: os.stat_result, euid: int | None = None) -> str | None:
    """Why a lock directory with this ``fstat`` cannot be trusted (None: it can)."""
    me = os.geteuid() if euid is None else euid
    mode = stat.S_IMODE(info.st_mode)
    others_write = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid == me and not others_write:
        return None
    if info.st_uid == 0 and (not others_write or mode & stat.S_ISVTX):
        return None
    if info.st_uid not in (0, me):
        return (f"it belongs to another user (uid {info.st_uid}), who could remove or replace "
                "its lock files")
    return (f"it is writable by other users (mode {mode:04o}) without being root's and sticky, "
            "so they could remove or replace its lock files")


class NodeLocks:
    def __init__(self, directory: str, timeout: float = 60.0, shared: bool = True):
        """``timeout``: seconds one holder may keep a GPU's lock before restores here stop
        waiting for it (per GPU: later restores do not wait again for the same holder).
        ``shared``: the directory was set for the servers of the machine (an admin's choice);
        False for the per-user default (:meth:`covers_every_user`)."""
        self.directory = directory
        self.shared = shared
        self.timeout = timeout
        self._warned: set[tuple[str, str]] = set()
        #: key -> (holder pid or None, monotonic time since this server found it held by it)
        self._held_by: dict[str, tuple[int | None, float]] = {}

    def _name(self, key: str) -> str:
        return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".lock"

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, self._name(key))

    def _open_directory(self) -> int:
        """The directory's descriptor, checked; creates it (mode 0700) when missing.
        Raises OSError or ValueError (refused: the message says why)."""
        path = self.directory
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            os.makedirs(path, mode=0o700, exist_ok=True)
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError("it is a symbolic link or not a directory") from None
            raise
        try:
            why = check_directory(os.fstat(fd))
        except OSError:
            os.close(fd)
            raise
        if why:
            os.close(fd)
            raise ValueError(why)
        return fd

    def _open(self, key: str) -> tuple[int | None, str]:
        """(descriptor of the key's lock file, "") or (None, why it cannot be used)."""
        try:
            dir_fd = self._open_directory()
        except (OSError, ValueError) as e:
            why = f"the lock directory {self.directory} is refused: {_text(e)}"
            self._warn(why, f"{why}; restores on GPU {key} go on without a turn, with a "
                            "stricter room check (set GPUShareApp.node_lock_dir to a directory "
                            "of yours or root's that no other user can write)")
            return None, why
        path = self._path(key)
        try:
            try:
                fd = os.open(self._name(key), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dir_fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError("it is a symbolic link") from None
                raise
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise ValueError("it is not a regular file")
                if info.st_uid not in (0, os.geteuid()):
                    raise ValueError(f"it belongs to another user (uid {info.st_uid}), who could "
                                     "remove and re-create it")
            except BaseException:
                os.close(fd)
                raise
        except (OSError, ValueError) as e:
            why = f"the lock file {path} is refused: {_text(e)}"
            self._warn(why, f"{why}; restores on this GPU go on without a turn, with a "
                            "stricter room check")
            return None, why
        finally:
            os.close(dir_fd)
        return fd, ""

    def refusal(self) -> str | None:
        """Why the lock directory is refused now (None: it is usable)."""
        try:
            os.close(self._open_directory())
        except (OSError, ValueError) as e:
            return f"the lock directory {self.directory} is refused: {_text(e)}"
        return None

    def covers_every_user(self) -> bool:
        """Whether the servers of everyone who uses these GPUs take these turns: a directory
        set for them (``shared``). The default one, in this user's runtime directory,
        serializes this user's servers only: a restore there still shares its GPU with other
        users' restores, which take no turn with it."""
        return self.shared

    def described(self) -> str:
        """Where the turns come from, for a person: "lock directory /path"."""
        return f"lock directory {self.directory}"

    def reach(self) -> str:
        """Whose restores take these turns, for a person."""
        return "every server that uses these GPUs" if self.shared else "this user's servers"

    def _warn(self, key: str, text: str) -> None:
        if (key, text) not in self._warned:
            self._warned.add((key, text))
            log.warning("gpushare: %s", text)

    async def acquire(self, keys: list[str], on_wait: OnWait | None = None) -> NodeGrant:
        """Lock every key's file, in sorted order (two restores never wait on each other
        crosswise). Keys whose lock cannot be used or was not had in time are in the grant's
        ``unguarded``. Cancellation leaves none of them held."""
        taken: list[int] = []
        unguarded: dict[str, str] = {}
        try:
            for key in sorted(set(keys)):
                fd, why = self._open(key)
                if fd is None:
                    unguarded[key] = why
                    continue
                why = await self._lock(fd, key, on_wait)
                if not why:
                    taken.append(fd)
                else:
                    os.close(fd)
                    unguarded[key] = why
        except BaseException:
            NodeGrant(taken).release()
            raise
        return NodeGrant(taken, unguarded)

    async def _lock(self, fd: int, key: str, on_wait: OnWait | None) -> str:
        """"" once locked, else why not (another holder kept it past the bound)."""
        delay = POLL_FIRST
        told = False
        began = time.monotonic()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._held_by.pop(key, None)
                    return ""
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        why = f"cannot lock {self._path(key)} ({e.strerror})"
                        self._warn(key, why)
                        return why
                holder = lock_holder(fd)
                now = time.monotonic()
                seen = self._held_by.get(key)
                if seen is None or (holder is not None and seen[0] is not None and seen[0] != holder):
                    seen = self._held_by[key] = (holder, now)  # a new holder: its own bound
                left = seen[1] + self.timeout - now
                who = f"process {seen[0]}" if seen[0] is not None else "another process"
                if left <= 0:
                    why = (f"{who} has held the restore turn of GPU {key} for over "
                           f"{self.timeout:.0f} s")
                    self._warn(f"{key}:{seen[0]}:{seen[1]}",
                               f"{why}; restores on this GPU go on without a turn, with a "
                               "stricter room check, while it keeps it")
                    return why
                if not told and on_wait is not None and now - began >= min(WAIT_NOTICE, self.timeout / 2):
                    told = True
                    try:
                        on_wait(key, seen[0], left)
                    except Exception:
                        log.exception("gpushare: reporting a wait for a restore turn")
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, POLL_MAX)
        except BaseException:
            os.close(fd)
            raise


def lock_holder(fd: int) -> int | None:
    """The pid holding a ``flock`` on ``fd``'s file, from /proc/locks (None: unknown)."""
    try:
        info = os.fstat(fd)
        ident = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                if parts[5] == ident:
                    pid = int(parts[4])
                    return pid or None
    except (OSError, ValueError):
        pass
    return None


def _text(e: BaseException) -> str:
    return e.strerror or str(e) if isinstance(e, OSError) else str(e)


class ServerTurnsOnly(NodeLocks):
    """No lock files (``node_lock_dir = ""``): restores take turns within this server only
    (its reservations). Nothing here covers another server's restores, so a GPU where a
    process that is none of this server's kernels holds memory gets the check of a restore
    without a turn, as with the per-user default directory."""

    def __init__(self) -> None:
        super().__init__("", shared=False)

    def described(self) -> str:
        return "no lock directory: GPUShareApp.node_lock_dir is empty"

    def reach(self) -> str:
        return "this server"

    def refusal(self) -> str | None:
        return None

    async def acquire(self, keys: list[str], on_wait: OnWait | None = None) -> NodeGrant:
        return NodeGrant([])
