"""The release policy (``release_policy``): "proactive" releases an idle kernel at its idle
timeout; "needs" (the server's default) only when its GPU needs the memory (pressure, a restore
waiting for room) or after ``long_idle`` where its GPU is short of free memory
(``long_idle_free_fraction``). The rules alone, then through a real server with real
kernels on the simulated node, time moved by the replaceable clock."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpushare import clock
from jupyter_gpushare.kernel.magics import status_rows
from jupyter_gpushare.policy import (
    RELEASE_POLICIES,
    Candidate,
    Decision,
    Policy,
    PolicyConfig,
    decide,
    idle_release,
    long_idle_releases,
    make_room,
    seconds_until_release,
)
from jupyter_gpushare.server.app import GPUShareApp

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact, released

GiB = 1 << 30
PROACTIVE = PolicyConfig(idle_timeout=600, idle_utilization=5, min_release_bytes=GiB // 4,
                         pressure_free_fraction=0.1, pressure_idle_timeout=120)
NEEDS = replace(PROACTIVE, release_policy="needs", long_idle=7200)
ROOMY = ({0: 60 * GiB}, {0: 80 * GiB})  # free, total: 75 % free, no pressure
TIGHT = ({0: 4 * GiB}, {0: 80 * GiB})  # 5 % free: below pressure_free_fraction
FILLING = ({0: 12 * GiB}, {0: 80 * GiB})  # 15 % free: no pressure, below long_idle_free_fraction


def cand(kid: str, idle: float = 0, gib: float = 1, gpu: int = 0, **kw) -> Candidate:
    base = {"resident": True, "busy": False, "pinned": False, "max_utilization": 0.0}
    base.update(kw)
    return Candidate(kernel_id=kid, idle_seconds=idle, gpu_bytes={gpu: int(gib * GiB)}, **base)


def ids(decisions) -> list[str]:
    return [d.kernel_id for d in decisions]


# -- the rules ----------------------------------------------------------------------------------
def test_the_policies_and_the_plain_values_default():
    assert RELEASE_POLICIES == ("proactive", "needs")
    # the plain-values twin keeps proactive (the simulator and the rules' tests build on it)
    assert (PolicyConfig().release_policy, PolicyConfig().long_idle) == ("proactive", 7200.0)
    assert Policy().settings.release_policy == "proactive"


def test_needs_keeps_a_kernel_past_idle_timeout_while_its_gpu_has_room():
    k = cand("a", idle=3600)
    assert ids(decide([k], *ROOMY, PROACTIVE)) == ["a"]
    assert decide([k], *ROOMY, NEEDS) == []
    assert idle_release(k, NEEDS) is None


def test_needs_releases_when_its_gpu_is_below_the_pressure_fraction():
    cands = [cand("old", idle=900, gib=4), cand("older", idle=1800, gib=4),
             cand("fresh", idle=60, gib=4), cand("elsewhere", idle=1800, gib=4, gpu=1)]
    free, total = {0: 2 * GiB, 1: 60 * GiB}, {0: 80 * GiB, 1: 80 * GiB}
    # GPU 0 needs 8 GiB free: the longest idle first, until it is above 10 % again; the kernel
    # idle under pressure_idle_timeout and the one on the roomy GPU stay
    out = decide(cands, free, total, NEEDS)
    assert ids(out) == ["older", "old"]
    assert all(d.reason.startswith("memory pressure on GPU 0") for d in out)


def test_needs_releases_after_long_idle_with_its_own_reason():
    assert decide([cand("a", idle=7199)], *FILLING, NEEDS) == []
    (d,) = decide([cand("a", idle=7201)], *FILLING, NEEDS)
    # starts with "idle" as every idle release does (the lab's toasts, the simulator's kinds)
    assert (d.kernel_id, d.reason) == ("a", "idle for 7201 s, long_idle 7200 s")
    # 0 = never by long idle: only the GPU's need releases it
    never = replace(NEEDS, long_idle=0)
    assert decide([cand("a", idle=10 ** 6)], *ROOMY, never) == []
    assert ids(decide([cand("a", idle=10 ** 6)], *TIGHT, never)) == ["a"]


def test_long_idle_keeps_a_kernel_whose_gpu_has_room():
    # idle for days on a GPU 75 % free: nobody wants its memory, and releasing it would make
    # its person's next cell wait for the restore
    assert PolicyConfig().long_idle_free_fraction == 0.25  # the server's default too
    assert decide([cand("a", idle=10 ** 6)], *ROOMY, NEEDS) == []
    # once the GPU fills (below the share, above the pressure threshold) it goes
    assert ids(decide([cand("a", idle=10 ** 6)], *FILLING, NEEDS)) == ["a"]
    # 1: released at long_idle whatever the room (the rule before the share)
    always = replace(NEEDS, long_idle_free_fraction=1.0)
    assert ids(decide([cand("a", idle=7201)], *ROOMY, always)) == ["a"]
    # 0: never for being idle long; the GPU's need still takes it
    never = replace(NEEDS, long_idle_free_fraction=0.0)
    assert decide([cand("a", idle=10 ** 6)], *FILLING, never) == []
    assert ids(decide([cand("a", idle=10 ** 6)], *TIGHT, never)) == ["a"]


def test_long_idle_releases_the_longest_idle_until_the_share_is_free():
    # GPU 0 15 % free, share 25 %: 8 GiB more is needed; 4 GiB kernels, longest idle first
    cands = [cand("older", idle=9000, gib=4), cand("oldest", idle=9900, gib=4),
             cand("old", idle=8000, gib=4), cand("young", idle=7000, gib=4),
             cand("roomy-gpu", idle=9999, gib=4, gpu=1)]
    free, total = {0: 12 * GiB, 1: 60 * GiB}, {0: 80 * GiB, 1: 80 * GiB}
    assert ids(decide(cands, free, total, NEEDS)) == ["oldest", "older"]
    # over its cap first, as every release for room
    capped = [*cands[:3], cand("over-cap", idle=7300, gib=4, over_cap=True)]
    assert ids(decide(capped, free, total, NEEDS)) == ["over-cap", "oldest"]
    # the rule alone: of the releases due, the ones the GPU's room calls for
    due = [(c, Decision(c.kernel_id, "due")) for c in cands]
    assert ids(long_idle_releases(due, free, total, NEEDS)) == ["oldest", "older"]


def test_a_kernels_own_idle_timeout_is_not_held_back_by_the_share():
    (d,) = decide([cand("a", idle=700, idle_timeout=600)], *ROOMY, NEEDS)
    assert d.reason == "idle for 700 s, idle_timeout 600 s"


def test_needs_still_judges_quietness_and_the_other_conditions():
    keep = [cand("busy", idle=8000, busy=True), cand("pinned", idle=8000, pinned=True),
            cand("gpu-busy", idle=8000, max_utilization=30), cand("small", idle=8000, gib=0.1),
            cand("released", idle=8000, resident=False), cand("no-method", idle=8000, releasable=False)]
    assert decide(keep, *ROOMY, NEEDS) == []
    assert decide(keep, *FILLING, NEEDS) == []


def test_a_kernels_own_idle_timeout_is_honoured_under_needs_and_0_is_never():
    # its own timeout (kernelspec, %gpushare idle-timeout) replaces long_idle for that kernel
    (d,) = decide([cand("a", idle=61, idle_timeout=60)], *ROOMY, NEEDS)
    assert d.reason == "idle for 61 s, idle_timeout 60 s"
    assert decide([cand("a", idle=8000, idle_timeout=10 ** 5)], *ROOMY, NEEDS) == []
    # 0: out of every automatic release, the GPU's need included
    assert decide([cand("a", idle=10 ** 6, idle_timeout=0)], *TIGHT, NEEDS) == []
    # the server's idle_timeout 0: never, under both policies
    assert decide([cand("a", idle=10 ** 6)], *TIGHT, replace(NEEDS, idle_timeout=0)) == []


def test_seconds_until_release_tells_when_the_rule_releases():
    assert seconds_until_release(cand("a", idle=100), PROACTIVE) == 500
    assert seconds_until_release(cand("a", idle=100), NEEDS) == 7100
    assert seconds_until_release(cand("a", idle=8000), NEEDS) == 0
    assert seconds_until_release(cand("a", idle=100), replace(NEEDS, long_idle=0)) is None
    assert seconds_until_release(cand("a", idle=100, idle_timeout=300), NEEDS) == 200
    assert seconds_until_release(cand("a", idle=100, idle_timeout=0), NEEDS) is None
    assert seconds_until_release(cand("a", idle=100, pinned=True), NEEDS) is None
    assert seconds_until_release(cand("a", idle=100, gib=0.1), NEEDS) is None
    assert seconds_until_release(cand("a", idle=100, resident=False), NEEDS) is None
    assert Policy(NEEDS).seconds_until_release(cand("a", idle=100)) == 7100


def test_make_room_is_the_same_under_both_policies():
    cands = [cand("taken", idle=300, gib=4), cand("young", idle=60, gib=4)]
    for cfg in (PROACTIVE, NEEDS):
        plan = make_room({0: 6 * GiB}, {0: 3 * GiB}, cands, cfg)
        assert plan is not None and ids(plan) == ["taken"]


# -- the option ---------------------------------------------------------------------------------
def test_the_server_defaults_to_needs_with_two_hours_of_long_idle():
    app = GPUShareApp()
    assert (app.release_policy, app.long_idle, app.idle_timeout) == ("needs", 7200.0, 600.0)
    assert app.long_idle_free_fraction == PolicyConfig().long_idle_free_fraction == 0.25
    for name in ("release_policy", "long_idle", "long_idle_free_fraction"):
        assert len(GPUShareApp.class_traits()[name].help) > 60
    section = GPUShareApp.class_config_section()
    assert "GPUShareApp.release_policy" in section and "GPUShareApp.long_idle" in section


@pytest.mark.parametrize(("name", "value"), [
    ("release_policy", "sometimes"),
    ("release_policy", "Needs"),
    ("long_idle", -1),
    ("long_idle", float("nan")),
    ("long_idle", float("inf")),
    ("long_idle_free_fraction", -0.1),
    ("long_idle_free_fraction", 1.5),
    ("long_idle_free_fraction", float("nan")),
])
def test_a_bad_value_names_the_trait(name, value):
    with pytest.raises(TraitError, match=name):
        GPUShareApp(config=Config({"GPUShareApp": {name: value}}))


@pytest.mark.parametrize("value", ["proactive", "needs"])
def test_both_values_are_taken(value):
    assert GPUShareApp(config=Config({"GPUShareApp": {"release_policy": value}})).release_policy == value


# -- what %gpushare says --------------------------------------------------------------------------
def _next_release(kernel: dict, after_cell=...) -> str:
    return dict(status_rows(kernel, after_cell=after_cell))["next automatic release"]


def test_the_magic_says_when_a_needs_kernel_goes():
    idle = {"state": "idle", "pinned": False, "idle_timeout": 600.0, "idle_seconds": 60.0}
    needs = {**idle, "release_policy": "needs"}
    assert _next_release({**idle, "release_in_seconds": 540.0}) == "in 9 min"  # as before
    assert _next_release({**needs, "release_in_seconds": 7140.0}) == \
        "when its GPU needs the memory; in 2.0 h, also once it runs short of room"
    assert _next_release(needs, after_cell=3600.0) == \
        "when its GPU needs the memory; in 60 min, counted from the end of this cell, also once it " \
        "runs short of room"
    assert _next_release({**needs, "release_in_seconds": None}) == \
        "only when its GPU needs the memory"  # long_idle 0
    assert _next_release({**needs, "pinned": True, "release_in_seconds": None}) == "never"
    assert _next_release({**needs, "idle_timeout": 0, "release_in_seconds": None}) == "never"
    assert _next_release({**needs, "state": "released", "release_in_seconds": None}) == "never"


# -- through a real server ------------------------------------------------------------------------
#: one 1 GiB GPU in use: a kernel of 512 MiB leaves it half free, one more of 384 MiB puts it
#: under pressure (12.5 % free < 25 %)
NEEDS_SERVER = {"simulated_gpus": [1024 * MiB, 1024 * MiB], "release_policy": "needs",
                "idle_timeout": 60, "long_idle": 600, "pressure_free_fraction": 0.25,
                "pressure_idle_timeout": 30, "poll_interval": 3600}


async def _release_in(jp_fetch, kernel_id: str) -> float | None:
    info = await kernel_status(jp_fetch, kernel_id)
    assert info is not None
    return info["release_in_seconds"]


@pytest.mark.parametrize("gpushare_config", [NEEDS_SERVER])
async def test_needs_keeps_an_idle_kernel_until_another_puts_its_gpu_under_pressure(
    jp_fetch, kernels, gpushare_app, events
):
    a = await kernels.start()
    await a.run(hold(512, name="a"))
    await gpushare_app.poll_once()
    ex = await a.run("%gpushare")
    # the next automatic release is long_idle away (counted from this cell, which is use)
    assert "next automatic release" in ex.text and \
        "in 10 min, counted from the end of this cell" in ex.text, ex.text
    await gpushare_app.poll_once()

    clock.advance(120)  # twice idle_timeout, and GPU 0 half free: no one needs a's memory
    await gpushare_app.poll_once()
    st = gpushare_app.controller.states[a.id]
    assert (st.state, st.op, st.releases) == ("idle", None, 0)
    assert await _release_in(jp_fetch, a.id) == pytest.approx(600 - 120, abs=2)

    b = await kernels.start()  # its memory puts GPU 0 below 25 % free
    await b.run(hold(384, name="b", chunk=128))
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[a.id].state == "released",
                   what="the release under memory pressure")
    taken = [e for e in events if e["action"] == "released"]
    assert [e["kernel_id"] for e in taken] == [a.id]  # b was just used: it stays
    assert re.match(r"memory pressure on GPU 0: idle for 1[2-9]\d s", taken[0]["reason"]), taken
    assert gpushare_app.controller.states[b.id].state in ("active", "idle")
    assert (await a.run(intact("a"), timeout=60)).stdout == "intact\n"  # room again: restored


@pytest.mark.parametrize("gpushare_config", [{**NEEDS_SERVER, "long_idle_free_fraction": 0.5}])
async def test_needs_releases_after_long_idle_once_its_gpu_is_short_of_room(
    jp_fetch, kernels, gpushare_app, events
):
    """a idles past long_idle on a GPU 75 % free: it stays (its person's next cell need not
    wait for a restore); b's memory leaves 37.5 % free, below long_idle_free_fraction but
    above the pressure threshold: a goes for its long idle, b (just used) stays."""
    a = await kernels.start()
    await a.run(hold(256, name="a"))
    await gpushare_app.poll_once()
    clock.advance(590)
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[a.id].state == "idle"
    assert 0 < await _release_in(jp_fetch, a.id) <= 12
    clock.advance(15)
    await gpushare_app.poll_once()
    st = gpushare_app.controller.states[a.id]
    assert (st.state, st.op, st.releases) == ("idle", None, 0)  # long idle, but room to spare

    b = await kernels.start()
    await b.run(hold(384, name="b", chunk=128))
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[a.id].state == "released",
                   what="the long-idle release")
    (rel,) = [e for e in events if e["action"] == "released"]
    assert rel["kernel_id"] == a.id
    assert re.fullmatch(r"idle for 6[0-4]\d s, long_idle 600 s", rel["reason"]), rel
    assert gpushare_app.controller.states[b.id].state in ("active", "idle")
    assert (await a.run(intact("a"), timeout=60)).stdout == "intact\n"


@pytest.mark.parametrize("gpushare_config", [{**NEEDS_SERVER, "simulated_gpus": [2048 * MiB] * 2,
                                              "poll_interval": 0.2}])
async def test_needs_still_makes_room_for_a_waiting_restore(jp_fetch, kernels, gpushare_app, events):
    """a is released; b holds as much and idles past idle_timeout on a GPU with room to spare
    (no pressure): it stays, until a's restore needs its room."""
    a = await released(jp_fetch, kernels, gpushare_app, 1280, name="a")
    b = await kernels.start()
    await b.run(hold(1280, name="b"))
    await gpushare_app.poll_once()
    clock.advance(120)
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[b.id].state == "idle"  # 37.5 % free: no pressure

    assert (await a.run(intact("a"), timeout=60)).stdout == "intact\n"
    st = gpushare_app.controller.states
    assert (st[a.id].state, st[b.id].state) == ("active", "released")
    taken = next(e for e in events if e["action"] == "released" and e["kernel_id"] == b.id)
    assert re.match(r"making room for a restore: idle for 1[2-9]\d s", taken["reason"]), taken
