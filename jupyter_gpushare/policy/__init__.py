"""Which kernels to release, and which to release to make room.

Pure functions, no I/O and no clock of their own: callers pass ``now``-derived numbers in,
so the simulator and the tests run this module unchanged. :class:`Policy` is what the server
calls; it is swappable (``c.GPUShareApp.policy_class``): a subclass that overrides
``decide``, ``make_room`` or ``seconds_until_release`` changes the rules (quotas, fair
share) without touching the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from traitlets.config import LoggingConfigurable

from . import caps

#: when an idle kernel is released (``c.GPUShareApp.release_policy``): ``proactive``, once it
#: has idled ``idle_timeout``; ``needs``, only when its GPU needs the memory (free below
#: ``pressure_free_fraction``, a restore waiting for room) or after ``long_idle`` where its GPU
#: has less than ``long_idle_free_fraction`` free
RELEASE_POLICIES = ("proactive", "needs")


class ReleaseSettings(Protocol):
    """The thresholds the rules read. The server's are its options (``c.GPUShareApp.*``,
    :class:`.options.ReleaseOptions`); the simulator and the tests use :class:`PolicyConfig`."""

    @property
    def idle_timeout(self) -> float: ...
    @property
    def idle_utilization(self) -> float: ...
    @property
    def min_release_bytes(self) -> int: ...
    @property
    def pressure_free_fraction(self) -> float: ...
    @property
    def pressure_idle_timeout(self) -> float: ...
    @property
    def release_policy(self) -> str: ...
    @property
    def long_idle(self) -> float: ...
    @property
    def long_idle_free_fraction(self) -> float: ...


@dataclass(frozen=True)
class PolicyConfig:
    """Release settings as plain values: the product's defaults, except ``release_policy``.

    ``release_policy`` is ``"proactive"`` here, while the server's option defaults to
    ``"needs"`` (:class:`.options.ReleaseOptions`): the simulator models both release policies
    on top of these rules' proactive answers (``simulate/policies.py``), and the rules' own
    tests read ``idle_timeout`` as the time of the release. Say ``release_policy="needs"`` to
    get the server's default rules."""

    idle_timeout: float = 600.0  # s; 0 = never release automatically
    idle_utilization: float = 5.0  # SM % at or below which a kernel counts as idle
    min_release_bytes: int = 256 << 20
    pressure_free_fraction: float = 0.1  # 0 = no pressure releases
    pressure_idle_timeout: float = 120.0  # s
    release_policy: str = "proactive"  # one of RELEASE_POLICIES
    long_idle: float = 7200.0  # s; "needs": released anyway after this long idle; 0 = never
    #: "needs": a long-idle release only where its GPU has less than this share free; 1 = always
    long_idle_free_fraction: float = 0.25


@dataclass(frozen=True)
class Candidate:
    """What the policy needs to know about one kernel."""

    kernel_id: str
    resident: bool  # its GPU state is on the GPU (active / idle)
    busy: bool  # executing now
    pinned: bool
    idle_seconds: float
    max_utilization: float  # highest SM % over the idle window
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    idle_timeout: float | None = None  # per-kernel override (kernelspec, magic); 0 = never
    releasable: bool = True  # a release method exists for it
    #: highest SM % over the last ``pressure_idle_timeout`` (pressure releases and make-room
    #: judge quietness over that window); None: as ``max_utilization``
    pressure_utilization: float | None = None
    #: holds more than its memory cap on some GPU: released first when someone needs room
    over_cap: bool = False

    @property
    def bytes(self) -> int:
        return sum(self.gpu_bytes.values())


def observed(
    kernel_id: str, cfg: ReleaseSettings, now: float, *, resident: bool, busy: bool,
    pinned: bool, idle_seconds: float, utilization_since: Callable[[float], float],
    gpu_bytes: dict[int, int], idle_timeout: float | None = None, releasable: bool = True,
    pressure_window: float | None = None, memory_cap: int | None = None, cap_slack: int = 0,
    over_cap: bool | None = None,
) -> Candidate:
    """A :class:`Candidate` from what was observed of a kernel: the one builder (the server's
    controller, the simulator and the hub's view all use it, so they judge alike).

    ``utilization_since(t)``: the kernel's highest SM % since time ``t`` (its clock is
    ``now``'s). Quietness is judged over the kernel's idle window and over the pressure window
    (``pressure_window`` seconds, default ``pressure_idle_timeout``), each at least one second
    so that it holds one sample. GPU -1 (memory on no known GPU) is not counted as room."""
    since = now - max(effective_idle_timeout(idle_timeout, cfg.idle_timeout), 1.0)
    window = cfg.pressure_idle_timeout if pressure_window is None else pressure_window
    return Candidate(
        kernel_id=kernel_id,
        resident=resident,
        busy=busy,
        pinned=pinned,
        idle_seconds=idle_seconds,
        max_utilization=utilization_since(since),
        pressure_utilization=utilization_since(now - max(window, 1.0)),
        gpu_bytes={g: b for g, b in gpu_bytes.items() if g >= 0},
        idle_timeout=idle_timeout,
        releasable=releasable,
        # over its memory cap (plus a CUDA context, ``cap_slack``), unless the caller knows
        over_cap=(caps.over(gpu_bytes, memory_cap, cap_slack) is not None
                  if over_cap is None else over_cap),
    )


@dataclass(frozen=True)
class Decision:
    kernel_id: str
    reason: str


def effective_idle_timeout(kernel: float | None, server: float) -> float:
    """A kernel's idle timeout: its own (kernelspec ``metadata.gpushare.idle_timeout``,
    ``%gpushare idle-timeout``) when it has one, else the server's ``idle_timeout``.
    0 = never released automatically (idle, pressure or make-room)."""
    return server if kernel is None else kernel


def _quiet(c: Candidate, cfg: ReleaseSettings, utilization: float | None = None) -> bool:
    """Eligible at all: resident, not busy, not pinned, GPU quiet, holds enough to matter.

    ``utilization``: the SM % to judge quietness by (default: over the idle window)."""
    is_resident_and_still = c.resident and not c.busy
    used = c.max_utilization if utilization is None else utilization
    is_gpu_quiet = used <= cfg.idle_utilization
    holds_enough = c.bytes >= max(cfg.min_release_bytes, 1)
    opted_out = effective_idle_timeout(c.idle_timeout, cfg.idle_timeout) == 0
    return is_resident_and_still and is_gpu_quiet and holds_enough and not c.pinned \
        and not opted_out and c.releasable


def eligible(c: Candidate, cfg: ReleaseSettings) -> bool:
    """May be released for room at all (idle time aside): resident, not busy, not pinned, not
    opted out, quiet on the GPU over the pressure window, holds enough, a method can act on
    it. The one definition of "a person working": the node-wide service uses it too."""
    return _quiet(c, cfg, c.pressure_utilization)


def may_take_for_room(c: Candidate, cfg: ReleaseSettings) -> bool:
    """Eligible for a pressure release or make-room: quiet over the pressure window (a kernel
    that computed before it and has idled past ``pressure_idle_timeout`` may be taken)."""
    return c.idle_seconds >= cfg.pressure_idle_timeout and eligible(c, cfg)


def release_timeout(c: Candidate, cfg: ReleaseSettings) -> tuple[float, str]:
    """Seconds idle after which the kernel is released with no other reason (0: never), and
    the setting that says so (for the reason shown).

    ``proactive``: its idle timeout (its own, else the server's ``idle_timeout``). ``needs``:
    its own idle timeout when it has one (a kernelspec or a person asked for that kernel),
    else the server's ``long_idle``. An idle timeout of 0 (the kernel's or the server's) is
    never under both: such a kernel is not released automatically at all."""
    timeout = effective_idle_timeout(c.idle_timeout, cfg.idle_timeout)
    if timeout <= 0:
        return 0.0, "idle_timeout"
    if cfg.release_policy == "needs" and c.idle_timeout is None:
        return max(cfg.long_idle, 0.0), "long_idle"
    return timeout, "idle_timeout"


def idle_release(c: Candidate, cfg: ReleaseSettings) -> Decision | None:
    """The release an idle kernel is due with no other reason: after its idle timeout
    (``proactive``) or after ``long_idle`` (``needs``; :func:`release_timeout`), the latter
    only where its GPU lacks free memory (:func:`long_idle_releases`, which :func:`decide`
    applies). Memory pressure (:func:`pressure_releases`) and room for a restore
    (:func:`make_room`) are their own rules, the same under both release policies."""
    timeout, setting = release_timeout(c, cfg)
    automatic_release_on = timeout > 0
    idle_long_enough = c.idle_seconds >= timeout
    if automatic_release_on and idle_long_enough and _quiet(c, cfg):
        # no parentheses: the lab's toasts put the reason in parentheses themselves
        return Decision(c.kernel_id, f"idle for {c.idle_seconds:.0f} s, {setting} {timeout:.0f} s")
    return None


def seconds_until_release(c: Candidate, cfg: ReleaseSettings) -> float | None:
    """When an automatic release will happen if nothing changes (None: never). Under
    ``needs`` that is the long-idle release: a GPU that comes to need the memory (pressure, a
    restore waiting for room) may take the kernel sooner, under both release policies."""
    timeout, _ = release_timeout(c, cfg)
    if timeout <= 0 or c.pinned or not c.resident or not c.releasable:
        return None
    if c.bytes < cfg.min_release_bytes:
        return None
    return max(0.0, timeout - c.idle_seconds)


def _longest_idle_first(cands: list[Candidate]) -> list[Candidate]:
    """Kernels over their memory cap first (they hold what they were not to hold), then
    the longest idle."""
    return sorted(cands, key=_release_order)


def _release_order(c: Candidate) -> tuple[bool, float, int, str]:
    return (not c.over_cap, -c.idle_seconds, -c.bytes, c.kernel_id)


def pressure_releases(
    candidates: list[Candidate], free: dict[int, int], total: dict[int, int], cfg: ReleaseSettings
) -> list[Decision]:
    """On each GPU whose free fraction is below ``pressure_free_fraction``, release idle
    kernels (idle >= ``pressure_idle_timeout``) longest-idle first until it is above again."""
    if cfg.pressure_free_fraction <= 0:
        return []
    decisions: list[Decision] = []
    chosen: set[str] = set()
    for gpu, capacity in total.items():
        if not capacity:
            continue
        free_now = free.get(gpu, 0)
        if free_now / capacity >= cfg.pressure_free_fraction:
            continue
        pool = [c for c in candidates if c.gpu_bytes.get(gpu) and c.kernel_id not in chosen
                and may_take_for_room(c, cfg)]
        for c in _longest_idle_first(pool):
            if free_now / capacity >= cfg.pressure_free_fraction:
                break
            chosen.add(c.kernel_id)
            free_now += c.gpu_bytes[gpu]
            decisions.append(Decision(
                c.kernel_id,
                f"memory pressure on GPU {gpu}: idle for {c.idle_seconds:.0f} s",
            ))
    return decisions


def long_idle_releases(
    due: list[tuple[Candidate, Decision]], free: dict[int, int], total: dict[int, int],
    cfg: ReleaseSettings,
) -> list[Decision]:
    """Of the releases due at ``long_idle`` (``needs``), those on a GPU with less than
    ``long_idle_free_fraction`` of its memory free, longest idle first, until that share is
    free again. A kernel left idle for hours on a GPU with room costs no one anything, while
    its release makes its person's next cell wait for the restore (no activity is seen ahead
    of a cell). A GPU filling up with forgotten kernels still sheds them before its pressure
    threshold, so that new kernels' first allocations find room."""
    share = cfg.long_idle_free_fraction
    if share >= 1:
        return [d for _, d in due]
    free_now = dict(free)
    out: list[Decision] = []
    for c, d in sorted(due, key=lambda cd: _release_order(cd[0])):
        short = [g for g in c.gpu_bytes
                 if total.get(g) and free_now.get(g, 0) / total[g] < share]
        if short:
            out.append(d)
            for g, b in c.gpu_bytes.items():
                free_now[g] = free_now.get(g, 0) + b
    return out


def decide(
    candidates: list[Candidate], free: dict[int, int], total: dict[int, int], cfg: ReleaseSettings
) -> list[Decision]:
    """Everything to release now: idle releases first (:func:`idle_release`: at the idle
    timeout, or under ``needs`` at ``long_idle`` where the GPU lacks free memory,
    :func:`long_idle_releases`), then memory pressure."""
    due = [(c, d) for c in candidates if (d := idle_release(c, cfg)) is not None]
    on_long_idle = [(c, d) for c, d in due if release_timeout(c, cfg)[1] == "long_idle"]
    out = [d for c, d in due if release_timeout(c, cfg)[1] != "long_idle"]
    out += long_idle_releases(on_long_idle, free, total, cfg)
    taken = {d.kernel_id for d in out}
    rest = [c for c in candidates if c.kernel_id not in taken]
    out += pressure_releases(rest, free, total, cfg)
    return out


def make_room(
    need: dict[int, int], free: dict[int, int], candidates: list[Candidate], cfg: ReleaseSettings,
    exclude: str = "",
) -> list[Decision] | None:
    """Kernels to release so ``need`` bytes fit on each GPU; None when it cannot fit.

    Only kernels idle for at least ``pressure_idle_timeout`` are taken, those over their
    memory cap first, then longest idle first, so two people working at once never evict
    each other.
    """
    short = {g: n - free.get(g, 0) for g, n in need.items() if n > free.get(g, 0)}
    if not short:
        return []
    pool = [c for c in candidates if c.kernel_id != exclude and may_take_for_room(c, cfg)]
    decisions: list[Decision] = []
    for c in _longest_idle_first(pool):
        if not any(c.gpu_bytes.get(g) for g in short):
            continue
        decisions.append(Decision(c.kernel_id, f"making room for a restore: idle for {c.idle_seconds:.0f} s"))
        for g in list(short):
            short[g] -= c.gpu_bytes.get(g, 0)
            if short[g] <= 0:
                del short[g]
        if not short:
            return decisions
    return None


class Policy(LoggingConfigurable):
    """The release rules the server applies, after every poll and when a restore needs room.

    The default is this module's functions. To change the rules, subclass and point
    ``c.GPUShareApp.policy_class`` at the subclass; it may declare its own options
    (``c.MyPolicy.NAME``, traitlets with ``config=True``). Each method gets candidates built
    by the controller (:class:`Candidate`: resident, busy, pinned, idle seconds, utilization
    over the idle and the pressure windows, bytes per GPU, releasable) and returns decisions;
    the controller checks what can only be checked at the moment (host memory, the agent's
    word on "busy") and carries them out. ``self.settings`` holds the server's thresholds.
    """

    def __init__(self, settings: ReleaseSettings | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.settings: ReleaseSettings = settings or PolicyConfig()

    def decide(self, candidates: list[Candidate], free: dict[int, int],
               total: dict[int, int]) -> list[Decision]:
        """Everything to release now. ``free``: free bytes per GPU (minus restores' reservations);
        ``total``: each GPU's memory."""
        return decide(candidates, free, total, self.settings)

    def make_room(self, need: dict[int, int], free: dict[int, int], candidates: list[Candidate],
                  exclude: str = "") -> list[Decision] | None:
        """Kernels to release so ``need`` bytes per GPU fit for a restore (of ``exclude``);
        None when it cannot fit."""
        return make_room(need, free, candidates, self.settings, exclude)

    def seconds_until_release(self, candidate: Candidate) -> float | None:
        """When the kernel will be released if nothing changes (None: never); the panel and
        ``%gpushare`` show it."""
        return seconds_until_release(candidate, self.settings)
