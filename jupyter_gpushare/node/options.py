"""The node-level options of the server (``c.GPUShareApp.NAME``): where kernels are placed
and where restores of the machine's servers take turns."""

from __future__ import annotations

import os
from typing import Any

from jupyter_core.paths import jupyter_runtime_dir
from traitlets import Enum, Float, Int, Unicode, default, validate
from traitlets.config import Configurable

from ..policy.options import non_negative
from .daemon_client import NODE_DAEMON_ENV


class NodeOptions(Configurable):
    """Placement of kernels on GPUs, and turns across the servers of one machine."""

    node_lock_dir = Unicode(
        help="""A directory the Jupyter servers of this machine share, where restores take a
        lock file per GPU (named by the GPU's UUID), so that restores on different servers take
        turns on a GPU instead of both filling the same free memory. Used only where no other
        user can take the locks: the directory (not a symbolic link) must belong to this
        server's user and be writable by nobody else, or belong to root and be writable by
        nobody else or sticky; a lock file must be a regular file of this user or root.
        Created (mode 0700) when missing. Default: gpushare-locks in this user's Jupyter
        runtime directory, which serializes this user's own servers: with it, a GPU where a
        process other than this server's kernels holds memory gets the check of a restore
        without a turn (below), said once in the log; a directory set here is taken as shared
        by every server that uses the GPUs. For a node with several
        users' servers, an admin creates a root-owned directory and one root-owned lock file
        per GPU (see the admin guide) and sets it here. A directory or lock file that does not
        qualify is refused with a warning in the log, and restores on that GPU then go on
        without a turn and ask for room for twice their state, read twice 0.5 s apart. The wait
        for a turn another server holds is shown in the cell and status, and is bounded per
        GPU: 60 s per holder, after which restores there go on without a turn while it keeps
        it. "" = restores take turns only within this server (no lock files), and a GPU
        where a process that is none of this server's kernels holds memory gets the check of
        a restore without a turn, as with the default directory. Not used with a private
        simulated node (no other server sees it).""",
    ).tag(config=True)

    @default("node_lock_dir")
    def _default_node_lock_dir(self) -> str:
        return os.path.join(jupyter_runtime_dir(), "gpushare-locks")  # not at import

    node_daemon_socket = Unicode(
        help="""The Unix socket of the node daemon (`jupyter gpushare node-daemon`, run by an
        admin as root on a node shared by users who do not trust each other), which then owns
        the restore turns per GPU of every server on the node: a restore asks it for its GPUs'
        turns, all at once, and holds them until its bytes have landed; the daemon knows each
        server by its Unix user (SO_PEERCRED) and revokes a turn held longer than its
        --turn-timeout, so no user stalls the others' restores for longer. When set,
        node_lock_dir is not used (no lock files). Room checks read free GPU memory from the
        daemon too (this server's own reading when it does not answer within 1 s). The servers
        also tell each other their placed kernels and released states through it (every poll
        and right after a placement: what kernels placed and not using their GPUs yet are
        expected to take, and what released kernels' states take back at their restores),
        which placement counts as taken room (and pending load) and the release policy as
        wanted memory; a daemon that does not answer within 1 s leaves placement to this
        server's own view, said once in the log. The daemon
        is used only when its process runs as root or as this server's user. When it cannot
        be reached (or is not trusted, or refuses), restores go on without a turn and ask for room for twice their state,
        read twice 0.5 s apart, with a warning in the log that says why, as with a refused
        node_lock_dir. Default: the environment variable JUPYTER_GPUSHARE_NODE_DAEMON, else ""
        = not used (lock files in node_lock_dir). Not used with a private simulated node.""",
    ).tag(config=True)

    @default("node_daemon_socket")
    def _default_node_daemon_socket(self) -> str:
        return os.environ.get(NODE_DAEMON_ENV, "")

    turnless_restore_after = Float(
        30.0,
        help="""Seconds a restore without a turn across servers (its GPU's lock file refused,
        or held by another server past the bound, or the node daemon unreachable) waits for
        room for twice its state while its GPUs have room for it once; after that, room for
        once will do, read three times over 1 s after a random pause of up to 1 s (two
        servers doing the same at once then rarely both pass), and the cell says so. Room for
        twice the state lets two such restores started at the same moment both fit, but on a
        nearly full GPU it may never come while nothing else frees memory. The risk it
        bounds: another server's restore without a turn starting in the same instant, on the
        same GPU, with room for one of the two (the driver method can then leave one process
        unable to come back; an admin removes it with a root-owned node_lock_dir or the node
        daemon). Default 30. 0 = never: such restores wait for room for twice their state.""",
    ).tag(config=True)

    placement = Enum(
        ["room", "off"],
        default_value="room",
        help="""How a kernel the server starts gets its GPU(s). "room": the gpushare kernel
        provisioner sets the kernel's CUDA_VISIBLE_DEVICES to the GPU(s) chosen by the
        placement rule: a GPU qualifies when its room (free memory read at launch, less the
        bytes this server's released kernels will take back and its restores have reserved)
        covers what the kernel is expected to need (its kernelspec's
        metadata.gpushare.memory, bytes or "8GiB"; else the most its kernelspec's recent
        kernels held on one GPU; else context_bytes); qualifying GPUs rank by SM load over
        load_window plus the expected load of kernels placed there that have not used the
        GPU yet (this server's; with the hub service, every server's), then by kernels there, then by room; its device 0 is the
        best. An existing CUDA_VISIBLE_DEVICES in the kernel's or the server's environment
        is the set it chooses within. How many GPUs: the kernelspec's
        metadata.gpushare.gpus, else placement_gpus. A kernel placed where no GPU has room
        (less than context_bytes) starts anyway and its first cell says so (IPython kernels
        with the agent; the server log for all). "off": the environment decides, as without
        gpushare (for spawners that pin GPUs). Needs the gpushare provisioner (kernels of
        another provisioner are not placed); MIG instances are not placed. Default "room".""",
    ).tag(config=True)

    load_window = Float(
        120.0,
        help="""Seconds of SM samples a GPU's load is the mean of, where placement and
        restores weigh GPUs (a new kernel goes to the least loaded GPU with room; a restore
        whose GPU is contended goes to a quieter one), and over which kernels count as
        computing on a GPU (at least the last 10 s): how busy a GPU is now, for a choice
        made once. Rebalance judges contention over its own, longer window (5 x
        rebalance_idle, at least this one). Default 120. 0 = the last sample alone.""",
    ).tag(config=True)

    @validate("load_window", "turnless_restore_after")
    def _check_node_load_window(self, proposal: Any) -> float:
        return float(non_negative(self, proposal))

    placement_gpus = Int(
        1,
        help="""How many GPUs a kernel gets with placement = "room" when its kernelspec does not
        say (metadata.gpushare.gpus). Default 1. Capped at the GPUs the kernel may use (a
        kernelspec asking for more than that is refused at start with the reason). 0 = no
        GPU: CUDA_VISIBLE_DEVICES="".""",
    ).tag(config=True)

    @validate("placement_gpus")
    def _check_node_placement_gpus(self, proposal: Any) -> int:
        return int(non_negative(self, proposal))
