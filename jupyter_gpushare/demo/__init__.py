"""The demo notebook that `jupyter gpushare demo` opens, and where the demo keeps its files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NAME = "gpushare-demo.ipynb"

SIM_CELLS = [
    ("md", "# GPU share demo\n\nThis kernel allocates on the **simulated GPU node** (no GPU needed). "
           "Open the **GPU share** panel (the GPU icon in the sidebar) to watch allocation (memory held) against "
           "utilization (SM busy), per GPU and per kernel."),
    ("code", "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n\n"
             "# 3 GiB on this kernel's simulated GPU (gpushare placed it on the one with the most room)\n"
             "weights = simgpu.random((512, 1024, 1024), device=0, seed=0)\n"
             "cache = simgpu.zeros((256, 1024, 1024), device=0)\n"
             "checksum = weights.checksum()\nprint('holding', simgpu.memory_allocated() / 2**30, 'GiB; checksum', checksum[:12])"),
    ("code", "# some 'GPU work': the panel shows this kernel's utilization rise\nsimgpu.burn(5, device=0)\n(weights * 2).sum().get()"),
    ("code", "%gpushare"),
    ("md", "Release this kernel's GPU memory now (it also happens by itself after the idle timeout; "
           "the panel's release button does the same). The kernel keeps running and keeps its state:"),
    ("code", "%gpushare release"),
    ("md", "The next cell restores the state transparently; the data is identical:"),
    ("code", "assert weights.checksum() == checksum\nprint('restored, checksum matches')"),
    ("md", "Pin a kernel you want to keep on the GPU, whatever the idle time:"),
    ("code", "%gpushare pin"),
]

GPU_CELLS = [
    ("md", "# GPU share demo (real GPUs)\n\nOpen the **GPU share** panel (the GPU icon in the sidebar)."),
    ("code", "import torch\nx = torch.randn(256, 1024, 1024, device='cuda')  # 1 GiB\nprint(torch.cuda.memory_allocated() / 2**30, 'GiB')"),
    ("code", "%gpushare"),
    ("code", "%gpushare release"),
    ("code", "print(x.sum().item())  # restores first, transparently"),
]


def write_demo(directory: Path, simulated: bool, overwrite: bool = True) -> Path:
    """Write the demo notebook into ``directory`` and return its path. With ``overwrite``
    False an existing notebook (the user's, maybe edited) is kept as it is."""
    path = directory / NAME
    if path.exists() and not overwrite:
        return path
    nb = new_notebook()
    for kind, text in SIM_CELLS if simulated else GPU_CELLS:
        nb.cells.append(new_markdown_cell(text) if kind == "md" else new_code_cell(text))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    directory.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


#: JupyterLab settings the demo changes from their defaults (a person's own settings still
#: win): no "get notified about Jupyter news?" prompt stacked over the demo's notifications
LAB_DEFAULTS = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}


def default_dir() -> Path:
    """Where the demo keeps its files unless told (``--dir``): ``gpushare-demo`` in Jupyter's
    data directory (``JUPYTER_DATA_DIR``, else ~/.local/share/jupyter on Linux), never the
    current directory, which may be a git checkout (the hub demo's files include its cookie
    secret)."""
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "gpushare-demo"


def config_dir(directory: Path) -> Path:
    """The demo's own Jupyter configuration folder, under ``directory`` (hidden: not in the
    file browser)."""
    return directory / ".jupyter-config"


def lab_config(directory: Path) -> str:
    """Write the demo's JupyterLab defaults (:data:`LAB_DEFAULTS`) in :func:`config_dir` and
    return the ``JUPYTER_CONFIG_PATH`` that adds them to this environment's, for the server
    the demo starts."""
    config = config_dir(directory)
    labconfig = config / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "default_setting_overrides.json").write_text(
        json.dumps(LAB_DEFAULTS, indent=2) + "\n", encoding="utf-8")
    return os.pathsep.join(filter(None, [str(config), os.environ.get("JUPYTER_CONFIG_PATH")]))
