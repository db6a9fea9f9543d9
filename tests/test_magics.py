"""The %gpushare magics, in a real kernel the server started (output AND the state change
the server reports over REST), and in a plain IPython with no server."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.kernel.magics import USAGE, GPUShareMagics

from .helpers import kernel_status, rest, wait_for

MiB = 1 << 20
SERVER_IDLE = 600.0

HOLD_256 = (
    "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
    "x = simgpu.array(np.arange(64 * 1024 * 1024, dtype=np.uint32) % 251, copy=False)\n"
    "x_sum = x.checksum()"
)


@pytest.fixture
def gpushare_config():
    return {"idle_timeout": SERVER_IDLE}



def clean(ex) -> None:
    """No traceback, no stderr: bad input is answered with a line, never an exception."""
    assert ex.status == "ok" and ex.error is None, ex.error
    assert ex.stderr == "", ex.stderr


def html_of(ex) -> str:
    return "".join(d.get("data", {}).get("text/html", "") for d in ex.displays)


def restore_lines(ex) -> list[str]:
    """What a cell shows about restores, as it reads in the end: its printed lines and its
    progress lines (each display id as last updated)."""
    final: dict[str, str] = {}
    for d in ex.displays:
        if "gpushare-progress" not in d.get("data", {}).get("text/html", ""):
            continue  # the status table
        text = d["data"].get("text/plain", "")
        display_id = d.get("transient", {}).get("display_id") or f"#{len(final)}"
        final[display_id] = text
    shown = [*ex.stdout.splitlines(), *final.values()]
    return [line for line in shown if line.startswith("gpushare:") and "restor" in line]


async def test_status_shows_state_memory_and_release_time_as_html_and_text(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()  # the server loaded the magics; loading them again is harmless
    conn = gpushare_app.channel.connections[k.id]
    ex = await k.run("%load_ext jupyter_gpushare\n%gpushare")
    clean(ex)
    assert gpushare_app.channel.connections[k.id] is conn  # the same agent, not a second one
    assert "gpushare: this kernel (simulated backend)" in ex.text
    assert "state" in ex.text and "untracked" in ex.text  # holds nothing yet

    await k.run(HOLD_256)
    await gpushare_app.poll_once()
    ex = await k.run("%gpushare status")
    clean(ex)
    text = ex.text
    for row in ("state", "GPU memory", "host memory (released)", "utilization", "idle",
                "method", "next automatic release", "releases / restores"):
        assert row in text, row
    assert "256.0 MiB on GPU 0" in text
    assert "method                  simulated" in text
    # idle_timeout 600 s, from the end of this cell (a cell is use)
    assert "next automatic release  in 10 min, counted from the end of this cell" in text
    html = html_of(ex)
    assert html.startswith("<table class='gpushare-status'>")
    assert "<th style='text-align:left'>GPU memory</th><td style='text-align:left'>256.0 MiB on GPU 0" in html
    # code is code in HTML, plain in text: never a literal backtick
    assert ("restore mode            eager: before the next cell runs, whatever it does (even 1 + 1), "
            "except a cell made only of %gpushare magics") in text
    assert "whatever it does (even <code>1 + 1</code>), except a cell made only of <code>%gpushare</code>" in html
    assert "`" not in text and "`" not in html


async def test_pin_unpin_idle_timeout_change_what_rest_reports(jp_fetch, kernels, gpushare_app, events):
    k = await kernels.start()
    await k.run(HOLD_256)
    await gpushare_app.poll_once()

    ex = await k.run("%gpushare pin")
    clean(ex)
    assert "pinned: this kernel is never released automatically" in ex.stdout
    info = await kernel_status(jp_fetch, k.id)
    assert info["pinned"] is True and info["release_in_seconds"] is None
    assert "(pinned)" in (await k.run("%gpushare")).text

    ex = await k.run("%gpushare pin")  # again: says so, and nothing changes
    clean(ex)
    assert ex.stdout.strip() == ("gpushare: already pinned: this kernel is never released "
                                 "automatically (%gpushare unpin undoes it)")
    ex = await k.run("%gpushare idle-timeout 120")  # the pin wins, and the magic says so
    clean(ex)
    assert ex.stdout.strip() == ("gpushare: idle timeout 120 s; this kernel is pinned, and the pin "
                                 "wins: it is not released automatically until %gpushare unpin")
    info = await kernel_status(jp_fetch, k.id)
    assert (info["pinned"], info["idle_timeout"], info["release_in_seconds"]) == (True, 120, None)
    await k.run("%gpushare idle-timeout default")

    ex = await k.run("%gpushare unpin")
    assert "unpinned" in ex.stdout
    info = await kernel_status(jp_fetch, k.id)
    assert info["pinned"] is False and info["release_in_seconds"] is not None
    ex = await k.run("%gpushare unpin")
    assert ex.stdout.strip() == "gpushare: not pinned: this kernel is released automatically already"
    assert [e["action"] for e in events if e["kernel_id"] == k.id] == ["pinned", "unpinned"]

    ex = await k.run("%gpushare idle-timeout 120")
    clean(ex)
    assert ex.stdout.strip() == "gpushare: idle timeout 120 s"
    info = await kernel_status(jp_fetch, k.id)
    assert info["idle_timeout"] == 120 and 100 < info["release_in_seconds"] <= 120

    ex = await k.run("%gpushare idle-timeout 0")
    assert "off (never released automatically)" in ex.stdout
    info = await kernel_status(jp_fetch, k.id)
    assert info["idle_timeout"] == 0 and info["release_in_seconds"] is None
    assert "next automatic release  never" in (await k.run("%gpushare")).text

    ex = await k.run("%gpushare idle-timeout default")
    assert "back to the server's default" in ex.stdout
    info = await kernel_status(jp_fetch, k.id)
    assert info["idle_timeout"] == SERVER_IDLE


async def test_release_then_status_then_restore_in_one_cell(jp_fetch, kernels, gpushare_app, events):
    """In one cell, so no later cell's restore (gate or agent) gets in between."""
    k = await kernels.start()
    await k.run(HOLD_256)
    await gpushare_app.poll_once()
    ex = await k.run("%gpushare release\n%gpushare\n"
                     "import json, urllib.request\n%gpushare restore")
    clean(ex)
    assert "gpushare: released 256.0 MiB to host memory in" in ex.stdout
    # eager, the default: any next cell restores, and the magic says so (with the exception
    # this very cell is: a cell of %gpushare magics runs on the released kernel)
    assert ("; it comes back before the next cell runs, whatever it does (even 1 + 1), except a "
            "cell made only of %gpushare magics\n") in ex.stdout
    shown = ex.text
    assert "state                   released" in shown
    assert "host memory (released)  256.0 MiB" in shown
    assert "restore mode            eager: before the next cell runs" in shown
    assert "`" not in ex.stdout  # "(even 1 + 1)", plainly
    progress = [d["data"]["text/plain"] for d in ex.displays if "gpushare-progress" in
                d["data"].get("text/html", "")]
    assert progress[0].startswith("gpushare: restoring 256.0 MiB to GPU 0")
    assert progress[-1].startswith("gpushare: restored 256.0 MiB in")
    assert restore_lines(ex) == [progress[-1]]  # one line for one restore: what moved, how long
    st = gpushare_app.controller.states[k.id]
    assert (st.state, st.releases, st.restores) == ("active", 1, 1)
    released = next(e for e in events if e["action"] == "released")
    assert released["reason"] == "requested from the kernel"
    assert next(e for e in events if e["action"] == "restored")["reason"] == "magic"

    ex = await k.run("%gpushare restore")
    assert ex.stdout.strip() == "gpushare: this kernel's GPU state is already resident"
    ex = await k.run("%gpushare release")
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "released" and info["released_bytes"] == 256 * MiB
    await k.run("assert x.checksum() == x_sum")


async def test_gpushare_cells_on_a_released_kernel_do_not_restore_in_eager_mode(
    jp_fetch, kernels, gpushare_app, events
):
    """The gate lets `%gpushare` cells through: the state shows as it is, and
    `%gpushare restore` restores (trigger "magic") with its own progress."""
    k = await kernels.start()
    await k.run(HOLD_256)
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    ex = await k.run("%gpushare")
    assert "state                   released" in ex.text
    ex = await k.run("%gpushare release")
    assert "already released" in ex.stdout
    info = await kernel_status(jp_fetch, k.id)
    assert (info["state"], info["restores"]) == ("released", 0)
    ex = await k.run("%gpushare restore")
    clean(ex)
    (line,) = restore_lines(ex)
    assert re.fullmatch(r"gpushare: restored 256\.0 MiB in \d+\.\d\d s", line), line
    assert [e["reason"] for e in events if e["action"] == "restored"] == ["magic"]
    info = await kernel_status(jp_fetch, k.id)
    assert (info["state"], info["restores"]) == ("active", 1)


@pytest.mark.parametrize("gpushare_config", [{"idle_timeout": 150, "poll_interval": 3600}])
async def test_idle_and_next_release_come_from_the_clock_the_policy_uses(
    jp_fetch, kernels, gpushare_app, events
):
    """`%gpushare` shows the idle time before its cell and the next automatic release counted
    from the end of its cell (the cell is use: the policy's idle clock starts again there),
    to the second; the release then comes when it said, with a reason the lab can wrap.
    (Polls only when the test says: a poll while the cell runs sees it busy.)"""
    k = await kernels.start()
    await k.run(HOLD_256)
    await gpushare_app.poll_once()
    await asyncio.sleep(2.2)
    await gpushare_app.poll_once()
    ex = await k.run("%gpushare")
    clean(ex)
    idle = re.search(r"idle +(\d+) s before this cell \(every cell counts as use, this one too\)", ex.text)
    assert idle and 2 <= int(idle.group(1)) <= 4, ex.text
    assert "next automatic release  in 2 min 30 s, counted from the end of this cell" in ex.text
    assert "idle timeout            2 min 30 s" in ex.text

    # what the policy sees once the cell has ended: idle from the cell, the release 150 s on
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    assert info["idle_seconds"] < 2
    assert info["idle_seconds"] + info["release_in_seconds"] == pytest.approx(150, abs=0.2)

    clock.advance(140)  # 150 s after the idle time shown, not after the cell: still resident
    await gpushare_app.poll_once()
    st = gpushare_app.controller.states[k.id]
    assert (st.state, st.op, st.releases) == ("idle", None, 0)
    clock.advance(12)  # 150 s after the cell
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "released",
                   what="the automatic release")
    (released,) = [e for e in events if e["action"] == "released"]
    assert re.fullmatch(r"idle for 15\d s, idle_timeout 150 s", released["reason"]), released
    await k.run("assert x.checksum() == x_sum")


@pytest.mark.parametrize("gpushare_config", [{"simulated_gpus": [512 * MiB, 512 * MiB]}])
async def test_restore_that_joins_another_says_itself_what_it_moved(
    jp_fetch, kernels, gpushare_app
):
    """A `%gpushare restore` that waits for a restore asked elsewhere (over REST, waiting for
    memory: no line in this cell) prints the one line itself."""
    a = await kernels.start()
    await a.run(HOLD_256)
    await gpushare_app.poll_once()
    code, _ = await rest(jp_fetch, "POST", "kernels", a.id, "release")
    assert code == 200
    b = await kernels.start()  # just used: never released to make room
    await b.run("from jupyter_gpushare.sim import simgpu\nfill = simgpu.zeros((384 * 1024 ** 2 // 4,))")
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, "POST", "kernels", a.id, "restore")
    assert code == 202 and body["waiting"], body  # no room yet: it waits
    msg_id = a.send("%gpushare restore")
    await asyncio.sleep(0.5)
    assert a.executions[msg_id].status == ""  # the magic waits for that restore
    await b.run("del fill")
    ex = await a.wait(msg_id)
    clean(ex)
    (line,) = restore_lines(ex)
    assert re.fullmatch(r"gpushare: restored 256\.0 MiB in \d+\.\d\d s", line), line
    assert ex.stdout == line + "\n"


async def test_release_after_runs_the_cell_shows_its_value_then_releases(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(HOLD_256)
    ex = await k.run("%%gpushare release-after\ny = x + 1\nprint('ran')\nint(y.get()[1])")
    clean(ex)
    assert ex.stdout.startswith("ran\n") and "gpushare: released 512.0 MiB" in ex.stdout
    assert ex.results and ex.results[0]["text/plain"] == "2"  # shown before the release
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "released" and info["released_bytes"] == 512 * MiB

    ex = await k.run("%%gpushare release-after\nz = y.get()\n1 / 0", ok=False)
    assert ex.status == "error" and ex.error["ename"] == "ZeroDivisionError"
    assert "released" not in ex.stdout
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "active"  # the gate restored for the cell; a failed cell keeps it


BAD_INPUT = [
    ("%gpushare bogus", "unknown subcommand 'bogus'"),
    ("%gpushare pin now", "pin takes no arguments"),
    ("%gpushare release everything", "release takes no arguments"),
    ("%gpushare idle-timeout", "idle-timeout takes one value"),
    ("%gpushare idle-timeout 1 2", "idle-timeout takes one value"),
    ("%gpushare idle-timeout abc", "not 'abc'"),
    ("%gpushare idle-timeout -5", "not '-5'"),
    ("%gpushare idle-timeout nan", "not 'nan'"),
    ("%gpushare idle-timeout inf", "not 'inf'"),
    ("%%gpushare bogus\nmarker = 1", "the cell form is `%%gpushare release-after`"),
    ("%%gpushare\nmarker = 1", "the cell form is `%%gpushare release-after`"),
]


async def test_bad_input_prints_usage_and_changes_nothing(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(HOLD_256 + "\nmarker = 0")
    await gpushare_app.poll_once()
    before = await kernel_status(jp_fetch, k.id)
    for line, says in BAD_INPUT:
        ex = await k.run(line)
        clean(ex)
        assert says in ex.stdout, line
        assert "usage: %gpushare" in ex.stdout or "takes seconds" in ex.stdout, line
        after = await kernel_status(jp_fetch, k.id)
        for key in ("state", "pinned", "idle_timeout", "releases", "restores"):
            assert after[key] == before[key], (line, key)
    assert (await k.run("print(marker)")).stdout == "0\n"  # no cell body ran


async def test_release_of_a_kernel_holding_nothing_says_why(jp_fetch, kernels):
    k = await kernels.start()
    ex = await k.run("%gpushare release")
    clean(ex)
    assert ex.stdout.strip() == "gpushare: release failed: kernel holds no GPU memory"
    assert (await kernel_status(jp_fetch, k.id))["releases"] == 0


def test_readme_lists_every_subcommand_of_the_usage_line():
    """The README's list of magics is the one a new user reads: nothing the usage line offers
    is missing from it."""
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    listed = readme.split("## In a notebook", 1)[1].split("\n## ", 1)[0]
    offered = USAGE[USAGE.index("[") + 1:USAGE.rindex("]")].split("|")
    for form in (part.split()[0] for part in offered):
        if form != "status":  # `%gpushare` alone, the first line of the list
            assert re.search(rf"(%gpushare |/ ){re.escape(form)}\b", listed), form


def test_docstring_documents_every_form():
    doc = GPUShareMagics.gpushare.__doc__ or ""
    for form in ("%gpushare ", "%gpushare status", "%gpushare release", "%gpushare restore",
                 "%gpushare pin", "%gpushare unpin", "%gpushare idle-timeout SECONDS",
                 "%%gpushare release-after", "%load_ext jupyter_gpushare"):
        assert form in doc, form


# -- plain IPython, no server -----------------------------------------------------------------
def ipython(*lines: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_GPUSHARE")}
    r = subprocess.run(
        [sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor",
         "-c", "\n".join(lines)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r.stdout


def test_plain_ipython_without_server_says_so():
    out = ipython("%load_ext jupyter_gpushare", "%gpushare", "%gpushare release",
                  "%gpushare pin", "%gpushare bogus", "%gpushare?")
    assert "gpushare: this kernel (no gpushare server)" in out
    assert "server                none: this kernel was not started by a gpushare-enabled" in out
    assert "frameworks            none imported" in out
    assert out.count("gpushare: no server: this kernel was not started") == 2  # release, pin
    assert "unknown subcommand 'bogus'" in out
    assert "%%gpushare release-after       run the cell, then release at once" in out  # `?`


@pytest.mark.torch
def test_plain_ipython_reports_framework_memory_with_torch():
    pytest.importorskip("torch")
    out = ipython("import torch", "t = torch.ones(1000)", "%load_ext jupyter_gpushare",
                  "%gpushare")
    assert "frameworks            torch" in out
    assert "framework GPU memory  0 B" in out  # a CPU build holds no GPU memory


def test_plain_ipython_reports_simulated_memory():
    out = ipython("from jupyter_gpushare.sim import simgpu", "a = simgpu.zeros((1024, 1024))",
                  "%load_ext jupyter_gpushare", "%gpushare")
    assert "simulated GPU memory  4.0 MiB" in out
