"""Lazy restore: which cells may touch the GPU. Unit tests of the cell analysis and of the
namespace scan, then real kernels in restore_mode = "lazy": CPU-only cells run on a released
kernel without a restore; GPU cells restore first (the agent's pre_run_cell), and what the
agent misses the watchdog restores."""

from __future__ import annotations

import asyncio
import functools
import sys
import types

import numpy as np
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from jupyter_gpushare import clock
from jupyter_gpushare.kernel import lazy, walk

from .helpers import kernel_status, wait_for

MiB = 1 << 20


# -- unit: which names may reach the GPU -----------------------------------------------------
class _Tensor:
    """Stands in for a GPU framework's array type (its module is set below)."""


_Tensor.__module__ = "torch"


class Shell:
    """What may_touch_gpu needs of an IPython shell: transform_cell and user_ns."""

    def __init__(self, ns: dict):
        self.user_ns = ns
        self._tm = TransformerManager()

    def transform_cell(self, code: str) -> str:
        return self._tm.transform_cell(code)


def user_function():
    return 1


user_function.__module__ = "__main__"


class Holder:
    pass


@pytest.fixture
def ns():
    """A notebook namespace: GPU objects at several depths, CPU objects, modules."""
    import json
    import math

    holder = Holder()
    holder.__dict__["weights"] = {"w": _Tensor()}
    return {
        "x": _Tensor(),
        "nested": {"a": [1, 2, (3, _Tensor())]},
        "holder": holder,
        "df": {"col": list(range(10))},
        "arr": np.arange(10),
        "n": 3,
        "text": "hello",
        "math": math,
        "json": json,
        "np": np,
        "f": user_function,
        "part": functools.partial(user_function),
        "_private": _Tensor(),
    }


def test_gpu_names_finds_objects_at_depth_and_user_code(ns):
    names = lazy.gpu_names(ns, packages=frozenset())
    assert names == {"x", "nested", "holder", "f", "part"}


def test_gpu_names_counts_modules_of_gpu_frameworks_and_user_modules(tmp_path, monkeypatch):
    fake_torch = types.ModuleType("torch")
    (tmp_path / "my_helpers.py").write_text("def make():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_helpers

    try:
        names = lazy.gpu_names({"torch": fake_torch, "helpers": my_helpers, "np": np},
                               packages=frozenset())
    finally:
        sys.modules.pop("my_helpers", None)
    assert names == {"torch", "helpers"}  # numpy is installed code, not the user's


def test_gpu_names_gives_up_on_huge_object_graphs_conservatively():
    deep = [[object() for _ in range(1000)] for _ in range(30)]
    assert lazy.gpu_names({"deep": deep}, packages=frozenset()) == {"deep"}
    flat = list(range(100_000))  # atoms cost nothing: no reason to give up
    assert lazy.gpu_names({"flat": flat}, packages=frozenset()) == set()
    assert lazy.gpu_names({"longer": [*flat, 1]}, packages=frozenset()) == {"longer"}


class _Unreadable(dict):
    """A mapping whose items cannot be read (a broken proxy, a lazy loader that fails)."""

    def items(self):
        raise RuntimeError("no")


_Unreadable.__module__ = "some_installed_lib"


class _Slotted:
    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner


_Slotted.__module__ = "some_installed_lib"


def test_gpu_names_follows_slots_and_closures_like_the_offload_walk():
    def make_step(model):  # a library's closure over a model
        def step():
            return model
        return step

    step = make_step(_Tensor())
    step.__module__ = "some_installed_lib"
    ns = {"slotted": _Slotted(_Tensor()), "step": step, "empty": _Slotted(None)}
    assert lazy.gpu_names(ns, packages=frozenset()) == {"slotted", "step"}


def test_what_the_walk_could_not_look_at_counts_as_reaching_the_gpu():
    deep: list = []
    for _ in range(40):  # deeper than the walk looks
        deep = [deep]
    bad = _Unreadable(a=1)
    assert lazy.gpu_names({"deep": deep, "bad": bad, "ok": [[1]]}, packages=frozenset()) \
        == {"deep", "bad"}
    result = walk.walk([("bad", bad, None)], lambda obj: False)
    assert result.unreadable == 1 and not result.complete and not result.found
    # the same walk, asked by a framework adapter, just finds nothing there
    assert walk.names_reaching({"bad": bad}, lambda obj: False) == set()
    assert lazy.may_reach_gpu(deep, packages=frozenset())
    assert not lazy.may_reach_gpu(deep, packages=frozenset(), deep=False)


def test_gpu_names_looks_past_the_first_items():
    late = [{"i": i} for i in range(5000)] + [_Tensor()]
    assert lazy.gpu_names({"late": late}, packages=frozenset()) == {"late"}


def test_gpu_packages_finds_packages_built_on_a_gpu_framework(monkeypatch):
    fake_torch = types.ModuleType("torch")
    wrapper = types.ModuleType("fancy_wrapper")
    wrapper.torch = fake_torch
    plain = types.ModuleType("plain_lib")
    plain.json = __import__("json")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setitem(sys.modules, "fancy_wrapper", wrapper)
    monkeypatch.setitem(sys.modules, "plain_lib", plain)
    found = lazy.gpu_packages()
    assert "fancy_wrapper" in found
    assert "plain_lib" not in found and "json" not in found and "torch" not in found


# -- unit: may this cell touch the GPU -------------------------------------------------------
@pytest.mark.parametrize("code", [
    "print(1 + 1)",
    "import math\nmath.sqrt(2)",
    "import json, numpy as np\nnp.arange(3).sum()",
    "y = [i * n for i in range(10)]",
    "df['col'][:3]",
    "text.upper()",
    "arr.mean()",
    "# only a comment",
    "",
    "%pwd",
    "!ls -l",
    "%%bash\necho hi",
    "%%writefile /tmp/x.py\nprint(x)",  # a file's text, not code run here
    "%time sum(range(10))",
    "%gpushare",
    "%gpushare release\n%gpushare status",
    "def g(a):\n    return a + 1",  # defining a function calls nothing
    "class C:\n    pass",
])
def test_cpu_only_cells(ns, code):
    assert not lazy.may_touch_gpu(code, Shell(ns), lazy.gpu_names(ns, frozenset()), frozenset())


@pytest.mark.parametrize("code", [
    "x",
    "x.shape",  # attribute access on a GPU name: conservative
    "print(x)",
    "y = x",
    "del x",
    "[v for v in nested['a']]",
    "{k: k for k in [holder]}",
    "(lambda: x)()",
    "holder.weights",
    "f()",  # user code can reach anything
    "part()",
    "import torch",
    "from torch import nn",
    "import jupyter_gpushare.sim.simgpu as sg",
    "from jupyter_gpushare.sim import simgpu",
    "exec('x.sum()')",
    "eval('1')",
    "globals()['x']",
    "vars()['x']",
    "get_ipython().user_ns['x']",
    "%time x.sum()",
    "%timeit -n 10 -r 3 x.sum()",
    "%timeit -q x.sum()",
    "x?",  # pinfo shows a repr: may read the device
    "!echo {x}",  # expands Python in this kernel
    "%%time\ny = x + 1",
    "%%gpushare release-after\nz = x * 2",
    "%%capture out\nx",
    "%%some_unknown_magic\n1",
    "%unknown_line_magic 1",
    "%load_ext something",
    "def broken(:\n    pass",  # syntax error: unknown, so yes
    "from . import sibling",
])
def test_cells_that_may_touch_the_gpu(ns, code):
    assert lazy.may_touch_gpu(code, Shell(ns), lazy.gpu_names(ns, frozenset()), frozenset())


def test_names_bound_after_the_release_are_checked_live(ns):
    shell = Shell(ns)
    bound = lazy.gpu_names(ns, frozenset())
    assert not lazy.may_touch_gpu("later()", shell, bound, frozenset())  # not defined: NameError
    ns["later"] = user_function
    assert lazy.may_touch_gpu("later()", shell, bound, frozenset())
    ns["later"] = len
    assert not lazy.may_touch_gpu("later([])", shell, bound, frozenset())
    ns["obj"] = Holder()  # an instance of a class of the notebook: its methods are user code
    assert lazy.may_touch_gpu("obj", shell, bound, frozenset())


def test_packages_on_a_gpu_framework_count(ns):
    shell = Shell(ns)
    assert lazy.may_touch_gpu("import fancy_wrapper", shell, set(), frozenset({"fancy_wrapper"}))
    assert not lazy.may_touch_gpu("import fancy_wrapper", shell, set(), frozenset())


def test_only_gpushare_magics():
    assert lazy.only_gpushare_magics("%gpushare")
    assert lazy.only_gpushare_magics("  %gpushare release\n# why\n\n%gpushare idle-timeout 5\n")
    assert not lazy.only_gpushare_magics("%gpushare\nx.sum()")
    assert not lazy.only_gpushare_magics("%%gpushare release-after\nx = 1")
    assert not lazy.only_gpushare_magics("")
    assert not lazy.only_gpushare_magics("%gpusharex")


def test_analysis_without_a_shell_parses_plain_python():
    assert not lazy.may_touch_gpu("print(1)", None, set(), frozenset())
    assert lazy.may_touch_gpu("%magic", None, set(), frozenset())  # not Python: unknown


# -- real kernels in lazy mode ------------------------------------------------------------------
GRACE = 30.0


@pytest.fixture
def gpushare_config():
    return {"restore_mode": "lazy", "restore_grace": GRACE}



SETUP = (
    "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
    "x = simgpu.array(np.arange(8 * 1024 * 1024 // 4, dtype=np.uint32))\n"
    "x_sum = x.checksum()\n"
    "def total():\n    return int(x.get().sum())\n"
    "data = {'n': 3}"
)


async def released_kernel(kernels, jp_fetch, gpushare_app):
    k = await kernels.start()
    await k.run(SETUP)
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert gpushare_app.controller.states[k.id].state == "released"
    return k


async def test_lazy_mode_cpu_cells_run_without_restore_gpu_cells_restore_first(
    kernels, jp_fetch, gpushare_app, restores
):
    k = await released_kernel(kernels, jp_fetch, gpushare_app)
    st = gpushare_app.controller.states[k.id]

    outputs = []
    for code in ("print(1 + 1)", "import math\nprint(math.sqrt(16))", "data['n'] += 1",
                 "%gpushare", "!true"):
        outputs.append((await k.run(code)).text)
        assert (st.state, st.restores) == ("released", 0), code
    assert outputs[0].strip() == "2" and outputs[1].strip() == "4.0"
    assert "released" in outputs[3]  # %gpushare shows the state as it is
    assert "lazy: before the next cell that may use the GPU" in outputs[3]  # and what restores
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "released" and info["restores"] == 0
    assert gpushare_app.node.used(0) == 0

    outputs = []
    for n, code in enumerate(
        ("print(x.get()[:3])", "y = simgpu.zeros((4,))", "print(total())"), start=1
    ):
        outputs.append((await k.run(code)).stdout)
        assert st.restores == n, code
        assert restores[-1] == (k.id, "agent"), code  # the agent restored, before the cell
        await gpushare_app.poll_once()
        await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert outputs[0] == "[0 1 2]\n"
    assert outputs[2] == f"{sum(range(8 * 1024 * 1024 // 4))}\n"
    ex = await k.run("print(x.checksum() == x_sum, data['n'])")
    assert ex.stdout.strip() == "True 4"
    assert [r for _, r in restores] == ["agent"] * 4


async def test_watchdog_restores_what_the_agent_misses(kernels, jp_fetch, gpushare_app, restores):
    """A GPU call the cell analysis cannot see (reached through importlib) blocks, as CUDA
    calls block on a checkpointed process, until the watchdog restores after restore_grace."""
    k = await released_kernel(kernels, jp_fetch, gpushare_app)
    msg_id = k.send("import importlib\n"
                    "sg = importlib.import_module('jupyter_gpushare.sim.simgpu')\n"
                    "print(float(sg.ones((4,)).get().sum()))")
    await wait_for(lambda: gpushare_app.serverapp.kernel_manager.get_kernel(k.id).execution_state
                   == "busy", what="busy")
    await asyncio.sleep(0.3)
    await gpushare_app.poll_once()
    assert k.executions[msg_id].status == ""  # blocked in the GPU call, not restored
    assert gpushare_app.controller.states[k.id].state == "released"
    clock.advance(GRACE / 2)
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[k.id].state == "released"  # still within the grace
    clock.advance(GRACE / 2 + 1)
    await gpushare_app.poll_once()
    ex = await k.wait(msg_id)
    assert ex.stdout.strip() == "4.0"
    assert restores == [(k.id, "watchdog")]
