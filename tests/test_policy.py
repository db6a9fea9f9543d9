"""The release policy: pure functions, no server needed."""

from __future__ import annotations

from jupyter_gpushare.policy import (
    Candidate,
    Policy,
    PolicyConfig,
    decide,
    effective_idle_timeout,
    make_room,
    seconds_until_release,
)

GiB = 1 << 30
CFG = PolicyConfig(idle_timeout=600, idle_utilization=5, min_release_bytes=GiB // 4,
                   pressure_free_fraction=0.1, pressure_idle_timeout=120)


def cand(kid: str, idle: float = 0, gib: float = 1, gpu: int = 0, **kw) -> Candidate:
    base = {"resident": True, "busy": False, "pinned": False, "max_utilization": 0.0}
    base.update(kw)
    return Candidate(kernel_id=kid, idle_seconds=idle, gpu_bytes={gpu: int(gib * GiB)}, **base)


def ids(decisions) -> list[str]:
    return [d.kernel_id for d in decisions]


def test_idle_past_timeout_is_released_with_reason():
    (d,) = decide([cand("a", idle=601)], {0: 80 * GiB}, {0: 80 * GiB}, CFG)
    # no parentheses of its own: the lab's toast wraps the reason in parentheses
    assert d.kernel_id == "a" and d.reason == "idle for 601 s, idle_timeout 600 s"


def test_each_condition_keeps_a_kernel():
    keep = [
        cand("young", idle=599),
        cand("busy", idle=601, busy=True),
        cand("pinned", idle=601, pinned=True),
        cand("gpu-busy", idle=601, max_utilization=30),
        cand("small", idle=601, gib=0.1),
        cand("opted-out", idle=601, idle_timeout=0),
        cand("released", idle=601, resident=False),
        cand("no-method", idle=601, releasable=False),
    ]
    assert decide(keep, {0: 80 * GiB}, {0: 80 * GiB}, CFG) == []


def test_per_kernel_timeout_overrides_the_server():
    assert ids(decide([cand("a", idle=61, idle_timeout=60)], {0: 80 * GiB}, {0: 80 * GiB}, CFG)) == ["a"]
    assert decide([cand("a", idle=601)], {0: 80 * GiB}, {0: 80 * GiB},
                  PolicyConfig(idle_timeout=0)) == []  # 0 = never automatically


def test_pressure_releases_longest_idle_first_until_enough_is_free():
    cands = [cand("short", idle=130, gib=4), cand("long", idle=500, gib=4), cand("mid", idle=300, gib=4),
             cand("fresh", idle=10, gib=4)]
    # 80 GiB GPU with 2 GiB free: needs 8 GiB -> 6 GiB more -> two kernels, longest idle first
    out = decide(cands, {0: 2 * GiB}, {0: 80 * GiB}, CFG)
    assert ids(out) == ["long", "mid"]
    assert all("memory pressure on GPU 0" in d.reason for d in out)


def test_pressure_only_on_the_gpu_under_pressure():
    cands = [cand("on0", idle=500, gpu=0), cand("on1", idle=500, gpu=1)]
    out = decide(cands, {0: 1 * GiB, 1: 70 * GiB}, {0: 80 * GiB, 1: 80 * GiB}, CFG)
    assert ids(out) == ["on0"]


def test_make_room_takes_idle_kernels_on_the_needed_gpu():
    cands = [cand("other-gpu", idle=900, gpu=1, gib=8), cand("a", idle=200, gib=2),
             cand("b", idle=800, gib=3), cand("recent", idle=20, gib=10)]
    plan = make_room({0: 6 * GiB}, {0: 2 * GiB}, cands, CFG, exclude="me")
    assert ids(plan) == ["b", "a"]  # 3 + 2 >= 4 short, longest idle first


def test_make_room_says_none_when_it_cannot_fit():
    assert make_room({0: 6 * GiB}, {0: 1 * GiB}, [cand("recent", idle=20, gib=10)], CFG) is None
    assert make_room({0: 1 * GiB}, {0: 2 * GiB}, [], CFG) == []  # already fits


def test_seconds_until_release():
    assert seconds_until_release(cand("a", idle=100), CFG) == 500
    assert seconds_until_release(cand("a", idle=100, pinned=True), CFG) is None
    assert seconds_until_release(cand("a", idle=100, gib=0.1), CFG) is None
    assert seconds_until_release(cand("a", idle=900), CFG) == 0


def test_pressure_and_make_room_judge_quietness_over_the_pressure_window():
    """A kernel that computed 5 min ago (inside the 10-min idle window, outside the 2-min
    pressure window) and has idled since may be taken under pressure or to make room."""
    computed_earlier = cand("earlier", idle=300, gib=4, max_utilization=90, pressure_utilization=0)
    computing_now = cand("now", idle=300, gib=4, max_utilization=90, pressure_utilization=90)
    assert ids(decide([computed_earlier, computing_now], {0: 2 * GiB}, {0: 80 * GiB}, CFG)) \
        == ["earlier"]
    assert ids(make_room({0: 4 * GiB}, {0: 1 * GiB}, [computed_earlier, computing_now], CFG)) \
        == ["earlier"]
    # the idle timeout still judges over its own window
    assert decide([cand("earlier", idle=601, max_utilization=90, pressure_utilization=0)],
                  {0: 80 * GiB}, {0: 80 * GiB}, CFG) == []
    # callers that do not know the pressure window: judged as before, over the idle window
    assert make_room({0: 4 * GiB}, {0: 1 * GiB}, [cand("old", idle=300, gib=4, max_utilization=90)],
                     CFG) is None


def test_effective_idle_timeout_is_the_kernels_else_the_servers():
    assert effective_idle_timeout(None, 600) == 600
    assert effective_idle_timeout(0, 600) == 0  # the kernel opted out
    assert effective_idle_timeout(30, 0) == 30  # the kernel opted in on a server that never releases
    assert seconds_until_release(cand("a", idle=10, idle_timeout=30), PolicyConfig(idle_timeout=0)) == 20


def test_the_policy_class_applies_the_module_rules_by_default():
    rules = Policy(CFG)
    cands = [cand("long", idle=500, gib=4), cand("fresh", idle=10, gib=4)]
    assert rules.decide(cands, {0: 2 * GiB}, {0: 80 * GiB}) == decide(cands, {0: 2 * GiB}, {0: 80 * GiB}, CFG)
    assert rules.make_room({0: 4 * GiB}, {0: 1 * GiB}, cands) == make_room({0: 4 * GiB}, {0: 1 * GiB}, cands, CFG)
    assert rules.seconds_until_release(cands[1]) == 590
