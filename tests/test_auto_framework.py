"""release_method = "auto" per kernel: the framework method where PyTorch, CuPy or JAX hold
the kernel's GPU memory, the node's choice (the driver) otherwise; through the real
``ServerKernels.method_for`` and the real method classes."""

from __future__ import annotations

from types import SimpleNamespace

from jupyter_gpushare.reclaim.framework import FrameworkMethod
from jupyter_gpushare.server.ports import AutoPick, ServerKernels
from jupyter_gpushare.server.selection import (
    COVER_SLACK,
    framework_covers,
    method_for_kernel,
)

MiB = 1 << 20
CONTEXT = 500 * MiB


class Driverish(FrameworkMethod):
    """Stands for the driver method: another usable method, needing no agent."""

    name = "driver"
    needs_agent = False


def test_frameworks_that_hold_the_memory_get_the_framework_method():
    ok, why = framework_covers(4000 * MiB, 4000 * MiB + CONTEXT + 30 * MiB, CONTEXT)
    assert ok and "4000 MiB of the kernel's 4030 MiB" in why


def test_foreign_memory_keeps_the_driver():
    ok, why = framework_covers(1000 * MiB, 3000 * MiB + CONTEXT, CONTEXT)
    assert not ok and why.startswith("2000 MiB of the kernel's 3000 MiB")


def test_the_slack_and_the_share():
    own = 100 * MiB
    assert framework_covers(1, own + CONTEXT, CONTEXT)[0] == (own - 1 <= COVER_SLACK)
    big = 100_000 * MiB
    assert framework_covers(int(big * 0.96), big + CONTEXT, CONTEXT)[0]
    assert not framework_covers(int(big * 0.90), big + CONTEXT, CONTEXT)[0]


def test_unknown_figures_never_pick_the_framework_method():
    assert framework_covers(None, 1 << 30, CONTEXT) == (
        False, "the kernel agent gave no count of its frameworks' GPU memory")
    assert not framework_covers(1 << 30, None, CONTEXT)[0]
    assert not framework_covers(0, 1 << 30, CONTEXT)[0]


def test_method_for_kernel_needs_the_framework_method_usable():
    usable = {"driver": Driverish()}
    report = {"framework_bytes": 1 << 30}
    assert method_for_kernel("driver", usable, report, (1 << 30) + CONTEXT, CONTEXT)[0] == "driver"
    usable["framework"] = FrameworkMethod()
    assert method_for_kernel("driver", usable, report, (1 << 30) + CONTEXT, CONTEXT)[0] == "framework"
    assert method_for_kernel("driver", usable, {"framework_bytes": True}, 1 << 30, CONTEXT)[0] == "driver"
    assert method_for_kernel("driver", usable, None, 1 << 30, CONTEXT)[0] == "driver"


class KernelManager:
    def get_kernel(self, kernel_id):
        raise KeyError(kernel_id)


def test_server_kernels_picks_per_kernel_and_says_why():
    conns = {
        "torch-only": SimpleNamespace(report={"framework_bytes": 2000 * MiB}),
        "mixed": SimpleNamespace(report={"framework_bytes": 500 * MiB}),
        "no-report": SimpleNamespace(report=None),
    }
    held = {"torch-only": 2010 * MiB + CONTEXT, "mixed": 3000 * MiB + CONTEXT,
            "no-report": 1000 * MiB + CONTEXT, "no-agent": 1000 * MiB + CONTEXT}
    assert ServerKernels(KernelManager(), Driverish(), connections=lambda: conns) \
        .method_for("torch-only") == "driver"  # not auto: the node's choice
    auto = AutoPick({"driver": Driverish(), "framework": FrameworkMethod()}, held.get, CONTEXT)
    kernels = ServerKernels(KernelManager(), Driverish(), connections=lambda: conns, auto=auto)
    assert kernels.method_for("torch-only") == "framework"
    assert kernels.method_for("mixed") == "driver"
    assert kernels.method_for("no-report") == "driver"
    assert kernels.method_for("no-agent") == "driver"  # no agent: the framework method cannot act
    assert kernels.picks["torch-only"].startswith("framework: PyTorch, CuPy or JAX hold 2000 MiB")
    assert kernels.picks["mixed"].startswith("driver: 2500 MiB of the kernel's 3000 MiB")


def test_released_and_restored_events_carry_the_rate():
    from jupyter_gpushare.core.announce import Announcer

    said: list[dict] = []
    announce = Announcer(said.append, agent=lambda kid: None, path=lambda kid: "",
                         restore_mode=lambda: "eager")
    announce("k", "released", method="framework", bytes=4 << 30, seconds=0.25)
    announce("k", "restored", method="framework", bytes=1000, seconds=0.0)  # no rate from 0 s
    announce("k", "restore_waiting", bytes=1 << 30, seconds=2.0)  # needed bytes: no rate
    assert said[0]["bytes_per_second"] == (4 << 30) / 0.25
    assert "bytes_per_second" not in said[1] and "bytes_per_second" not in said[2]
