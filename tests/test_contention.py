"""People see contention: per GPU, its SM load over the window against 100 % and which kernels
computed there, in status and the metrics; with ``rebalance = False`` nothing moves. Real
server, real kernels, the simulated node; the server's clock is moved forward instead of
waiting."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .helpers import get_json, kernel_status
from .scenarios import MiB
from .test_rebalance import NODE, WINDOW, away_on_busy_gpu, interrupt, moves, pass_time, pid_bytes


def gauges(text: str, name: str) -> dict[str, float]:
    """gpu label -> value of gauge ``name`` in a Prometheus exposition."""
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return {s.labels["gpu"]: s.value for s in family.samples}
    return {}


@pytest.mark.parametrize("gpushare_config", [{**NODE, "rebalance": False}])
async def test_status_and_metrics_show_a_contended_gpu_and_who_shares_it(
    jp_fetch, kernels, gpushare_app, events
):
    a, b, cell = await away_on_busy_gpu(jp_fetch, kernels, gpushare_app)
    for _ in range(5):  # polls: with rebalance off, a stays where it is
        await gpushare_app.poll_once()

    status = await get_json(jp_fetch, "api", "gpushare", "status")
    gpu0, gpu1, gpu2 = status["gpus"]
    assert gpu0["contended"] and gpu0["load"] >= 90, gpu0
    assert gpu0["computing"] == sorted([a.id, b.id])
    assert (gpu1["contended"], gpu1["load"], gpu1["computing"]) == (False, 0, [])
    assert not gpu2["contended"]

    r = await jp_fetch("metrics", method="GET")
    text = r.body.decode()
    assert gauges(text, "gpushare_gpu_contended") == {"0": 1.0, "1": 0.0, "2": 0.0}
    assert gauges(text, "gpushare_gpu_load_percent")["0"] >= 90

    assert not moves(events, a) and pid_bytes(gpushare_app, a) == {0: 256 * MiB}
    body = await kernel_status(jp_fetch, a.id)
    assert body is not None and body["moved"] is None and body["state"] in ("active", "idle")

    await interrupt(jp_fetch, b, cell)  # b stops training: a window later, nobody shares
    await pass_time(gpushare_app, WINDOW)
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    gpu0 = status["gpus"][0]
    assert (gpu0["contended"], gpu0["computing"]) == (False, []) and gpu0["load"] < 10, gpu0


def test_the_kept_load_is_the_window_mean_of_the_samples_at_every_poll():
    """Each GPU's record keeps its load over a window up poll by poll (a running sum, not a
    walk over the window's samples at each decision); it says what the mean over the samples
    says, for placement's window and the rebalancer's, samples uneven, unreadable or dropped
    by the ring included, and starts over on a new ring."""
    from collections import deque

    from jupyter_gpushare.core.tracker import GPURecord
    from jupyter_gpushare.telemetry import GPUInfo

    rng = random.Random(7)
    rec = GPURecord(GPUInfo(index=0, uuid="", name="g", memory_total=1, memory_used=0,
                            utilization=0.0), deque(maxlen=40))
    t = 1000.0
    for i in range(300):
        t += rng.choice([0.5, 2.0, 2.0, 7.0, 130.0])
        rec.history.append((t, 0, None if i % 17 == 0 else rng.uniform(0, 100)))
        for window in (0.0, 60.0, 600.0):
            if rng.random() < 0.7:  # not every window is asked at every poll
                want = rec.load(t - window, t)
                assert rec.recent_load(window) == pytest.approx(want, abs=1e-6), (i, window)
        if i == 150:
            rec.history = deque(list(rec.history)[-5:], maxlen=40)  # a new ring
