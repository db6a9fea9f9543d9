"""A simulated node shared by every Jupyter server on one machine.

On a real GPU machine every user's server sees the same GPUs: Alice's kernels fill the
memory Bob's restore needs. :class:`SharedSimNode` gives the simulated backend the same
property: its ledger (bytes per GPU per process, busy intervals) lives in one SQLite file
that each server opens, instead of in one server's memory.

Why SQLite (in WAL mode) rather than a node process on a Unix socket: there is nothing to
start, supervise or restart; a server that crashes cannot take the node with it; every
change is one transaction, so "check the free memory, then take it" is atomic across
processes (``BEGIN IMMEDIATE`` takes the write lock before the check); readers never wait
for writers. A process's memory is dropped when the process is gone, whichever server
notices first, exactly as the driver frees a dead process's memory.

The ledger decides what every server may restore, so only its owner may change it: it is
created writable by its owner alone (mode 0644, and SQLite gives its -wal and -shm files the
same), and a ledger file that another user could write (group or other write permission, a
non-root owner other than this process's user, a symbolic link) is refused with
:class:`LedgerRefused`, which says why and how to fix it.

It keeps :class:`~jupyter_gpushare.sim.node.SimNode`'s interface, so the agent channel, the
telemetry and the tests use either without knowing which. The node's id (and so its GPU
UUIDs) is made when the file is created: two files are two nodes.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import clock
from .node import (
    FULL,
    NodeLedger,
    SimNode,
    SimOutOfMemoryError,
    Span,
    check_sm,
    format_bytes,
    gpu_uuid,
    shared_time,
    work_and_speed,
)

log = logging.getLogger(__name__)

NODE_ENV = "JUPYTER_GPUSHARE_SIMULATED_NODE"
BUSY_HORIZON = 3600.0  # s of closed busy intervals kept (more than any idle window)
LOCK_TIMEOUT = 10.0  # s a transaction waits for another process's write lock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS used (
    gpu INTEGER NOT NULL, pid INTEGER NOT NULL, bytes INTEGER NOT NULL,
    PRIMARY KEY (gpu, pid));
CREATE TABLE IF NOT EXISTS busy (
    pid INTEGER NOT NULL, gpu INTEGER NOT NULL, start REAL NOT NULL, stop REAL,
    sm REAL NOT NULL DEFAULT 100);
CREATE INDEX IF NOT EXISTS busy_gpu ON busy (gpu, stop);
"""


class LedgerRefused(RuntimeError):
    """A shared node's ledger file that another user could change."""


def _check_ledger(path: str) -> None:
    """Create the ledger file writable by its owner only, or check an existing one (and its
    -wal and -shm files): raises LedgerRefused when another user could write it."""
    me = os.geteuid()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.close(fd)
        return
    except FileExistsError:
        pass
    for name in (path, path + "-wal", path + "-shm"):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise LedgerRefused(f"the shared simulated node {name} cannot be opened safely "
                                f"({e.strerror}; a symbolic link is refused)") from None
        try:
            info = os.fstat(fd)
        finally:
            os.close(fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            raise LedgerRefused(f"the shared simulated node {name} is not a regular file")
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise LedgerRefused(
                f"the shared simulated node {name} is writable by other users (mode {mode:04o}): "
                f"any of them could change its accounting; run chmod go-w on it")
        if info.st_uid not in (me, 0):
            raise LedgerRefused(
                f"the shared simulated node {name} belongs to another user (uid {info.st_uid}), "
                "who could change its accounting; use a ledger of this user or root's")


class SharedSimNode:
    """The simulated node's ledger in a SQLite file that every server on the machine opens.

    The first opener creates it with ``capacities``; later openers use the capacities in the
    file (a different ``capacities`` is logged and ignored: there is one node)."""

    def __init__(self, path: str | os.PathLike[str], capacities: tuple[int, ...] | None = None):
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        _check_ledger(self.path)
        self._lock = threading.Lock()  # one connection, used by the loop and the sampler
        self._db = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout = {int(LOCK_TIMEOUT * 1000)}")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")  # a simulation: no fsync per change
        with self._write() as db:
            for statement in _statements():
                db.execute(statement)
            if "sm" not in {row[1] for row in db.execute("PRAGMA table_info(busy)")}:
                # a ledger made before busy spans said their share of the GPU: all of it
                db.execute("ALTER TABLE busy ADD COLUMN sm REAL NOT NULL DEFAULT 100")
            rows = dict(db.execute("SELECT key, value FROM meta").fetchall())
            if "node_id" not in rows:
                sizes = tuple(capacities) if capacities else SimNode().capacities
                rows = {"node_id": uuid.uuid4().hex, "capacities": json.dumps(list(sizes))}
                db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", rows.items())
        self.node_id: str = rows["node_id"]
        self.capacities: tuple[int, ...] = tuple(int(c) for c in json.loads(rows["capacities"]))
        if capacities and tuple(capacities) != self.capacities:
            log.warning("gpushare: the shared simulated node %s has GPUs of %s bytes; ignoring %s",
                        self.path, list(self.capacities), list(capacities))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- transactions ------------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: the file's write lock is taken before anything is read."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- identity -----------------------------------------------------------------------
    def uuid(self, gpu: int) -> str:
        return gpu_uuid(self.node_id, gpu)

    def _check_gpu(self, gpu: int) -> None:
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < len(self.capacities):
            raise ValueError(
                f"invalid device {gpu!r}: this node has {len(self.capacities)} simulated GPUs"
            )

    # -- memory -------------------------------------------------------------------------
    def used(self, gpu: int) -> int:
        return int(self._read("SELECT COALESCE(SUM(bytes), 0) FROM used WHERE gpu = ?", (gpu,))[0][0])

    def free(self, gpu: int) -> int:
        return self.capacities[gpu] - self.used(gpu)

    @staticmethod
    def _in_use(db: sqlite3.Connection, gpu: int, except_pid: int | None = None) -> int:
        if except_pid is None:
            row = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM used WHERE gpu = ?", (gpu,))
        else:
            row = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM used WHERE gpu = ? AND pid != ?",
                             (gpu, except_pid))
        return int(row.fetchone()[0])

    @staticmethod
    def _add(db: sqlite3.Connection, pid: int, gpu: int, nbytes: int) -> None:
        db.execute("INSERT INTO used (gpu, pid, bytes) VALUES (?, ?, ?) "
                   "ON CONFLICT (gpu, pid) DO UPDATE SET bytes = bytes + excluded.bytes",
                   (gpu, pid, nbytes))

    def alloc(self, pid: int, gpu: int, nbytes: int) -> None:
        self._check_gpu(gpu)
        if nbytes < 0:
            raise ValueError("negative allocation")
        with self._write() as db:
            in_use = self._in_use(db, gpu)
            if in_use + nbytes > self.capacities[gpu]:
                raise SimOutOfMemoryError(
                    f"out of memory on simulated GPU {gpu}: tried to allocate "
                    f"{format_bytes(nbytes)}; {format_bytes(self.capacities[gpu] - in_use)} free of "
                    f"{format_bytes(self.capacities[gpu])}"
                )
            self._add(db, pid, gpu, nbytes)

    def release(self, pid: int, gpu: int, nbytes: int) -> None:
        self._check_gpu(gpu)
        with self._write() as db:
            db.execute("UPDATE used SET bytes = bytes - ? WHERE gpu = ? AND pid = ?", (nbytes, gpu, pid))
            db.execute("DELETE FROM used WHERE gpu = ? AND pid = ? AND bytes <= 0", (gpu, pid))

    def held_by(self, pid: int) -> dict[int, int]:
        return {g: n for g, n in self._read("SELECT gpu, bytes FROM used WHERE pid = ? AND bytes > 0", (pid,))}

    def take_all(self, pid: int) -> dict[int, int]:
        with self._write() as db:
            held = {g: n for g, n in db.execute(
                "SELECT gpu, bytes FROM used WHERE pid = ? AND bytes > 0", (pid,)).fetchall()}
            db.execute("DELETE FROM used WHERE pid = ?", (pid,))
        return held

    def reserve(self, pid: int, per_gpu: dict[int, int]) -> None:
        for gpu in per_gpu:
            self._check_gpu(gpu)
        with self._write() as db:
            for gpu, n in per_gpu.items():
                free = self.capacities[gpu] - self._in_use(db, gpu)
                if n > free:
                    raise SimOutOfMemoryError(
                        f"simulated GPU {gpu} has {format_bytes(free)} free, {format_bytes(n)} needed")
            for gpu, n in per_gpu.items():
                self._add(db, pid, gpu, n)

    def set_usage(self, pid: int, per_gpu: dict[int, int]) -> None:
        for gpu, n in per_gpu.items():
            self._check_gpu(gpu)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"bytes on GPU {gpu} must be an integer >= 0, got {n!r}")
        with self._write() as db:
            for gpu, n in per_gpu.items():
                others = self._in_use(db, gpu, except_pid=pid)
                if others + n > self.capacities[gpu]:
                    raise SimOutOfMemoryError(
                        f"simulated GPU {gpu} cannot hold {format_bytes(n)} for pid {pid}: "
                        f"{format_bytes(self.capacities[gpu] - others)} free")
            db.execute("DELETE FROM used WHERE pid = ?", (pid,))
            db.executemany("INSERT INTO used (gpu, pid, bytes) VALUES (?, ?, ?)",
                           [(g, pid, n) for g, n in per_gpu.items() if n])

    def end_busy(self, pid: int) -> None:
        with self._write() as db:
            db.execute("UPDATE busy SET stop = ? WHERE pid = ? AND stop IS NULL", (clock.now(), pid))

    def drop_pid(self, pid: int) -> None:
        with self._write() as db:
            db.execute("DELETE FROM used WHERE pid = ?", (pid,))
            db.execute("DELETE FROM busy WHERE pid = ?", (pid,))

    def drop_gone(self, alive: Callable[[int], bool]) -> list[int]:
        """Drop every pid, of any server, whose process is gone (the machine is one pid space)."""
        known = {p for (p,) in self._read("SELECT pid FROM used UNION SELECT pid FROM busy")}
        gone = [p for p in known if not alive(p)]
        for pid in gone:
            self.drop_pid(pid)
        return gone

    def pids(self) -> dict[int, dict[int, int]]:
        out: dict[int, dict[int, int]] = defaultdict(dict)
        for gpu, pid, n in self._read("SELECT gpu, pid, bytes FROM used WHERE bytes > 0"):
            out[pid][gpu] = n
        return dict(out)

    # -- busy time ------------------------------------------------------------------------
    def busy_begin(self, pid: int, gpu: int, at: float | None = None, sm: float = FULL) -> None:
        self._check_gpu(gpu)
        sm = check_sm(sm)
        with self._write() as db:
            if db.execute("SELECT 1 FROM busy WHERE pid = ? AND gpu = ? AND stop IS NULL",
                          (pid, gpu)).fetchone() is None:
                db.execute("INSERT INTO busy (pid, gpu, start, sm) VALUES (?, ?, ?, ?)",
                           (pid, gpu, clock.now() if at is None else at, sm))

    def busy_end(self, pid: int, gpu: int, at: float | None = None) -> None:
        now = clock.now()
        with self._write() as db:
            db.execute("UPDATE busy SET stop = ? WHERE pid = ? AND gpu = ? AND stop IS NULL",
                       (now if at is None else at, pid, gpu))
            db.execute("DELETE FROM busy WHERE stop IS NOT NULL AND stop < ?", (now - BUSY_HORIZON,))

    def _spans(self, gpu: int, since: float, until: float) -> list[Span]:
        return [(s, e, sm, p) for s, e, sm, p in self._read(
            "SELECT start, COALESCE(stop, ?), sm, pid FROM busy WHERE gpu = ? AND start < ? "
            "AND (stop IS NULL OR stop > ?)", (until, gpu, until, since))]

    def busy_fraction(self, pid: int | None, gpu: int, since: float, until: float) -> float:
        if until <= since:
            return 0.0
        spans = self._spans(gpu, since, until)
        if pid is not None and not any(p == pid for *_, p in spans):
            return 0.0
        ran, mine, _ = shared_time(spans, since, until, pid)
        return min(1.0, (ran if pid is None else mine) / (until - since))

    def busy_work(self, pid: int, gpu: int, until: float | None = None) -> tuple[float, float]:
        until = clock.now() if until is None else until
        row = self._read("SELECT start FROM busy WHERE pid = ? AND gpu = ? AND stop IS NULL",
                         (pid, gpu))
        if not row:
            return 0.0, 1.0
        since = float(row[0][0])
        return work_and_speed(self._spans(gpu, since, until), since, until, pid)


def _statements() -> list[str]:
    return [s.strip() for s in _SCHEMA.split(";") if s.strip()]


def open_node(path: str, capacities: tuple[int, ...]) -> NodeLedger:
    """The node a server simulates: shared through ``path``, or private when it is empty."""
    if not path:
        return SimNode(capacities)
    started = time.monotonic()
    node = SharedSimNode(path, capacities)
    log.info("gpushare: shared simulated node %s (%d GPUs, id %s) opened in %.3f s",
             path, len(node.capacities), node.node_id[:8], time.monotonic() - started)
    return node
