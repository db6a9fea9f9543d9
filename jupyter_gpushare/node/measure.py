"""A GPU node measured by a party users cannot change, so that nobody has to take a server's
word: the hub service when it runs on the node, or the node daemon (``--listen``) for a
service that runs elsewhere (a Kubernetes hub pod). One implementation for both.

A user's server runs as that user, who can change it or replace it with a program of their
own: what it reports is a claim. The measuring party reads the same telemetry the servers
read (NVML, or the simulated node's shared ledger), and the kernels' processes in ``/proc``:

- each GPU's total and used memory (the service's reading wins over any server's);
- the GPU memory of each process, by GPU UUID;
- for the processes it is asked about: whose they are (their OS account when each Hub user
  has one, ``unix_user``; else the ``JUPYTERHUB_USER`` the Hub set in their environment; for a
  process in a pod's PID namespace, the ``JUPYTERHUB_USER`` of the pod's first process, which
  the spawner set and the pod's user cannot change) and how much host memory they hold
  (resident plus swapped: where a released state lives).

The pids a server in a pod names are that pod's own; :meth:`Meter.read_servers` translates
them to the node's (``NSpid`` in ``/proc/PID/status``), in the pod whose first process names
that server, so a server can only ever name processes of its own pod.

Blocking (NVML, SQLite, ``/proc``): callers run :meth:`Meter.read` in a thread.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

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
    # per GPU, bytes per Hub user, where they were summed by whoever measured (a node daemon:
    # the pids above are then one server's own, not the node's)
    owners: dict[str, dict[str, int]] | None = None
    node: str = ""  # who measured: "" this process, else the node daemon's node
    host: dict[int, int] = field(default_factory=dict)  # a server's pid -> the node's pid

    def key(self, pid: int) -> tuple[str, int]:
        """One process, the same whichever server names it (pids differ between pods)."""
        return self.node, self.host.get(pid, pid)

    def owned(self, uuid: str) -> dict[str, int]:
        """Bytes on GPU ``uuid`` per Hub user, from the processes whose owner is known."""
        if self.owners is not None:
            return dict(self.owners.get(uuid, {}))
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


def _environment(pid: int, keys: tuple[str, ...]) -> dict[str, str] | None:
    """The values of ``keys`` in the environment ``pid`` started with (None: gone)."""
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            env = psutil.Process(pid).environ()
        except (psutil.Error, OSError):
            return {}
        return {k: env[k] for k in keys if k in env}
    out = {}
    for item in raw.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name.decode("utf-8", "replace") in keys:
            out[name.decode()] = value.decode("utf-8", "replace")
    return out


def _hub_user_in_environment(pid: int) -> str | None:
    return (_environment(pid, ("JUPYTERHUB_USER",)) or {}).get("JUPYTERHUB_USER")


def _pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:  # not Linux, gone, or not ours to read: taken as our own namespace
        return None


def _nspid(pid: int) -> tuple[int, ...]:
    """The process's pid in each PID namespace it is in, the node's first."""
    try:
        for line in open(f"/proc/{pid}/status", encoding="ascii", errors="replace"):
            if line.startswith("NSpid:"):
                return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


class PidSpaces:
    """The PID namespaces one level below this process's own (each pod's, on a Kubernetes
    node whose daemon shares the host's PID namespace), with the Hub user and server the
    namespace's first process names: the spawner set them, the pod's user cannot change them.
    A namespace deeper down (one a user made) names nobody.

    One scan of ``/proc`` (a ``readlink`` per process: milliseconds on a busy node) serves for
    ``SCAN_FOR`` seconds; every pid it is asked about is checked again when it is used (a pid
    reused since by a process of another pod is not that pod's)."""

    def __init__(self) -> None:
        self.own = _pid_namespace("self")
        self.level = len(_nspid(os.getpid())) or 1
        self.members: dict[str, dict[int, int]] = {}  # namespace -> its pid -> the node's pid
        self.server: dict[str, tuple[str, str]] = {}  # namespace -> (user, server name)
        self.at = float("-inf")  # clock.monotonic() of the scan

    def foreign(self, pid: int) -> bool:
        ns = _pid_namespace(pid)
        return ns is not None and self.own is not None and ns != self.own

    def scan(self) -> None:
        self.at = clock.monotonic()
        members: dict[str, dict[int, int]] = {}
        server: dict[str, tuple[str, str]] = {}
        try:
            entries = [int(e) for e in os.listdir("/proc") if e.isdigit()] if self.own else []
        except OSError:
            entries = []
        for pid in entries:
            ns = _pid_namespace(pid)
            if ns is None or ns == self.own:
                continue
            chain = _nspid(pid)
            if len(chain) == self.level + 1:
                members.setdefault(ns, {})[chain[-1]] = pid
        for ns, pids in members.items():
            env = _environment(pids[1], ("JUPYTERHUB_USER", "JUPYTERHUB_SERVER_NAME")) if 1 in pids else None
            if env and env.get("JUPYTERHUB_USER"):
                server[ns] = (env["JUPYTERHUB_USER"], env.get("JUPYTERHUB_SERVER_NAME", ""))
        self.members, self.server = members, server

    def owner(self, pid: int) -> str | None:
        """The Hub user of the pod ``pid`` runs in (None: no pod names one)."""
        ns = _pid_namespace(pid)
        if ns not in self.server and clock.monotonic() - self.at >= RESCAN_AFTER:
            self.scan()  # a pod started since
        return self.server[ns][0] if ns in self.server else None

    def of_server(self, user: str, name: str, pids: list[int]) -> dict[int, int] | None:
        """``pids`` as the one pod that runs ``user``'s server ``name`` numbers them -> the
        node's pids (-1: none such); None when no pod does (the server shares this namespace:
        its pids are the node's)."""
        for fresh in (False, True):
            if fresh or clock.monotonic() - self.at >= SCAN_FOR:
                if fresh and clock.monotonic() - self.at < RESCAN_AFTER:
                    break
                self.scan()
            found = [ns for ns, who in self.server.items() if who == (user, name)]
            if len(found) > 1:
                return {p: -1 for p in pids}  # two pods claim one server: none of its pids is believed
            if not found:
                continue
            ns, out = found[0], {}
            for p in pids:
                h = self.members[ns].get(p, -1)
                ok = h > 0 and _pid_namespace(h) == ns and _nspid(h)[-1:] == (p,)
                out[p] = h if ok else -1
            if all(h > 0 for h in out.values()):
                return out
        if not found:
            return None
        return out


SCAN_FOR = 5.0  # s one scan of the node's PID namespaces serves
RESCAN_AFTER = 1.0  # s after a scan, a pid or server it does not know scans again


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
        self.spaces = PidSpaces()

    def close(self) -> None:
        self.telemetry.close()

    def read(self, pids: Iterable[int], users: Iterable[str]) -> Measured:
        """Devices, per-process GPU memory, and the facts of ``pids`` and every GPU process."""
        gpus, per_pid = self._gpus()
        accounts = self._accounts(users)
        procs = {pid: self.proc(pid, accounts) for pid in set(pids) | set(per_pid)}
        return Measured(clock.now(), self.backend, gpus, per_pid, procs, self.context_bytes)

    def read_servers(self, servers: Iterable[tuple[str, str, list[int]]],
                     users: Iterable[str]) -> tuple[Measured, list[Measured]]:
        """The node (its GPUs, and what each Hub user holds on each), and for each server
        ``(user, name, pids)`` the facts of the pids it names, keyed by its own pids: a server
        in a pod names its pod's pids, translated here to the node's."""
        gpus, per_pid = self._gpus()
        accounts = self._accounts(users)
        facts = {pid: self.proc(pid, accounts) for pid in per_pid}
        owners: dict[str, dict[str, int]] = {}
        for pid, per in per_pid.items():
            owner = facts[pid].owner
            for uuid, n in per.items():
                if owner:
                    owners.setdefault(uuid, {})[owner] = owners.setdefault(uuid, {}).get(owner, 0) + n
        node = Measured(clock.now(), self.backend, gpus, {}, {}, self.context_bytes, owners)
        out = []
        for user, name, pids in servers:
            wanted = list(dict.fromkeys(pids))
            pod = self.spaces.of_server(user, name, wanted)
            host = pod if pod is not None else {p: p for p in wanted}
            procs, on = {}, {}
            for p, h in host.items():
                if h not in facts:
                    facts[h] = self.proc(h, accounts)
                procs[p] = facts[h]
                if h in per_pid:
                    on[p] = per_pid[h]
            out.append(Measured(node.at, self.backend, gpus, on, procs, self.context_bytes, owners,
                                host={p: h for p, h in host.items() if h > 0}))
        return node, out

    def _gpus(self) -> tuple[dict[str, tuple[int | None, int | None]], dict[int, dict[str, int]]]:
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
        return gpus, per_pid

    def _accounts(self, users: Iterable[str]) -> dict[str, str]:
        return {self.unix_user.format(username=u): u for u in users} if self.unix_user else {}

    def proc(self, pid: int, accounts: dict[str, str]) -> Proc:
        if pid <= 0:
            return Proc(None, None)
        uid, host = _status_fields(pid)
        if uid is None:
            return Proc(None, None)  # gone
        if self.spaces.foreign(pid):
            return Proc(self.spaces.owner(pid), host)  # a pod's: its first process says whose
        account = _account(uid)
        if account is not None and account in accounts:
            return Proc(accounts[account], host)  # each user has an account: it decides
        owner = _hub_user_in_environment(pid)
        if owner and account not in self._told and uid not in (0, os.getuid()):
            self._told.add(account or str(uid))
            log.warning("gpushare: processes of the OS account %s are told apart by the "
                        "JUPYTERHUB_USER in their environment; if each Hub user has an OS account "
                        "of their own, set its name pattern (GPUShareHub.unix_user, the node "
                        "daemon's --unix-user; now %r)", account or uid, self.unix_user)
        return Proc(owner, host)


# -- a reading on the wire (the node daemon's answer to the service) ----------------------------
def encode(m: Measured, whole: bool = True) -> dict[str, Any]:
    """A reading's wire form; not ``whole``: only its processes (one server's part of a
    reading whose node part goes once)."""
    procs = {"pids": {str(p): per for p, per in m.pids.items()},
             "procs": {str(p): [f.owner, f.host_bytes] for p, f in m.procs.items()},
             "host": {str(p): h for p, h in m.host.items()}}
    if not whole:
        return procs
    return {"backend": m.backend, "context_bytes": m.context_bytes,
            "gpus": {u: list(v) for u, v in m.gpus.items()}, **procs,
            **({"owners": m.owners} if m.owners is not None else {})}


def decode(d: Any, at: float, node: str, base: Measured | None = None) -> Measured:
    """A reading from its wire form (with ``base``: one server's processes, the node's part
    taken from ``base``); ValueError when anything in it is not what it should be."""
    if not isinstance(d, dict):
        raise ValueError("a reading must be an object")
    if base is not None:
        d = {**d, "backend": base.backend, "context_bytes": base.context_bytes, "gpus": {}}
    try:
        gpus = {_text(u): (_count(a), _count(b))
                for u, (a, b) in ((u, _pair(v)) for u, v in _object(d.get("gpus")).items())}
        pids = {int(p): {_text(u): _number(n) for u, n in _object(per).items()}
                for p, per in _object(d.get("pids", {})).items()}
        procs = {int(p): Proc(None if a is None else _text(a), _count(b))
                 for p, (a, b) in ((p, _pair(v)) for p, v in _object(d.get("procs", {})).items())}
        host = {int(p): _number(h) for p, h in _object(d.get("host", {})).items()}
        owners = None if d.get("owners") is None else {
            _text(u): {_text(w): _number(n) for w, n in _object(per).items()}
            for u, per in _object(d["owners"]).items()}
        if base is not None:
            gpus, owners = base.gpus, base.owners
        return Measured(at, _text(d.get("backend")), gpus, pids, procs, _number(d.get("context_bytes")),
                        owners, node, host)
    except (TypeError, IndexError) as e:
        raise ValueError(f"a malformed reading: {e}") from None


def _pair(v: Any) -> tuple[Any, Any]:
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError("a pair was expected")
    return v[0], v[1]


def _object(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError("an object was expected")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str) or len(v) > 256:
        raise ValueError("a string was expected")
    return v


def _number(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("a count >= 0 was expected")
    return v


def _count(v: Any) -> int | None:
    return None if v is None else _number(v)


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
