"""A cell that runs out of GPU memory makes room for its next try: the kernel's agent asks,
the server releases this server's idle kernels on that GPU by make-room's rule, and the cell
says so under the framework's error. Real server, real kernels, the simulated node."""

from __future__ import annotations

import os

import pytest

from jupyter_gpushare import clock, policy
from jupyter_gpushare.kernel import oom
from jupyter_gpushare.policy.oom import plan

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact

#: one 256 MiB GPU (and a second one nobody uses); the product's release policy and pressure
#: threshold: a kernel holding 192 MiB leaves 25 % free, not under pressure
NODE = {"simulated_gpus": [256 * MiB, 256 * MiB], "release_policy": "needs",
        "idle_timeout": 3600, "pressure_free_fraction": 0.1, "pressure_idle_timeout": 120}

ALLOC = ("from jupyter_gpushare.sim import simgpu\n"
         "y = simgpu.zeros(({mib} * 2**18,), dtype='float32', device=0)")

ASK = """
from jupyter_gpushare.kernel.agent import get_agent
from jupyter_gpushare.protocol import RemoteError
def ask(**fields):
    try:
        return get_agent().client.request("out_of_memory", timeout=20, **fields)
    except RemoteError as e:
        return "refused: " + str(e)
"""


def oom_count(cause: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("gpushare_out_of_memory_total", {"cause": cause}) or 0.0


async def idle_holder(kernels, app, mib: int = 192):
    """A kernel holding ``mib`` MiB of GPU 0, idle past ``pressure_idle_timeout``."""
    a = await kernels.start()
    await a.run(hold(mib, name="a", chunk=64))
    await app.poll_once()
    clock.advance(300)
    await app.poll_once()
    assert app.controller.states[a.id].state == "idle"
    return a


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_a_cell_out_of_memory_releases_an_idle_kernel_and_its_retry_fits(
    jp_fetch, kernels, gpushare_app, events
):
    a = await idle_holder(kernels, gpushare_app)
    b = await kernels.start()
    before = oom_count("released")
    ex = await b.run(ALLOC.format(mib=128), ok=False)  # 64 MiB free
    assert ex.error is not None and ex.error["ename"] == "SimOutOfMemoryError", ex.error
    assert oom_count("released") == before + 1  # on the server's /metrics, for admins
    assert "gpushare: GPU 0 was short of memory: " in ex.stderr, ex.stderr
    assert "1 idle kernel (192.0 MiB): run the cell again" in ex.stderr, ex.stderr

    await wait_for(lambda: gpushare_app.controller.states[a.id].state == "released",
                   what="the idle kernel's release")
    assert (await kernel_status(jp_fetch, a.id))["state"] == "released"
    taken = next(e for e in events if e["action"] == "released" and e["kernel_id"] == a.id)
    assert taken["reason"].startswith(f"making room: kernel {b.id[:8]} ran out of memory on "
                                      "GPU 0: idle for 30"), taken
    assert not any(e["kernel_id"] == b.id and e["action"] == "released" for e in events)

    await b.run(ALLOC.format(mib=128) + "\ndel y")  # the next try fits
    assert (await a.run(intact("a"))).stdout == "intact\n"  # a's own restore: data intact


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_bad_requests_a_kernels_own_cap_and_nothing_idle_release_nothing(
    jp_fetch, kernels, gpushare_app, events
):
    a = await idle_holder(kernels, gpushare_app)
    b = await kernels.start()
    await b.run(ASK)
    out = await b.run("for bad in ({'bytes': '1'}, {'bytes': -1}, {'bytes': True}, "
                      "{'gpu': 7}, {'gpu': 0.5}):\n    print(ask(**bad))")
    lines = out.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("refused: ") for line in lines), lines
    assert "bytes must be an integer" in lines[0] and "bytes must be >= 0" in lines[1]
    assert "bytes must be an integer" in lines[2] and "node's GPUs [0, 1], got 7" in lines[3]
    assert "gpu must be an integer" in lines[4]

    # its own cap is the cause: the framework's error names it and nobody is released
    await b.run("%gpushare cap 64MiB")
    ex = await b.run(ALLOC.format(mib=128), ok=False)
    assert "gpushare memory cap" in ex.error["evalue"] and "gpushare: GPU" not in ex.stderr, ex
    assert "'cause': 'cap'" in (await b.run("print(ask(bytes=128 * 2**20, gpu=0))")).stdout
    await b.run("%gpushare cap off")

    # more than the idle kernels could free: nobody is released for nothing
    out = await b.run("print(ask(bytes=2**30, gpu=0)['text'])")
    assert ("gpushare: GPU 0 is short of memory: 64.0 MiB free and 192.0 MiB in idle kernels "
            "would not hold the 1.0 GiB the cell asked for: nothing released") in out.stdout, out

    # a pinned kernel is never taken: the cell says why nothing was released
    await a.run("%gpushare pin")
    ex = await b.run(ALLOC.format(mib=128), ok=False)
    assert ("gpushare: GPU 0 is short of memory and no idle kernel there can be released "
            "(1 kernel: 1 pinned)") in ex.stderr, ex.stderr
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[a.id].state in ("idle", "active")  # resident: its pin cell ran just now
    assert not any(e["action"] in ("releasing", "released") for e in events), events


def test_the_error_says_how_much_and_where():
    """The bytes and the node's GPU, read from each framework's message (none imported)."""
    cases = [
        ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
         "79.1 GiB of which 1.2 GiB is free.", "2,3", 2 << 30, 3),
        ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)",
         None, 20 << 20, 0),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.",
         None, 16 << 30, None),
        ("Out of memory allocating 800,000,512 bytes (allocated so far: 0 bytes).", None,
         800000512, None),
        ("OOM when allocating tensor with shape[1024,1024,256] and type float on "
         "/job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc", "GPU-a1b2",
         1 << 30, None),
        ("out of memory on simulated GPU 1: tried to allocate 14.0 GiB; 2.0 GiB free of "
         "16.0 GiB", "0", 14 << 30, 1),
        ("something else entirely", None, None, None),
    ]
    for message, visible, nbytes, gpu in cases:
        assert oom.failed_bytes(message) == nbytes, message
        assert oom.failed_gpu(message, visible) == gpu, message


def test_unknown_bytes_take_every_idle_kernel_there_and_known_bytes_only_enough():
    """The rule the server and the simulator share (``policy.oom.plan``)."""
    cfg = policy.PolicyConfig(release_policy="needs", pressure_free_fraction=0.1,
                              min_release_bytes=0)
    rules = policy.Policy(cfg)

    def cand(kid, idle, nbytes, pinned=False):
        return policy.Candidate(kid, resident=True, busy=False, pinned=pinned, idle_seconds=idle,
                                max_utilization=0.0, gpu_bytes={0: nbytes * MiB})

    cands = [cand("old", 9000, 100), cand("older", 20000, 100), cand("new", 30, 100),
             cand("pinned", 9000, 100, pinned=True)]
    total, free = {0: 1000 * MiB}, {0: 50 * MiB}
    known = plan(rules, [0], 100 * MiB, free, total, cands, "me")
    # 100 MiB + the 100 MiB threshold: one 100 MiB kernel is not enough, two are
    assert [d.kernel_id for d in known] == ["older", "old"]
    unknown = plan(rules, [0], None, free, total, cands, "me")
    assert sorted(d.kernel_id for d in unknown) == ["old", "older"]
    assert plan(rules, [0], 10 * MiB, {0: 300 * MiB}, total, cands, "me") == []
    assert plan(rules, [0], 900 * MiB, free, total, cands, "me") is None


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_memory_held_outside_this_server_is_said_with_who_could_release_it(
    kernels, gpushare_app
):
    """Another process (another person's kernel, or a program outside this server) holds
    192 MiB of GPU 0 and this server has nothing there to release: the cell says so, and who
    could (without the hub service nobody here can); memory outside that could not have made
    the room is not mentioned."""
    pid = os.getpid()
    gpushare_app.node.alloc(pid, 0, 192 * MiB)
    try:
        b = await kernels.start()
        before = oom_count("none")
        ex = await b.run(ALLOC.format(mib=128), ok=False)  # 64 MiB free
        assert oom_count("none") == before + 1
        assert ("gpushare: GPU 0 is short of memory and no other kernel of this server holds "
                "memory there\ngpushare: other processes hold 192.0 MiB of GPU 0 (other "
                "people's kernels, or programs outside this server): this server releases only "
                "its own kernels; under JupyterHub, the gpushare hub service also releases "
                "other people's idle ones") in ex.stderr, ex.stderr
        ex = await b.run(ALLOC.format(mib=512), ok=False)  # more than the GPU: nobody could
        assert "other processes hold" not in ex.stderr, ex.stderr
    finally:
        gpushare_app.node.release(pid, 0, 192 * MiB)

