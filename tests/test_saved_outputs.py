"""Saved notebooks carry no gpushare output, and progress follows the protocol's order.

A restore shows its progress line while it runs and takes it out of the cell once it is done
(the cell's code has not run yet, so the line is all the cell holds): a notebook run with
releases between its cells saves exactly what a run without the extension saves. Over the
websocket the cell's ``status: busy`` comes before any progress line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from .helpers import wait_for

#: seeded code: the same outputs every run (stdout, stderr, a result, rich displays)
CELLS = [
    "from jupyter_gpushare.sim import simgpu\n"
    "w = simgpu.random((64, 1024, 256), device=0, seed=7)  # 64 MiB\n"
    "print('checksum', w.checksum()[:16])",
    "round(float((w * 2).sum().get()), 3)",
    "from IPython.display import HTML, display\n"
    "display(HTML('<b>rich</b>'), metadata={'seeded': True})\n"
    "import sys\nprint('to stderr', file=sys.stderr)\n"
    "v = simgpu.zeros((1024, 1024), device=1)",
    "print('still', w.checksum()[:16], float(v.sum().get()))\nw.shape",
]


def notebook() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells = [new_markdown_cell("# seeded"), *(new_code_cell(c) for c in CELLS)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"  # fixed ids: the two files differ only where outputs differ
    return nb


def run_without_the_extension(path) -> str:
    """nbclient in a process of its own: a stock kernel, no server, no agent."""
    code = ("import sys, nbformat\nfrom nbclient import NotebookClient\n"
            "nb = nbformat.read(sys.argv[1], as_version=4)\n"
            "NotebookClient(nb, record_timing=False, timeout=120).execute()\n"
            "nbformat.write(nb, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=180)
    return path.read_text()


async def test_a_notebook_run_with_releases_between_cells_saves_what_a_stock_run_saves(
    tmp_path, jp_fetch, gpushare_app, jp_serverapp, restores
):
    nbformat.write(notebook(), tmp_path / "stock.ipynb")
    stock = run_without_the_extension(tmp_path / "stock.ipynb")

    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kid = json.loads(r.body)["id"]
    await wait_for(lambda: kid in gpushare_app.channel.connections, what="the agent")
    released = []

    async def release_between_cells(cell, cell_index, execute_reply):
        await gpushare_app.poll_once()
        if gpushare_app.tracker.kernels[kid].gpu_memory_bytes:
            r = await jp_fetch("api", "gpushare", "kernels", kid, "release", method="POST", body=b"")
            assert json.loads(r.body)["state"] == "released"
            released.append(cell_index)

    nb = notebook()
    client = NotebookClient(nb, km=jp_serverapp.kernel_manager.get_kernel(kid), record_timing=False,
                            timeout=120, on_cell_executed=release_between_cells)
    try:
        await client.async_execute()
    finally:
        await jp_fetch("api", "kernels", kid, method="DELETE")
    assert released == [1, 2, 3, 4]  # after every cell that holds GPU memory
    assert restores == [(kid, "agent")] * 3  # cells 2-4 waited for a restore, in the kernel
    nbformat.write(nb, tmp_path / "gpushare.ipynb")
    assert (tmp_path / "gpushare.ipynb").read_text() == stock
    assert "gpushare" not in json.dumps([c.get("outputs", []) for c in nb.cells])


HOLD = ("from jupyter_gpushare.sim import simgpu\n"
        "x = simgpu.random((64, 1024, 256), seed=1)\nx_sum = x.checksum()")


async def released_kernel(kernels, app, jp_fetch):
    k = await kernels.start()
    await k.run(HOLD)
    await app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    return k


async def test_progress_comes_after_busy_and_is_cleared_before_the_cell_runs(
    kernels, gpushare_app, jp_fetch
):
    k = await released_kernel(kernels, gpushare_app, jp_fetch)
    ex = await k.run("assert x.checksum() == x_sum\nprint('same')")
    kinds = [kind for kind, _ in ex.sequence]
    assert ex.sequence[0] == ("status", "busy")  # the gate's, before any progress
    assert kinds.count("display_data") == 1 and "update_display_data" in kinds
    shown = [d["data"]["text/plain"] for d in ex.displays]
    assert shown[0].startswith("gpushare: restoring") and shown[-1].startswith("gpushare: restored")
    cleared = kinds.index("clear_output")
    assert cleared > kinds.index("update_display_data")
    assert cleared < kinds.index("execute_input") < kinds.index("stream")  # before the cell's code
    assert ex.stdout == "same\n"


@pytest.mark.parametrize("gpushare_config", [{"keep_restore_progress": True}])
async def test_keep_restore_progress_leaves_the_line_in_the_cell(kernels, gpushare_app, jp_fetch):
    k = await released_kernel(kernels, gpushare_app, jp_fetch)
    ex = await k.run("print('same' if x.checksum() == x_sum else 'different')")
    kinds = [kind for kind, _ in ex.sequence]
    assert "clear_output" not in kinds
    assert ex.displays[-1]["data"]["text/plain"].startswith("gpushare: restored 64.0 MiB in")
    assert ex.sequence[0] == ("status", "busy")
