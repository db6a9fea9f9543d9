"""Incremental releases: a full release against a release that copies only what changed.

In one run, for the simulated GPU and for the PyTorch adapter on CPU storages (its fast
path with "device" storages that are CPU memory, as tests/test_offload_fast.py drives it):

- full: a release of a state with no host copy (what every release did before);
- unchanged after a pre-copy: the same state, copied ahead by a pre-copy while idle, then
  released (the release someone waits for);
- 10 % changed: restored (the host copy is kept), 10 % of the arrays written in place,
  then released.

Each line gives the bytes the release copied, its time, and both as a share of the full
release. PyTorch runs the last two under each way of checking a kept copy
(``JUPYTER_GPUSHARE_KEPT_CHECK``): ``full`` (the default: every byte's fingerprint, on a GPU
read at device memory bandwidth, here from CPU memory, where it costs a good part of a
copy; GPU figures come from the GPU proof, ``benchmarks/gpu/scenes.py`` stage 2),
``sampled`` (one word per 4 KiB) and ``counters`` (version counters only); the ``check (no
copy)`` lines time the fingerprints alone. Run: ``python benchmarks/incremental_release.py [--gib 4] [--rate BYTES_PER_S]``;
``--smoke`` runs tiny sizes in seconds (CI). Needs numpy; the PyTorch part needs torch.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jupyter_gpushare.sim import device as device_module
from jupyter_gpushare.sim import simgpu
from jupyter_gpushare.sim.device import LocalBackend, SimDevice
from jupyter_gpushare.sim.node import SimNode

GiB = 1 << 30
ARRAYS = 40  # 10 % of them is 4


def line(backend: str, what: str, copied: int, seconds: float, full: tuple[int, float]) -> str:
    share_bytes = copied / full[0] if full[0] else 0.0
    share_time = seconds / full[1] if full[1] else 0.0
    return (f"{backend:<22} {what:<30} copied {copied / GiB:7.3f} GiB  {seconds * 1000:9.1f} ms"
            f"  bytes {share_bytes:6.1%}  time {share_time:6.1%}")


def simulated(total: int, rate: float | None) -> list[str]:
    node = SimNode((total * 2,))
    dev = SimDevice(LocalBackend(node))
    dev.transfer_rate = rate
    device_module._device = dev
    size = total // ARRAYS // 4
    xs = [simgpu.array(np.full(size, i, dtype=np.float32)) for i in range(ARRAYS)]

    def release() -> tuple[int, float]:
        dev.lock()
        start = time.perf_counter()
        out = dev.checkpoint()
        return out["copied"], time.perf_counter() - start

    out = []
    full = release()
    out.append(line("simulated GPU", "full", *full, full))
    dev.resume()
    dev.drop_host_copies()  # as fresh: no host copy at all
    dev.precopy()  # while idle, in the background (here: at once)
    unchanged = release()
    out.append(line("simulated GPU", "unchanged after pre-copy", *unchanged, full))
    dev.resume()
    for x in xs[: ARRAYS // 10]:
        x[:1] = -1.0  # a cell writes 10 % of the arrays
    changed = release()
    out.append(line("simulated GPU", "10 % changed", *changed, full))
    dev.resume()
    assert all(float(x.get()[0]) == (-1.0 if i < ARRAYS // 10 else i) for i, x in enumerate(xs))
    del xs
    device_module._device = None
    gc.collect()
    return out


def torch_cpu(total: int) -> list[str]:
    try:
        import torch
    except ImportError:
        return ["pytorch (CPU storages)   skipped: torch is not installed"]
    torch.set_num_threads(1)  # one copy thread: on a shared machine more threads only spin
    os.environ.pop("JUPYTER_GPUSHARE_KEEP_HOST_COPY", None)  # kept: the default
    from jupyter_gpushare.kernel.offload.base import KEPT_CHECK_ENV, KEPT_CHECKS
    from jupyter_gpushare.kernel.offload.pinned import PinnedPool
    from jupyter_gpushare.kernel.offload.torch_adapter import (
        StreamCopies,
        TorchAdapter,
        _read_fingerprints,
        drop_kept,
        fingerprint,
        sampled_fingerprint,
    )

    where: dict[int, str] = {}

    def alloc_host(nbytes: int) -> Any:
        host = torch.UntypedStorage(nbytes)
        where.pop(host._cdata, None)
        return host

    def alloc_device(nbytes: int, device: str) -> Any:
        new = torch.UntypedStorage(nbytes)
        where[new._cdata] = device
        return new

    def copy(dst: Any, src: Any, device: str) -> None:
        dst.copy_(src)

    pool = PinnedPool(alloc_host, limit=0)  # host buffers are the kept copies, not the pool's

    def adapter() -> TorchAdapter:
        copies = StreamCopies(pool=pool, alloc_device=alloc_device, copy=copy,
                              sync=lambda device: None)
        return TorchAdapter(is_device=lambda t: t.untyped_storage()._cdata in where,
                            device_of=lambda s: where[s._cdata], copies=copies)

    warm = {"w": torch.zeros(16)}  # the first move pays torch's one-time set-up: not timed
    where[warm["w"].untyped_storage()._cdata] = "gpu0"
    first = adapter()
    first.offload(warm)
    first.reload()
    drop_kept()

    size = total // ARRAYS // 4
    ns: dict[str, Any] = {}
    for i in range(ARRAYS):
        t = torch.full((size,), float(i))
        where[t.untyped_storage()._cdata] = "gpu0"
        ns[f"w{i}"] = t

    def release() -> tuple[TorchAdapter, int, float]:
        a = adapter()
        start = time.perf_counter()
        report = a.offload(ns)
        return a, report.copied, time.perf_counter() - start

    out = []
    name = "pytorch (CPU storages)"
    os.environ.pop(KEPT_CHECK_ENV, None)
    a, *full_numbers = release()
    full = (full_numbers[0], full_numbers[1])
    out.append(line(name, "full", *full, full))
    a.reload()
    for check, take in (("full", fingerprint), ("sampled", sampled_fingerprint)):
        start = time.perf_counter()
        _read_fingerprints([take(t.untyped_storage()) for t in ns.values()])
        out.append(line(name, f"{check} check (no copy)", 0, time.perf_counter() - start, full))
    for check in KEPT_CHECKS:  # full: the default
        os.environ[KEPT_CHECK_ENV] = check
        drop_kept()  # as fresh: no host copy at all
        adapter().precopy(ns)
        a, copied, seconds = release()
        out.append(line(name, f"unchanged, {check} check", copied, seconds, full))
        a.reload()
        with torch.no_grad():
            for i in range(ARRAYS // 10):
                ns[f"w{i}"][:1] -= 1.0
        a, copied, seconds = release()
        out.append(line(name, f"10 % changed, {check} check", copied, seconds, full))
        a.reload()
        assert copied == full[0] // ARRAYS * (ARRAYS // 10)
    os.environ.pop(KEPT_CHECK_ENV, None)
    changes = len(KEPT_CHECKS)
    assert all(float(ns[f"w{i}"][0]) == (i - changes if i < ARRAYS // 10 else i)
               for i in range(ARRAYS))
    drop_kept()
    ns.clear()
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="state size in GiB (default 4)")
    parser.add_argument("--rate", type=float, default=None,
                        help="simulated GPU transfer rate, bytes/s (default: host copy speed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args(argv)
    total = (8 << 20) if args.smoke else int(args.gib * GiB)
    print(f"state: {total / GiB:.3f} GiB in {ARRAYS} arrays; simulated transfer rate: "
          f"{'host copy speed' if not args.rate else f'{args.rate / 1e9:g} GB/s'}")
    for text in simulated(total, args.rate) + torch_cpu(total):
        print(text)


if __name__ == "__main__":
    main()
