"""Prometheus metrics of the hub service: the node-wide aggregate, ``gpushare_hub_*``.

In their own registry (served at the service's ``/metrics``), so they never mix with a
single-user server's ``gpushare_*`` metrics in the same process (tests run both)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class HubMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        gpu = ["uuid", "node"]
        self.memory_total = Gauge("gpushare_hub_gpu_memory_total_bytes", "GPU memory", gpu, registry=r)
        self.memory_used = Gauge("gpushare_hub_gpu_memory_used_bytes",
                                 "GPU memory in use by every process", gpu, registry=r)
        self.held = Gauge("gpushare_hub_gpu_held_bytes",
                          "GPU memory held by the users' kernels (allocation)", gpu, registry=r)
        self.released = Gauge("gpushare_hub_gpu_released_bytes",
                              "GPU state of released kernels, held in host memory", gpu, registry=r)
        self.utilization = Gauge("gpushare_hub_gpu_utilization_percent", "SM busy, last sample",
                                 gpu, registry=r)
        self.reclaimed = Counter("gpushare_hub_reclaimed_gpu_hours",
                                 "GPU-hours given back: released bytes / GPU memory, integrated "
                                 "over time", gpu, registry=r)
        self.user_memory = Gauge("gpushare_hub_user_memory_bytes",
                                 "GPU memory each person's kernels hold, all GPUs", ["user"], registry=r)
        self.user_over = Gauge("gpushare_hub_user_over_share",
                               "1 when the person holds more than their share", ["user"], registry=r)
        self.user_over_cap = Gauge("gpushare_hub_user_kernels_over_cap",
                                   "Kernels of the person the node sees hold more than their "
                                   "memory cap", ["user"], registry=r)
        self.waiting = Gauge("gpushare_hub_waiting_restores", "Restores waiting for GPU memory now",
                             registry=r)
        self.waits = Counter("gpushare_hub_waits", "Restores seen waiting for GPU memory", registry=r)
        self.releases = Counter("gpushare_hub_releases",
                                "Releases of one person's kernel to make room for another's restore",
                                ["outcome"], registry=r)
        self.released_bytes = Counter("gpushare_hub_released_bytes",
                                      "Bytes released to make room for other people's restores",
                                      registry=r)
        self.room_seconds = Histogram(
            "gpushare_hub_room_seconds",
            "From a restore's wait reaching the service to the other user's release done",
            ["trigger"], registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.restores = Counter("gpushare_hub_restores", "Restores done on the users' servers",
                                registry=r)
        self.restore_seconds = Histogram(
            "gpushare_hub_restore_seconds", "Duration of the users' restores", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.claims = Counter("gpushare_hub_claims",
                              "Waiting restores claimed by servers and not believed (refused: not "
                              "backed by that user's processes; unused: room made, not used)",
                              ["outcome"], registry=r)
        self.checked = Gauge("gpushare_hub_gpu_checked",
                             "1 when servers' claims on the GPU are checked against a measurement "
                             "(the service's own, or its node daemon's); 0: the weaker mode, the "
                             "servers' word bounded by shares", gpu, registry=r)
        self.servers = Gauge("gpushare_hub_servers", "User servers the service tracks", ["state"],
                             registry=r)
        self.poll_seconds = Histogram("gpushare_hub_poll_seconds",
                                      "One round of discovery and status reads", registry=r,
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
