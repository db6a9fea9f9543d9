"""How long a release and a restore take: a fixed overhead plus bytes over a bandwidth.

``seconds = overhead + bytes / bandwidth``, separately for release (GPU -> host) and restore
(host -> GPU). The presets and where their numbers come from:

``h100``
    A published anchor: an H100 tool built on cuda-checkpoint froze a 1.4 GB model in
    609 ms and thawed it in 427 ms, and pinned host<->device copies over PCIe Gen5 measure
    about 57 GB/s. One point per direction cannot separate the two terms, so the copy is
    taken at 57 GB/s and the rest of each figure is counted as fixed overhead
    (1.4 GB / 57 GB/s = 25 ms: 0.584 s release, 0.402 s restore). This is pessimistic for
    small states and optimistic for big ones (large transfers rarely reach the pinned peak).
``sim``
    This project's own simulated release/restore (``benchmarks/sim_release_restore.py``,
    figures in benchmarks/README.md: 1 GiB restored in 0.18 s and 12 GiB in 3.02 s, released
    in 0.36 s and 3.32 s), fitted as a line through those two points (the restore line's
    overhead comes out at -0.08 s and is taken as 0): a host-memory copy, about 4 GB/s, so
    an upper bound for what a GPU would take.

Any other pair of numbers: ``--restore-overhead``, ``--restore-bandwidth`` and the release
ones on the command line.
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

    def release_seconds(self, nbytes: int) -> float:
        return self.release_overhead + nbytes / self.release_bandwidth

    def restore_seconds(self, nbytes: int) -> float:
        return self.restore_overhead + nbytes / self.restore_bandwidth

    def describe(self) -> str:
        return (f"{self.name}: restore {self.restore_overhead:.3f} s + bytes / "
                f"{self.restore_bandwidth / GB:.1f} GB/s, release {self.release_overhead:.3f} s"
                f" + bytes / {self.release_bandwidth / GB:.1f} GB/s")


def _line(size_a: int, secs_a: float, size_b: int, secs_b: float) -> tuple[float, float]:
    """(overhead, bandwidth) of the line through two (bytes, seconds) measurements."""
    per_byte = (secs_b - secs_a) / (size_b - size_a)
    return max(0.0, secs_a - size_a * per_byte), 1.0 / per_byte


_PCIE_GEN5_PINNED = 57 * GB
_ANCHOR_BYTES = 1.4 * GB
_sim_release = _line(1 * GiB, 0.36, 12 * GiB, 3.32)
_sim_restore = _line(1 * GiB, 0.18, 12 * GiB, 3.02)

PRESETS: dict[str, TransferModel] = {
    "h100": TransferModel(
        "h100",
        release_overhead=0.609 - _ANCHOR_BYTES / _PCIE_GEN5_PINNED,
        release_bandwidth=_PCIE_GEN5_PINNED,
        restore_overhead=0.427 - _ANCHOR_BYTES / _PCIE_GEN5_PINNED,
        restore_bandwidth=_PCIE_GEN5_PINNED,
    ),
    "sim": TransferModel("sim", _sim_release[0], _sim_release[1], _sim_restore[0], _sim_restore[1]),
}
