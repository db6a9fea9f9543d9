"""The agent channel's thread reads modules a cell may still be importing on the main thread.

A module another thread is importing is in ``sys.modules`` before its body has run, so its
names are not all there yet. Each test makes that moment last (a finder whose loader waits
before running the module's body, in a fresh interpreter) and asks the kernel side what the
channel's thread would ask then: the agent's report and the memory cap.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

HELD_IMPORT = """
import importlib, importlib.abc, importlib.util, sys, threading

NAME = "jupyter_gpushare.sim.device"
started, go = threading.Event(), threading.Event()


class Held(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                started.set()
                go.wait(60)
                inner.exec_module(module)

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, Held())
importer = threading.Thread(target=importlib.import_module, args=(NAME,))
importer.start()
assert started.wait(60)
assert NAME in sys.modules and not hasattr(sys.modules[NAME], "get_device")  # half imported
"""


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(HELD_IMPORT + code)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_agents_report_while_a_cell_imports_the_simulated_gpu():
    out = run("""
from jupyter_gpushare.kernel.agent import Agent

class Shell:
    user_ns = {}

report = Agent(Shell()).report()
print("simulated_bytes" in report, sorted(report))
go.set()
importer.join()
""")
    assert out.startswith("False "), out  # no device yet: nothing to count, and no error
    assert "'error'" not in out, out


def test_a_cap_set_while_a_cell_imports_the_simulated_gpu_holds_once_the_import_ends():
    out = run("""
import time
from jupyter_gpushare.kernel import caps

lines = caps.get().set(64 << 20, 1 << 30)
print("lines", lines)
go.set()
importer.join()
dev = sys.modules[NAME].get_device()
deadline = time.monotonic() + 60
while dev.cap != 64 << 20 and time.monotonic() < deadline:
    time.sleep(0.02)
print("cap", dev.cap)
print("applied", caps.get().applied.get(NAME))
""")
    assert "could not be applied" not in out, out
    assert f"cap {64 << 20}" in out, out
    assert "applied simulated GPU: capped at 64.0 MiB per GPU" in out, out
