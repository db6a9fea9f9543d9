"""Incremental releases: a full release against a release that copies only what changed.

In one run, for the simulated GPU, for the PyTorch adapter on CPU storages (its fast
path with "device" storages that are CPU memory, as tests/test_offload_fast.py drives it)
and for the CuPy adapter on the CuPy the CPU tests fake at its device (tests/fakes/
fake_cupy.py: its "GPU memory" is host memory, as PyTorch's CPU storages are):

- full: a release of a state with no host copy (what every release did before);
- unchanged after a pre-copy: the same state, copied ahead by a pre-copy while idle, then
  released (the release someone waits for);
- 10 % changed: restored (the host copy is kept), 10 % of the arrays written in place,
  then released.

Each line gives the bytes the release copied, its time, and both as a share of the full
release. PyTorch's ``unchanged, default, no code`` line is the default path when no code ran
in the kernel between the pre-copy and the release (the agent's epoch did not move, see
``kernel/offload/quiet.py``): the kept copies are trusted without reading them. PyTorch then
runs the last two under each way of checking a kept copy when code may have run
(``JUPYTER_GPUSHARE_KEPT_CHECK``): ``full`` (the default: every byte's fingerprint, on a GPU
read at device memory bandwidth, here from CPU memory, where it costs a good part of a
copy; GPU figures come from the GPU proof's stage 2, which runs this with ``--device cuda``),
``sampled`` (one word per 4 KiB) and ``counters`` (version counters only); the ``check (no
copy)`` lines time the fingerprints alone. Run: ``python benchmarks/incremental_release.py [--gib 4] [--rate BYTES_PER_S]``;
``--smoke`` runs tiny sizes in seconds (CI). Needs numpy; the PyTorch part needs torch.

The PyTorch part's stand-in "device" storages (and its host copies) come from PyTorch's CPU
allocator in 2 MiB pages (PyTorch's ``THP_MEM_ALLOC_ENABLE``, where the host offers
transparent huge pages), as a GPU's memory is mapped: with 4 KiB pages, freeing a 4 GiB state
costs the host's page tables half a second, which no GPU pays and which would be most of an
unchanged release. ``--base-pages`` runs it with 4 KiB pages; the ``free the stand-ins`` line
times freeing a state of the same size alone, in either case.

``--device cuda`` runs the PyTorch part alone, on GPU 0 with the adapter as a kernel uses it
(CUDA copy streams, page-locked host buffers): there the full release is timed twice, first
while it pins its host buffers, then into buffers pinned already (the reference of the
shares). ``--json`` ends with one line of JSON: every row (the GPU proof reads it).
"""

from __future__ import annotations

import argparse
import gc
import json
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


def line(backend: str, what: str, copied: int, seconds: float, full: tuple[int, float],
         **extra: Any) -> dict[str, Any]:
    """One measured release (or check), with its shares of the full release."""
    return {"backend": backend, "what": what, "copied": copied, "seconds": seconds,
            "share_bytes": copied / full[0] if full[0] else 0.0,
            "share_time": seconds / full[1] if full[1] else 0.0, **extra}


def text(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"{row['backend']:<22} skipped: {row['skipped']}"
    return (f"{row['backend']:<22} {row['what']:<30} copied {row['copied'] / GiB:7.3f} GiB  "
            f"{row['seconds'] * 1000:9.1f} ms  bytes {row['share_bytes']:6.1%}  "
            f"time {row['share_time']:6.1%}")


def simulated(total: int, rate: float | None) -> list[dict[str, Any]]:
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

    out: list[dict[str, Any]] = []
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


THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's CPU allocator: 2 MiB pages from 2 MiB up


def huge_pages_offered() -> bool:
    """Whether the host gives transparent huge pages to memory that asks (madvise or always)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def pages() -> str:
    return "2 MiB" if os.environ.get(THP_ENV) == "1" and huge_pages_offered() else "4 KiB"


def torch_run(total: int, device: str = "cpu") -> list[dict[str, Any]]:
    """The PyTorch adapter's releases: on CPU storages standing in for device memory, or
    (``device`` "cuda") on GPU 0 with its CUDA copy streams and page-locked buffers."""
    name = "pytorch (CPU storages)" if device == "cpu" else "pytorch (GPU 0)"
    try:
        import torch
    except ImportError:
        return [{"backend": name, "skipped": "torch is not installed"}]
    cuda = device == "cuda"
    torch.set_num_threads(1)  # one copy thread: on a shared machine more threads only spin
    os.environ.pop("JUPYTER_GPUSHARE_KEEP_HOST_COPY", None)  # kept: the default
    from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV, KEPT_CHECKS
    from jupyter_gpushare.kernel.offload.pinned import PinnedPool
    from jupyter_gpushare.kernel.offload.torch_adapter import (
        StreamCopies,
        TorchAdapter,
        _pinned_alloc,
        _read_fingerprints,
        _storage_shared,
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

    if cuda:  # the kernel's pool, bounded by this state rather than the default 4 GiB
        pool = PinnedPool(_pinned_alloc, limit=2 * total, shared=_storage_shared)
    else:
        pool = PinnedPool(alloc_host, limit=0)  # host buffers are the kept copies, not the pool's

    def adapter() -> TorchAdapter:
        if cuda:
            return TorchAdapter(copies=StreamCopies(pool=pool))
        copies = StreamCopies(pool=pool, alloc_device=alloc_device, copy=copy,
                              sync=lambda device: None)
        return TorchAdapter(is_device=lambda t: t.untyped_storage()._cdata in where,
                            device_of=lambda s: where[s._cdata], copies=copies)

    def on_device(t: Any) -> Any:
        if cuda:
            return t.to("cuda:0")
        where[t.untyped_storage()._cdata] = "gpu0"
        return t

    # the first move pays torch's one-time set-up (and the fingerprint's weights): not timed
    warm = {"w": on_device(torch.zeros(16))}
    warmup = adapter()
    warmup.offload(warm)
    warmup.reload()
    drop_kept()

    size = total // ARRAYS // 4
    ns: dict[str, Any] = {}
    for i in range(ARRAYS):
        ns[f"w{i}"] = on_device(torch.full((size,), float(i)))

    def release() -> tuple[TorchAdapter, int, float, int]:
        """(adapter, bytes copied, seconds, host buffers it allocated)"""
        a = adapter()
        allocations = pool.allocations
        start = time.perf_counter()
        report = a.offload(ns)
        seconds = time.perf_counter() - start
        if report.skipped or report.count != len(ns):  # a release that moved nothing
            raise SystemExit(f"{name}: the release moved {report.count} of {len(ns)} tensors; "
                             f"left on the device: {report.skipped}")
        return a, report.copied, seconds, pool.allocations - allocations

    out: list[dict[str, Any]] = []
    os.environ.pop(KEPT_CHECK_ENV, None)
    if cuda:  # no kept copy: the restore gives its buffers to the pool, which the next reuses
        os.environ[KEEP_HOST_COPY_ENV] = "0"
        a, copied, seconds, first_allocs = release()
        first = (copied, seconds)
        a.reload()
    a, copied, seconds, allocs = release()
    full = (copied, seconds)
    if cuda:
        out.append(line(name, "full, pinning its buffers", *first, full,
                        host_allocations=first_allocs))
        os.environ.pop(KEEP_HOST_COPY_ENV, None)
    out.append(line(name, "full", *full, full, host_allocations=allocs))
    a.reload()
    if not cuda:  # what freeing the stand-in "device" memory costs alone: part of every release
        spare = [torch.full((size,), 1.0) for _ in range(ARRAYS)]
        start = time.perf_counter()
        del spare
        out.append(line(name, "free the stand-ins (no copy)", 0, time.perf_counter() - start,
                        full, pages=pages()))
    for check, take in (("full", fingerprint), ("sampled", sampled_fingerprint)):
        start = time.perf_counter()
        _read_fingerprints([take(t.untyped_storage()) for t in ns.values()])
        out.append(line(name, f"{check} check (no copy)", 0, time.perf_counter() - start, full))
    # the default in a kernel whose agent watches its requests (kernel/offload/quiet.py): no
    # code ran between the pre-copy and the release, so the kept copies are trusted unread
    from jupyter_gpushare.kernel.offload import quiet

    quiet.watch()  # this process runs no other Python thread: as quiet as an idle kernel
    drop_kept()
    adapter().precopy(ns)
    a, copied, seconds, allocs = release()
    out.append(line(name, "unchanged, default, no code", copied, seconds, full,
                    host_allocations=allocs))
    a.reload()
    quiet.unwatch()
    for check in KEPT_CHECKS:  # full: the default when code may have run since the copy
        os.environ[KEPT_CHECK_ENV] = check
        drop_kept()  # as fresh: no host copy at all
        adapter().precopy(ns)
        a, copied, seconds, allocs = release()
        out.append(line(name, f"unchanged, {check} check", copied, seconds, full,
                        host_allocations=allocs))
        a.reload()
        with torch.no_grad():
            for i in range(ARRAYS // 10):
                ns[f"w{i}"][:1] -= 1.0
        a, copied, seconds, allocs = release()
        out.append(line(name, f"10 % changed, {check} check", copied, seconds, full,
                        host_allocations=allocs))
        a.reload()
        expected = full[0] // ARRAYS * (ARRAYS // 10)
        assert copied == expected, f"{check}: 10 % changed copied {copied} bytes, not {expected}"
    os.environ.pop(KEPT_CHECK_ENV, None)
    changes = len(KEPT_CHECKS)
    assert all(float(ns[f"w{i}"][0]) == (i - changes if i < ARRAYS // 10 else i)
               for i in range(ARRAYS))
    drop_kept()
    ns.clear()
    gc.collect()
    return out


def cupy_run(total: int) -> list[dict[str, Any]]:
    """The CuPy adapter's releases through the CuPy the CPU tests fake at its device
    (tests/fakes/fake_cupy.py): its "GPU memory" is host memory, its copies ``memmove`` and
    its fingerprints NumPy's, so, as for PyTorch's CPU storages, the bytes are the adapter's
    and the times a CPU's. CuPy has no version counters: under ``counters`` only the epoch
    saves a copy, so with code since the copy (no epoch here) every allocation is copied."""
    name = "cupy (fake GPU, CPU)"
    saved = {key: sys.modules.get(key) for key in ("cupy", "cupy.cuda")}
    from tests.fakes import fake_cupy

    cupy = fake_cupy.install_module()
    from jupyter_gpushare.kernel.offload import cupy_adapter as ca
    from jupyter_gpushare.kernel.offload import quiet
    from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV, KEPT_CHECKS

    os.environ.pop(KEEP_HOST_COPY_ENV, None)
    os.environ.pop(KEPT_CHECK_ENV, None)
    ca.drop_kept()
    size = total // ARRAYS // 4
    ns = {f"x{i}": cupy.asarray(np.full(size, i, dtype=np.float32)) for i in range(ARRAYS)}

    def release() -> tuple[Any, int, float]:
        a = ca.CupyAdapter()
        start = time.perf_counter()
        report = a.offload(ns)
        seconds = time.perf_counter() - start
        if report.skipped or report.count != len(ns):
            raise SystemExit(f"{name}: the release moved {report.count} of {len(ns)} arrays; "
                             f"left on the device: {report.skipped}")
        return a, report.copied, seconds

    out: list[dict[str, Any]] = []
    try:
        a, copied, seconds = release()
        full = (copied, seconds)
        out.append(line(name, "full", *full, full))
        a.reload()
        quiet.watch()  # as quiet as an idle kernel: no code between the pre-copy and the release
        ca.drop_kept()
        ca.CupyAdapter().precopy(ns)
        a, copied, seconds = release()
        out.append(line(name, "unchanged, default, no code", copied, seconds, full))
        a.reload()
        quiet.unwatch()
        changes_so_far = 0
        for check in KEPT_CHECKS:  # with code since the copy: the check decides
            os.environ[KEPT_CHECK_ENV] = check
            ca.drop_kept()
            ca.CupyAdapter().precopy(ns)
            a, copied, seconds = release()
            out.append(line(name, f"unchanged, {check} check", copied, seconds, full))
            a.reload()
            for i in range(ARRAYS // 10):  # a cell rewrites 10 % of the arrays (a step
                ns[f"x{i}"][:] = i - changes_so_far - 1.0  # the "sampled" check sees)
            changes_so_far += 1
            a, copied, seconds = release()
            out.append(line(name, f"10 % changed, {check} check", copied, seconds, full))
            a.reload()
            expected = full[0] if check == "counters" else full[0] // ARRAYS * (ARRAYS // 10)
            assert copied == expected, f"{check}: 10 % changed copied {copied} bytes, not {expected}"
        changes = len(KEPT_CHECKS)
        assert all(float(ns[f"x{i}"].get()[0]) == (i - changes if i < ARRAYS // 10 else i)
                   for i in range(ARRAYS))
    finally:
        os.environ.pop(KEPT_CHECK_ENV, None)
        quiet.unwatch()
        ca.drop_kept()
        ns.clear()
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="state size in GiB (default 4)")
    parser.add_argument("--rate", type=float, default=None,
                        help="simulated GPU transfer rate, bytes/s (default: host copy speed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default): the simulated GPU and PyTorch on CPU storages; "
                             "cuda: PyTorch alone, on GPU 0")
    parser.add_argument("--base-pages", action="store_true",
                        help="PyTorch's stand-in storages in 4 KiB pages (default: 2 MiB pages "
                             "where the host offers transparent huge pages, as a GPU's memory)")
    parser.add_argument("--json", action="store_true",
                        help="end with one line of JSON: the state's size and every row")
    args = parser.parse_args(argv)
    total = (8 << 20) if args.smoke else int(args.gib * GiB)
    if args.device == "cpu" and not args.base_pages:
        # read once, at PyTorch's first allocation: set before it is imported
        if "torch" in sys.modules:
            print(f"torch is imported already: {THP_ENV} may not apply", flush=True)
        os.environ[THP_ENV] = "1"
    elif args.base_pages:
        os.environ.pop(THP_ENV, None)
    if args.device == "cuda":
        print(f"state: {total / GiB:.3f} GiB in {ARRAYS} arrays on GPU 0", flush=True)
        rows = torch_run(total, "cuda")
    else:
        print(f"state: {total / GiB:.3f} GiB in {ARRAYS} arrays; simulated transfer rate: "
              f"{'host copy speed' if not args.rate else f'{args.rate / 1e9:g} GB/s'}; "
              f"PyTorch's stand-in pages: {pages()}", flush=True)
        rows = simulated(total, args.rate) + torch_run(total) + cupy_run(total)
    for row in rows:
        print(text(row))
    if args.json:
        print(json.dumps({"state_bytes": total, "device": args.device, "rows": rows}))


if __name__ == "__main__":
    main()
