"""Speed of the framework method's move (PyTorch adapter): the fast path against the old one,
measured in the same run, as MB/s of state moved and the ratio.

- new: :class:`StreamCopies`: host buffers kept across cycles (:class:`PinnedPool`), copies
  queued on one stream per GPU, one wait per GPU at the end of a move.
- old: the behaviour before it (:class:`LegacyCopies`): a fresh host buffer for every storage
  every cycle (freed after the reload), and a wait after every copy.

CPU part (always): N MiB in T tensors over two simulated GPUs made of CPU storages (the
tests' seam): the copies are memcpy, a "fresh buffer" is a new CPU allocation (which
malloc mostly serves from memory it touched before: nothing like pinning's cost), a wait is
nothing. So the CPU ratio is the new bookkeeping's cost (expect about 1.00), not a GPU's
gain; the pool's reuse is shown by its counts.

CUDA part (when a GPU is there): the same state on the GPUs (spread over every visible GPU),
moved by the default adapter (new) and by the old behaviour (``cuda_to_pinned`` /
``pinned_to_cuda`` with ``torch.cuda.synchronize()`` after every copy), and the ceiling: one
plain pinned copy of the same bytes each way per GPU, all GPUs at once.

Each figure is the median of ``--repeat`` cycles after one warm-up cycle per path, the two
paths' cycles alternating (the first cycle of the new path allocates its buffers like the
old one; later ones reuse them).

Usage: python benchmarks/framework_offload.py [--mib 512] [--tensors 500] [--repeat 5] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from jupyter_gpushare.kernel.offload.pinned import PinnedPool
from jupyter_gpushare.kernel.offload.torch_adapter import (
    StreamCopies,
    TorchAdapter,
    _storage_shared,
    cuda_to_pinned,
    pinned_to_cuda,
)

MiB = 1 << 20


def one_cycle(make: Callable[[], TorchAdapter], namespace: dict) -> tuple[float, float, int]:
    adapter = make()  # a new adapter per release, as the agent makes them
    start = time.perf_counter()
    off = adapter.offload(namespace)
    mid = time.perf_counter()
    back = adapter.reload()
    end = time.perf_counter()
    assert off.bytes == back.bytes and not off.skipped, off.skipped
    return mid - start, end - mid, off.bytes


def interleaved(new: Callable[[], TorchAdapter], old: Callable[[], TorchAdapter], namespace: dict,
                repeat: int) -> tuple[tuple[float, float, int], tuple[float, float, int]]:
    """Median offload and reload seconds of each path over ``repeat`` cycles after a warm-up
    cycle each, the two paths' cycles alternating (a shared machine's load falls on both)."""
    runs: dict[str, list[tuple[float, float, int]]] = {"new": [], "old": []}
    for i in range(repeat + 1):
        for label, make in (("old", old), ("new", new)) if i % 2 else (("new", new), ("old", old)):
            figures = one_cycle(make, namespace)
            if i:
                runs[label].append(figures)

    def median(label: str) -> tuple[float, float, int]:
        rows = runs[label]
        return (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                rows[0][2])

    return median("new"), median("old")


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f} MB/s"


def show(label: str, new: tuple[float, float, int], old: tuple[float, float, int]) -> None:
    n_off, n_back, moved = new
    o_off, o_back, _ = old
    print(f"  {label}: {moved / MiB:.0f} MiB")
    print(f"    offload  new {n_off * 1e3:8.1f} ms ({rate(moved, n_off)})  old {o_off * 1e3:8.1f} ms "
          f"({rate(moved, o_off)})  new/old time {n_off / o_off:.2f}")
    print(f"    reload   new {n_back * 1e3:8.1f} ms ({rate(moved, n_back)})  old {o_back * 1e3:8.1f} ms "
          f"({rate(moved, o_back)})  new/old time {n_back / o_back:.2f}")
    print(f"    round trip new/old time {(n_off + n_back) / (o_off + o_back):.2f}")


# -- CPU: two simulated GPUs ---------------------------------------------------------------------
class CpuGPUs:
    def __init__(self) -> None:
        self.where: dict[int, str] = {}
        self.pool = PinnedPool(self.alloc_host, limit=1 << 40, shared=_storage_shared)

    def alloc_host(self, nbytes: int) -> Any:
        host = torch.UntypedStorage(nbytes)
        self.where.pop(host._cdata, None)
        return host

    def alloc_device(self, nbytes: int, device: str) -> Any:
        new = torch.UntypedStorage(nbytes)
        self.where[new._cdata] = device
        return new

    def new(self) -> TorchAdapter:
        copies = StreamCopies(pool=self.pool, alloc_device=self.alloc_device,
                              copy=lambda dst, src, device: dst.copy_(src), sync=lambda device: None)
        return TorchAdapter(is_device=lambda t: t.untyped_storage()._cdata in self.where,
                            device_of=lambda s: self.where[s._cdata], copies=copies)

    def old(self) -> TorchAdapter:
        def to_host(storage: Any) -> Any:
            host = self.alloc_host(storage.nbytes())
            host.copy_(storage)
            return host

        def to_device(host: Any, device: Any) -> Any:
            new = self.alloc_device(host.nbytes(), device)
            new.copy_(host)
            return new

        return TorchAdapter(is_device=lambda t: t.untyped_storage()._cdata in self.where,
                            device_of=lambda s: self.where[s._cdata],
                            to_host=to_host, to_device=to_device, synchronize=lambda: None)


def bench_cpu(mib: int, tensors: int, repeat: int) -> None:
    gpus = CpuGPUs()
    numel = mib * MiB // tensors // 4
    state = {}
    for i in range(tensors):
        t = torch.randn(numel)
        gpus.where[t.untyped_storage()._cdata] = f"gpu{i % 2}"
        state[f"t{i}"] = t
    check = [t.clone() for t in state.values()]
    namespace = {"state": state}
    print(f"CPU ({torch.get_num_threads()} threads), two simulated GPUs, {tensors} tensors:")
    new, old = interleaved(gpus.new, gpus.old, namespace, repeat)
    assert all(torch.equal(a, b) for a, b in zip(state.values(), check, strict=True))
    show("state", new, old)
    print(f"    host buffers: {gpus.pool.allocations} allocated by the new path over "
          f"{repeat + 1} cycles of {tensors} storages ({gpus.pool.reuses} reused)")


# -- CUDA -----------------------------------------------------------------------------------------
def bench_cuda(mib: int, tensors: int, repeat: int) -> None:
    if not torch.cuda.is_available():
        print("CUDA: not available, skipped")
        return
    n_gpus = torch.cuda.device_count()
    numel = mib * MiB // tensors // 4
    state = {f"t{i}": torch.randn(numel, device=f"cuda:{i % n_gpus}") for i in range(tensors)}
    check = [t.cpu() for t in state.values()]
    namespace = {"state": state}
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(n_gpus))
    print(f"CUDA: {n_gpus} GPU(s) ({names}), {tensors} tensors:")

    def old() -> TorchAdapter:
        def to_host(storage: Any) -> Any:
            host = cuda_to_pinned(storage)
            torch.cuda.synchronize(storage.device)  # the wait after every copy
            return host

        def to_device(host: Any, device: Any) -> Any:
            new = pinned_to_cuda(host, device)
            torch.cuda.synchronize(device)
            return new

        return TorchAdapter(to_host=to_host, to_device=to_device)

    new_figures, old_figures = interleaved(TorchAdapter, old, namespace, repeat)
    same = all(torch.equal(a.cpu(), b) for a, b in zip(state.values(), check, strict=True))
    show("state", new_figures, old_figures)
    print(f"    state bitwise identical after every cycle: {same}")

    # the ceiling: one plain pinned copy per GPU of its share of the bytes, all GPUs at once
    per_gpu = numel * 4 * tensors // n_gpus
    dev = [torch.empty(per_gpu, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n_gpus)]
    host = [torch.empty(per_gpu, dtype=torch.uint8, pin_memory=True) for _ in range(n_gpus)]
    streams = [torch.cuda.Stream(device=i) for i in range(n_gpus)]
    d2h, h2d = [], []
    for _ in range(repeat):
        for direction, out in (("d2h", d2h), ("h2d", h2d)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(n_gpus):
                with torch.cuda.stream(streams[i]):
                    if direction == "d2h":
                        host[i].copy_(dev[i], non_blocking=True)
                    else:
                        dev[i].copy_(host[i], non_blocking=True)
            for s in streams:
                s.synchronize()
            out.append(time.perf_counter() - start)
    total = per_gpu * n_gpus
    d, h = statistics.median(d2h), statistics.median(h2d)
    print(f"  ceiling, plain pinned copies of {total / MiB:.0f} MiB: device->host {rate(total, d)}, "
          f"host->device {rate(total, h)}")
    print(f"    new path / ceiling: offload {d / new_figures[0]:.2f}, reload {h / new_figures[1]:.2f} "
          "(share of the ceiling's rate)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="8 MiB in 20 tensors, once: the path only")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.tensors, args.repeat = 8, 20, 1
    bench_cpu(args.mib, args.tensors, args.repeat)
    bench_cuda(args.mib, args.tensors, args.repeat)


if __name__ == "__main__":
    main()
