"""The release rules through a real server: a policy class swapped in by configuration, and
make-room taking a kernel that computed before the pressure window and has idled since."""

from __future__ import annotations

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.policy import Decision, Policy

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact, released, rest

#: two 256 MiB GPUs: two kernels of 160 MiB do not fit on one together
TINY_NODE = {"simulated_gpus": [256 * MiB, 256 * MiB]}


class ReleaseAtOnce(Policy):
    """A site's own rule: release every idle kernel at the first poll, whatever its timeout."""

    def decide(self, candidates, free, total):
        return [Decision(c.kernel_id, "the site releases idle kernels at once")
                for c in candidates if c.resident and not c.busy and c.bytes]

    def seconds_until_release(self, candidate):
        return 0.0 if candidate.resident and candidate.bytes else None


@pytest.mark.parametrize("gpushare_config", [{"policy_class": ReleaseAtOnce}])
async def test_a_policy_class_set_in_the_configuration_decides(
    jp_fetch, kernels, gpushare_app, events
):
    assert isinstance(gpushare_app.controller.rules, ReleaseAtOnce)
    assert gpushare_app.controller.rules.parent is gpushare_app  # takes its own options
    k = await kernels.start()
    await k.run(hold(64))
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "released",
                   what="the policy's release")
    released = next(e for e in events if e["action"] == "released")
    assert released["reason"] == "the site releases idle kernels at once"
    assert (await k.run(intact())).stdout == "intact\n"
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    assert info["release_in_seconds"] in (0.0, None)  # the policy's answer (None while released)


@pytest.mark.parametrize("gpushare_config", [
    {**TINY_NODE, "idle_timeout": 600, "pressure_idle_timeout": 30},
])
async def test_make_room_takes_a_kernel_that_computed_before_the_pressure_window(
    jp_fetch, kernels, gpushare_app, events
):
    a = await released(jp_fetch, kernels, gpushare_app, 160, name="a")
    b = await kernels.start()
    await b.run(hold(160, name="b"))
    await b.run("simgpu.burn(0.6)")  # b computes on the GPU ...
    await gpushare_app.poll_once()
    rec = gpushare_app.tracker.kernels[b.id]
    assert rec.max_utilization_since(clock.now() - 600) > 5
    clock.advance(300)  # ... then idles 5 min: inside its 10-min idle window, past 30 s
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[b.id].state == "idle"

    ex = await a.run(intact("a"), timeout=60)  # a's restore needs b's room
    assert ex.stdout == "intact\n"
    st = gpushare_app.controller.states
    assert (st[a.id].state, st[b.id].state) == ("active", "released")
    taken = next(e for e in events if e["action"] == "released" and e["kernel_id"] == b.id)
    assert taken["reason"].startswith("making room for a restore: idle for 300 s")


@pytest.mark.parametrize("gpushare_config", [
    {"idle_timeout": 600, "pressure_idle_timeout": 120, "min_release_bytes": 0},
])
async def test_a_release_for_another_user_judges_quietness_over_the_callers_window(
    jp_fetch, kernels, gpushare_app
):
    """The hub service asks "release if idle for S s": the kernel must have been quiet on the
    GPU for those S seconds, whatever this server's own (longer) pressure window says, or the
    service's rule and the server's answer disagree and the waiting person is never served."""
    k = await kernels.start()
    await k.run(hold(64))
    await k.run("simgpu.burn(0.6)")  # computes on the GPU ...
    await gpushare_app.poll_once()
    clock.advance(30)  # ... then idles 30 s: inside this server's 120 s pressure window
    await gpushare_app.poll_once()

    code, body = await rest(jp_fetch, k.id, "release", params={"if_idle_for": "60"})
    assert code == 409 and "was used 30 s ago (less than 60 s)" in body["message"], body
    code, body = await rest(jp_fetch, k.id, "release", params={"if_idle_for": "20"})
    assert code == 200 and body["state"] == "released", body
    assert (await k.run(intact())).stdout == "intact\n"
