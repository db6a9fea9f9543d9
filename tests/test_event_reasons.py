"""The reasons the server gives in its events, as the lab's toasts show them (wrapped in
parentheses): none holds parentheses of its own, and what a person asked for in the panel
reads as their own action."""

from __future__ import annotations

import pytest

from .helpers import rest, wait_for
from .scenarios import MiB, hold, intact


async def test_a_release_and_restore_from_the_panel_say_so(jp_fetch, kernels, gpushare_app, events):
    k = await kernels.start()
    await k.run(hold(64))
    await gpushare_app.poll_once()
    panel = {"trigger": "panel"}
    assert (await rest(jp_fetch, "POST", "kernels", k.id, "release", body=panel))[0] == 200
    assert (await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=panel))[0] == 200
    # other clients, as before: no body, or an empty object
    assert (await rest(jp_fetch, "POST", "kernels", k.id, "release"))[0] == 200
    assert (await rest(jp_fetch, "POST", "kernels", k.id, "restore", body={}))[0] == 200
    # who asks is all a body may say: anything else changes nothing
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release", body={"trigger": "rest"})
    assert code == 400 and body["message"] == 'body must be empty, {} or {"trigger": "panel"}'
    assert gpushare_app.controller.states[k.id].state == "active"

    said = [(e["action"], e["reason"]) for e in events if e["kernel_id"] == k.id]
    assert said == [("released", "requested from the panel"), ("restored", "panel"),
                    ("released", "requested over REST"), ("restored", "rest")]
    assert (await k.run(intact())).stdout == "intact\n"


@pytest.mark.parametrize("gpushare_config", [{"simulated_gpus": [256 * MiB, 256 * MiB]}])
async def test_a_waiting_restore_says_what_it_needs_without_parentheses(
    jp_fetch, kernels, gpushare_app, events
):
    a, b = await kernels.start(), await kernels.start()
    await a.run(hold(160, name="a"))
    await gpushare_app.poll_once()
    assert (await rest(jp_fetch, "POST", "kernels", a.id, "release"))[0] == 200
    await b.run(hold(160, name="b"))  # just used: never released to make room
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, "POST", "kernels", a.id, "restore")
    assert code == 202
    # the kernel's own field, a line of its own, keeps its form
    assert body["waiting"] == "waiting for memory: needs 160.0 MiB on GPU 0 (96.0 MiB free)"
    (waiting,) = [e for e in events if e["action"] == "restore_waiting"]
    assert waiting["reason"] == "needs 160.0 MiB on GPU 0, 96.0 MiB free"
    await b.run("del b")
    await wait_for(lambda: gpushare_app.controller.states[a.id].state == "active", what="restore")
    assert (await a.run(intact("a"))).stdout == "intact\n"
