"""The release settings, as the server's options (``c.GPUShareApp.NAME``).

:class:`ReleaseOptions` owns them; the server's app is one (it inherits the class), and the
rules read them through :class:`~jupyter_gpushare.policy.ReleaseSettings`, so no copy of
them is made.
"""

from __future__ import annotations

import math
from typing import Any

from traitlets import Enum, Float, Int, TraitError, Type, validate
from traitlets.config import Configurable

from . import RELEASE_POLICIES, Policy


class ReleaseOptions(Configurable):
    """When an idle kernel's GPU memory is released, and by which rules."""

    release_policy = Enum(
        list(RELEASE_POLICIES),
        default_value="needs",
        help="""When an idle kernel's GPU memory is released. "needs" (the default): only when
        its GPU needs the memory - free memory below pressure_free_fraction (the kernel idle
        for pressure_idle_timeout), or another kernel's restore waiting for room there, or the
        hub service asking - or else after long_idle seconds idle. "proactive": also as soon as
        it has been idle for idle_timeout, whether anyone needs the memory or not (its memory
        is ready before anyone asks, at the price of more restores). Under both, idle_timeout
        0 (the server's or a kernel's own) means never released automatically, and a kernel's
        own idle timeout (kernelspec metadata.gpushare.idle_timeout, %gpushare idle-timeout)
        is honoured: it is released after that long idle. "needs" is the default because on
        the simulated workloads far fewer cells wait for a restore under it (see
        docs/how-it-works.md); "proactive" frees memory before a new kernel allocates it.""",
    ).tag(config=True)

    long_idle = Float(
        7200.0,
        help="""release_policy "needs" only: seconds idle after which a kernel is released even
        though its GPU has room (held memory nobody uses for this long goes to the host, so
        that a GPU does not stay full of forgotten kernels). Default 7200 (2 h). 0 = never:
        released only when the GPU needs the memory. A kernel's own idle timeout replaces it
        for that kernel. Ignored under "proactive" (idle_timeout decides there). The release
        happens only where the kernel's GPU is short of free memory: see
        long_idle_free_fraction.""",
    ).tag(config=True)

    long_idle_free_fraction = Float(
        0.25,
        help="""release_policy "needs" only: a kernel idle for long_idle is released only while
        one of its GPUs has less than this fraction (0-1) of its memory free, longest idle
        first, until that much is free again; on a GPU with more room it stays resident (its
        person's next cell then need not wait for a restore), until the GPU fills or a restore
        or the hub service needs its memory. Default 0.25. 1 = always released at long_idle
        (whatever the room); 0 = never released for being idle long (only when the GPU needs
        the memory: pressure_free_fraction, a waiting restore, the hub service).""",
    ).tag(config=True)

    idle_timeout = Float(
        600.0,
        help="""Seconds a kernel must sit idle (not executing, SM utilization at or below
        idle_utilization) before its GPU memory is released, under release_policy
        "proactive"; under "needs" (the default) it is released then only if its GPU needs
        the memory (see release_policy, long_idle), and this sets the window over which
        quietness is judged. Default 600. 0 = never release automatically, under both
        policies: no idle, pressure or make-room releases (REST, the panel and %gpushare
        release still work). A kernelspec can override it in metadata.gpushare.idle_timeout;
        an override is honoured under both policies.""",
    ).tag(config=True)

    idle_utilization = Float(
        5.0,
        help="""SM utilization (percent, 0-100) at or below which a kernel counts as idle, over
        the idle window. Default 5. 0 = any GPU activity keeps a kernel resident.""",
    ).tag(config=True)

    min_release_bytes = Int(
        256 * 1024 * 1024,
        help="""Kernels holding less GPU memory than this (bytes) are never released
        automatically: moving them is not worth the pause. Default 256 MiB. 0 = release any
        kernel that holds GPU memory.""",
    ).tag(config=True)

    pressure_free_fraction = Float(
        0.1,
        help="""When a GPU's free memory falls below this fraction (0-1) of its total, idle
        kernels on it are released after pressure_idle_timeout instead of idle_timeout,
        longest idle first, until it is above again. Default 0.1. 0 = no pressure releases.
        Under release_policy "needs" this is what frees memory for a new kernel's first
        allocations on a GPU that idle kernels hold (only released kernels wait for room):
        raise it where kernels allocate much at their start.""",
    ).tag(config=True)

    pressure_idle_timeout = Float(
        120.0,
        help="""Seconds idle after which a kernel may be released under memory pressure or to
        make room for another kernel's restore. Default 120. 0 = any idle kernel may be taken
        at once.""",
    ).tag(config=True)

    policy_class = Type(
        default_value=Policy,
        klass=Policy,
        help="""The release rules: a subclass of jupyter_gpushare.policy.Policy whose decide,
        make_room and seconds_until_release say which kernels to release after each poll and
        to make room for a restore (quotas, fair share). It may have options of its own
        (c.MyPolicy.NAME). Default: Policy, the rules docs/how-it-works.md describes.""",
    ).tag(config=True)

    @validate("idle_timeout", "pressure_idle_timeout", "min_release_bytes")
    def _check_release_non_negative(self, proposal: Any) -> Any:
        return non_negative(self, proposal)

    @validate("long_idle")
    def _check_long_idle(self, proposal: Any) -> float:
        value = proposal["value"]
        if not 0 <= value < math.inf:  # NaN and infinity too (0 is "never")
            raise TraitError(f"{type(self).__name__}.long_idle must be a number of seconds >= 0 "
                             f"(0 = never), got {value}")
        return float(value)

    @validate("idle_utilization")
    def _check_release_percent(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] <= 100:
            raise TraitError(f"{type(self).__name__}.idle_utilization is a percentage (0-100), "
                             f"got {proposal['value']}")
        return proposal["value"]

    @validate("pressure_free_fraction")
    def _check_release_fraction(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] < 1:
            raise TraitError(f"{type(self).__name__}.pressure_free_fraction must be in [0, 1), "
                             f"got {proposal['value']}")
        return proposal["value"]

    @validate("long_idle_free_fraction")
    def _check_long_idle_fraction(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] <= 1:  # NaN too
            raise TraitError(f"{type(self).__name__}.long_idle_free_fraction must be in [0, 1], "
                             f"got {proposal['value']}")
        return float(proposal["value"])


# the checks the options classes share (this is the lowest room that has options)
def non_negative(owner: Configurable, proposal: Any) -> Any:
    """A validator's body: the proposed value is >= 0."""
    if proposal["value"] < 0:
        raise TraitError(f"{type(owner).__name__}.{proposal['trait'].name} must be >= 0, "
                         f"got {proposal['value']}")
    return proposal["value"]


def positive(owner: Configurable, proposal: Any) -> float:
    """A validator's body: the proposed value is > 0."""
    if proposal["value"] <= 0:
        raise TraitError(f"{type(owner).__name__}.{proposal['trait'].name} must be > 0, "
                         f"got {proposal['value']}")
    return float(proposal["value"])
