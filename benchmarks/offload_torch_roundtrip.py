"""Round-trip time of the PyTorch offload adapter, against a plain copy of the same bytes.

CPU part (always): a 1 GiB state of 10,000 tensors, offloaded and reloaded through the
adapter's in-place move logic between two CPU storages (the path CI tests), next to a
baseline measured in the same run: clone every tensor, then copy it back (the same two
memory copies with no bookkeeping). The ratio is the adapter's overhead.

CUDA part (when a GPU is there): an MLP whose parameters, gradients and Adam state take
about 1 GiB, offloaded to pinned host memory and reloaded by the default adapter; bytes
freed per ``torch.cuda.mem_get_info`` and whether the state came back bitwise.

Usage: python benchmarks/offload_torch_roundtrip.py [--tensors 10000] [--gib 1] [--repeat 3]
       [--smoke]  (100 tensors, 16 MiB, once: the whole path, no figures worth reading)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter

GIB = 1 << 30


def cpu_adapter() -> tuple[TorchAdapter, set[int]]:
    """The adapter with "device" = storages registered in a set (as in the tests)."""
    device: set[int] = set()

    def to_host(storage):
        host = torch.UntypedStorage(storage.nbytes())
        host.copy_(storage)
        device.discard(host._cdata)
        return host

    def to_device(host, _where):
        new = torch.UntypedStorage(host.nbytes())
        new.copy_(host)
        device.add(new._cdata)
        return new

    adapter = TorchAdapter(
        is_device=lambda t: t.untyped_storage()._cdata in device,
        to_host=to_host,
        to_device=to_device,
        synchronize=lambda: None,
    )
    return adapter, device


def bench_cpu(n_tensors: int, total_bytes: int, repeat: int) -> None:
    numel = total_bytes // n_tensors // 4
    state = {f"t{i}": torch.randn(numel) for i in range(n_tensors)}
    adapter, device = cpu_adapter()
    device.update(t.untyped_storage()._cdata for t in state.values())
    namespace = {"state": state}
    moved = numel * 4 * n_tensors
    print(f"CPU: {n_tensors} tensors, {moved / GIB:.3f} GiB, {torch.get_num_threads()} threads")

    adapter_times, baseline_times = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        off = adapter.offload(namespace)
        back = adapter.reload()
        adapter_times.append(time.perf_counter() - start)
        assert off.count == back.count == n_tensors and off.bytes == moved

        tensors = list(state.values())
        start = time.perf_counter()
        copies = [t.clone() for t in tensors]
        for tensor, copy in zip(tensors, copies, strict=True):
            tensor.copy_(copy)
        baseline_times.append(time.perf_counter() - start)
        del copies, tensors

    a, b = statistics.median(adapter_times), statistics.median(baseline_times)
    print(
        f"  adapter offload+reload: {a:.3f} s median of {repeat} (offload {off.seconds:.3f} s, reload {back.seconds:.3f} s)"
    )
    print(f"  baseline clone+copy back: {b:.3f} s median of {repeat}")
    print(f"  ratio adapter/baseline: {a / b:.2f}")


def bench_cuda(total_bytes: int) -> None:
    if not torch.cuda.is_available():
        print("CUDA: not available, skipped")
        return
    torch.manual_seed(0)
    # parameters + gradients + Adam's two moments = 4 x parameters
    width = int((total_bytes / 4 / 4 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(64, width, device="cuda")).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    checksum = [p.detach().clone().cpu() for p in model.parameters()]
    namespace = {"model": model, "opt": opt}
    adapter = TorchAdapter()

    free_before, total = torch.cuda.mem_get_info()
    off = adapter.offload(namespace)
    free_offloaded, _ = torch.cuda.mem_get_info()
    back = adapter.reload()
    same = all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), checksum, strict=True))
    print(f"CUDA: {torch.cuda.get_device_name()}, MLP width {width}, {off.count} tensors")
    print(f"  moved {off.bytes / GIB:.3f} GiB; skipped: {off.skipped or 'none'}")
    print(
        f"  offload {off.seconds:.3f} s ({off.bytes / off.seconds / 1e9:.1f} GB/s), reload {back.seconds:.3f} s ({back.bytes / back.seconds / 1e9:.1f} GB/s)"
    )
    print(
        f"  freed per mem_get_info: {(free_offloaded - free_before) / GIB:.3f} GiB of {total / GIB:.1f} GiB (allocator said {off.freed_bytes / GIB:.3f} GiB)"
    )
    print(f"  state bitwise identical after reload: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="100 tensors, 16 MiB, once")
    args = parser.parse_args()
    if args.smoke:
        args.tensors, args.gib, args.repeat = 100, 1 / 64, 1
    bench_cpu(args.tensors, int(args.gib * GIB), args.repeat)
    bench_cuda(int(args.gib * GIB))


if __name__ == "__main__":
    main()
