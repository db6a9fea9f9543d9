"""How long a release and a restore take: a fixed overhead plus bytes over a bandwidth.

``seconds = overhead + bytes / bandwidth``, separately for release (GPU -> host) and restore
(host -> GPU), for the bytes on one GPU: a kernel of several GPUs moves each GPU's share over
its own link at once, so it takes the time of one share. Each preset is named after the
release method it models and is a line fitted to published pairs of points:

``driver`` (the default; the ``driver`` release method, CUDA's checkpoint API)
    Measured on an NVIDIA H200 (driver 580.159.04, CUDA 13.0) by this project's GPU proof
    (``benchmarks/gpu/``, bandwidth scenes): one process holding one tensor, released and
    restored by the product's driver method through the in-process API. Released in 0.98 s
    (1 GiB), 5.0 s (8 GiB), 8.9 s (16 GiB), 24.7 s (40 GiB); restored in 0.52, 2.2, 3.2 and
    11.7 s; a JAX pool of 74.6 GiB released in 48.6 s. The line through the 1 and 40 GiB
    points: release 0.37 s + bytes / 1.8 GB/s, restore 0.23 s + bytes / 3.7 GB/s (slower
    than at 8-16 GiB: cautious for mid sizes). A 39 GB restore takes 10.7 s. Pinned copies on
    the same machine ran at 54 GB/s: the driver's copy, not the bus, sets it.
``driver-published``
    The line through an H100 tool's two published cuda-checkpoint points: a 0.5B-parameter
    model (1.4 GB) thawed in 427 ms and frozen in 609 ms, a 1.5B one (3.6 GB) thawed in
    832 ms and frozen in 1,319 ms. Restore: 0.17 s + bytes / 5.4 GB/s; release: 0.16 s +
    bytes / 3.1 GB/s: faster than what the driver method measured here (the former default).
``pinned`` (the ``framework`` release method at its best)
    Copies at the pinned host<->device limit of PCIe Gen5 x16 (about 57 GB/s measured on an
    H100 with the copy engines), with no fixed cost: what moving tensors to pinned host
    buffers can reach, and no method has been measured to do better. An upper bound.
``h100`` (the former default, kept to compare)
    One of the points above per direction, with the copy at 57 GB/s and the rest of each
    figure counted as fixed overhead (0.584 s release, 0.402 s restore): right for a 1.4 GB
    state, far too fast for big ones (a 39 GB restore in 1.1 s instead of 7.3 s).
``sim``
    This project's own simulated release/restore (``benchmarks/sim_release_restore.py``,
    figures in benchmarks/README.md: 1 GiB restored in 0.18 s and 12 GiB in 3.02 s, released
    in 0.36 s and 3.32 s), fitted as a line through those two points (the restore line's
    overhead comes out at -0.08 s and is taken as 0): a host-memory copy, about 4 GB/s.

Any other pair of numbers: ``--restore-overhead``, ``--restore-bandwidth`` and the release
ones on the command line.

``incremental``: whether the method keeps its host copy after a restore and so copies at
release only what changed since (the framework and simulated methods: ``pinned``, ``sim``);
the driver's checkpoint copies everything by its nature (``driver``, ``h100``).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class TransferModel:
    name: str
    release_overhead: float  # s
    release_bandwidth: float  # bytes/s
    restore_overhead: float  # s
    restore_bandwidth: float  # bytes/s
    incremental: bool = False  # a release copies only what changed since the host copy

    def release_seconds(self, nbytes: int) -> float:
        return self.release_overhead + nbytes / self.release_bandwidth

    def restore_seconds(self, nbytes: int) -> float:
        return self.restore_overhead + nbytes / self.restore_bandwidth

    def describe(self) -> str:
        return (f"transfer model {self.name}: restore {self.restore_overhead:.3f} s + bytes / "
                f"{self.restore_bandwidth / GB:.1f} GB/s, release {self.release_overhead:.3f} s"
                f" + bytes / {self.release_bandwidth / GB:.1f} GB/s"
                + (", a release copies what changed since its host copy" if self.incremental
                   else ", a release copies everything"))


def _line(size_a: int, secs_a: float, size_b: int, secs_b: float) -> tuple[float, float]:
    """(overhead, bandwidth) of the line through two (bytes, seconds) measurements."""
    per_byte = (secs_b - secs_a) / (size_b - size_a)
    return max(0.0, secs_a - size_a * per_byte), 1.0 / per_byte


_PCIE_GEN5_PINNED = 57 * GB
_ANCHOR_BYTES = 1.4 * GB
_driver_release = _line(1 * GiB, 0.977, 40 * GiB, 24.706)  # measured: H200, driver 580
_driver_restore = _line(1 * GiB, 0.517, 40 * GiB, 11.746)
_published_release = _line(int(1.4 * GB), 0.609, int(3.6 * GB), 1.319)
_published_restore = _line(int(1.4 * GB), 0.427, int(3.6 * GB), 0.832)
_sim_release = _line(1 * GiB, 0.36, 12 * GiB, 3.32)
_sim_restore = _line(1 * GiB, 0.18, 12 * GiB, 3.02)

PRESETS: dict[str, TransferModel] = {
    "driver": TransferModel("driver", _driver_release[0], _driver_release[1], _driver_restore[0],
                            _driver_restore[1]),
    "driver-published": TransferModel("driver-published", _published_release[0],
                                      _published_release[1], _published_restore[0],
                                      _published_restore[1]),
    "pinned": TransferModel("pinned", 0.0, _PCIE_GEN5_PINNED, 0.0, _PCIE_GEN5_PINNED,
                            incremental=True),
    "h100": TransferModel(
        "h100",
        release_overhead=0.609 - _ANCHOR_BYTES / _PCIE_GEN5_PINNED,
        release_bandwidth=_PCIE_GEN5_PINNED,
        restore_overhead=0.427 - _ANCHOR_BYTES / _PCIE_GEN5_PINNED,
        restore_bandwidth=_PCIE_GEN5_PINNED,
    ),
    "sim": TransferModel("sim", _sim_release[0], _sim_release[1], _sim_restore[0], _sim_restore[1],
                         incremental=True),
}
