"""What the service measures itself on the node, so that it never has to take a server's word.

A user's server runs as that user, who can change it or replace it with a program of their
own: what it reports is a claim. The service, running on the node, reads the same telemetry
the servers read (NVML, or the simulated node's shared ledger), and the kernels' processes
in ``/proc``:

- each GPU's total and used memory (the service's reading wins over any server's);
- the GPU memory of each process, by GPU UUID;
- for the processes it is asked about: whose they are (their OS account when each Hub user
  has one, ``unix_user``; else the ``JUPYTERHUB_USER`` the Hub set in their environment) and
  how much host memory they hold (resident plus swapped: where a released state lives).

Blocking (NVML, SQLite, ``/proc``): the coordinator calls :meth:`Meter.read` in a thread.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

from .. import clock
from ..telemetry.base import Telemetry, TelemetrySettings

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nvml", "simulated", "off")


@dataclass(frozen=True)
class Proc:
    """One process as the service sees it."""

    owner: str | None  # the Hub user it belongs to; None: cannot tell
    host_bytes: int | None  # resident + swapped host memory; None: cannot read


@dataclass
class Measured:
    """One reading of the node."""

    at: float
    backend: str
    gpus: dict[str, tuple[int | None, int | None]]  # uuid -> (total, used) bytes
    pids: dict[int, dict[str, int]]  # pid -> uuid -> bytes on that GPU
    procs: dict[int, Proc] = field(default_factory=dict)  # pids asked about, and every GPU process
    context_bytes: int = 0  # what a restore may need beyond the state its process holds

    def owned(self, uuid: str) -> dict[str, int]:
        """Bytes on GPU ``uuid`` per Hub user, from the processes whose owner is known."""
        out: dict[str, int] = {}
        for pid, per in self.pids.items():
            proc = self.procs.get(pid)
            n = per.get(uuid, 0)
            if n and proc is not None and proc.owner:
                out[proc.owner] = out.get(proc.owner, 0) + n
        return out


def _status_fields(pid: int) -> tuple[int | None, int | None]:
    """(real uid, resident + swapped bytes) of ``pid``; Nones when it cannot be read."""
    try:
        text = open(f"/proc/{pid}/status", encoding="ascii", errors="replace").read()
    except FileNotFoundError:
        return None, None
    except OSError:
        text = ""
    uid, kib, seen = None, 0, False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Uid":
            uid = int(value.split()[0])
        elif key in ("VmRSS", "VmSwap"):
            kib += int(value.split()[0])
            seen = True
    if uid is None:  # not Linux, or no /proc
        try:
            p = psutil.Process(pid)
            return p.uids().real, p.memory_info().rss
        except (psutil.Error, OSError):
            return None, None
    return uid, kib * 1024 if seen else None


def _hub_user_in_environment(pid: int) -> str | None:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            return psutil.Process(pid).environ().get("JUPYTERHUB_USER")
        except (psutil.Error, OSError):
            return None
    for item in raw.split(b"\0"):
        if item.startswith(b"JUPYTERHUB_USER="):
            return item.split(b"=", 1)[1].decode("utf-8", "replace")
    return None


def _account(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class Meter:
    """The service's own reading of the node it runs on."""

    def __init__(self, telemetry: Telemetry, backend: str, unix_user: str = "{username}",
                 context_bytes: int = 0):
        self.telemetry = telemetry
        self.backend = backend
        self.unix_user = unix_user
        self.context_bytes = context_bytes
        self._told: set[str] = set()  # accounts told apart by their environment (logged once)

    def close(self) -> None:
        self.telemetry.close()

    def read(self, pids: Iterable[int], users: Iterable[str]) -> Measured:
        """Devices, per-process GPU memory, and the facts of ``pids`` and every GPU process."""
        devices = self.telemetry.devices()
        uuid_of = {d.index: d.uuid for d in devices if d.uuid}
        gpus = {d.uuid: (d.memory_total, d.memory_used) for d in devices if d.uuid}
        per_pid: dict[int, dict[str, int]] = {}
        for p in self.telemetry.processes():
            uuid = uuid_of.get(p.gpu)
            if uuid is not None and p.memory_bytes > 0:
                per = per_pid.setdefault(p.pid, {})
                per[uuid] = per.get(uuid, 0) + p.memory_bytes
        for index, uuid in uuid_of.items():  # free memory read now, as a restore reads it
            free = self.telemetry.free_bytes(index)
            total = gpus[uuid][0]
            if free is not None and total is not None:
                gpus[uuid] = (total, total - free)
        accounts = {self.unix_user.format(username=u): u for u in users} if self.unix_user else {}
        procs = {pid: self.proc(pid, accounts) for pid in set(pids) | set(per_pid)}
        return Measured(clock.now(), self.backend, gpus, per_pid, procs, self.context_bytes)

    def proc(self, pid: int, accounts: dict[str, str]) -> Proc:
        if pid <= 0:
            return Proc(None, None)
        uid, host = _status_fields(pid)
        if uid is None:
            return Proc(None, None)  # gone
        account = _account(uid)
        if account is not None and account in accounts:
            return Proc(accounts[account], host)  # each user has an account: it decides
        owner = _hub_user_in_environment(pid)
        if owner and account not in self._told and uid not in (0, os.getuid()):
            self._told.add(account or str(uid))
            log.warning("gpushare hub: processes of the OS account %s are told apart by the "
                        "JUPYTERHUB_USER in their environment; if each Hub user has an OS account "
                        "of their own, set GPUShareHub.unix_user to its name pattern (now %r)",
                        account or uid, self.unix_user)
        return Proc(owner, host)


def open_meter(backend: str, simulated_node: str, unix_user: str,
               context_bytes: int | None) -> tuple[Meter | None, str]:
    """The service's meter for ``backend`` (see ``GPUShareHub.backend``), or None and why."""
    if backend == "off":
        return None, "measuring is off (GPUShareHub.backend = \"off\")"
    if backend == "simulated" or (backend == "auto" and simulated_node):
        if not simulated_node:
            return None, "a simulated node is measured only when it is shared (GPUShareHub.simulated_node)"
        if not os.path.exists(simulated_node):
            return None, f"no simulated node at {simulated_node}"
        from ..telemetry.simulated import SimulatedTelemetry

        try:
            sim = SimulatedTelemetry.create(TelemetrySettings(simulated_node=simulated_node))
            sim.open()
        except Exception as e:  # a ledger it may not trust or read: say so, do not stop the service
            return None, f"the simulated node {simulated_node} cannot be read: {e}"
        # no CUDA context on the simulated GPU: a state is restored to exactly its bytes
        return Meter(sim, "simulated", unix_user, context_bytes or 0), f"the simulated node {simulated_node}"
    from ..telemetry.nvml import NVMLTelemetry

    nvml = NVMLTelemetry(log=log)
    status = nvml.open()
    if not status.available or not nvml.devices():
        nvml.close()
        why = status.reason or "NVML sees no GPU"
        return None, f"NVML unavailable on this machine ({why})"
    meter = Meter(nvml, "nvml", unix_user, 768 << 20 if context_bytes is None else context_bytes)
    return meter, "NVML"
