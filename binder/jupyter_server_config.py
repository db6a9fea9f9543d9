"""Jupyter server config for the Binder demo: jupyter-gpushare on a simulated GPU node.

binder/postBuild copies this file to the user's Jupyter config directory. Binder sessions
have no GPU and about 2 GB of RAM; simulated arrays keep their bytes in the kernel process,
so the node is small. Options as in docs/configuration.md.
"""

c = get_config()  # noqa: F821

# Two simulated GPUs of 1 GiB each: enough to show two notebooks competing for memory.
c.GPUShareApp.backend = "simulated"
c.GPUShareApp.simulated_gpus = [1 << 30, 1 << 30]

# Demo-friendly timing (as `jupyter gpushare demo`): release after 2 minutes idle, take
# kernels idle for 30 s under memory pressure or to make room, sample every second.
c.GPUShareApp.idle_timeout = 120
c.GPUShareApp.release_policy = "proactive"  # show releases within minutes, needed or not
c.GPUShareApp.pressure_idle_timeout = 30
c.GPUShareApp.min_release_bytes = 0
c.GPUShareApp.poll_interval = 1.0

# Open the demo notebook (written by binder/postBuild) when no other URL is asked for:
# `jupyter lab` uses LabApp's default URL, a plain server ServerApp's.
DEMO_URL = "/lab/tree/gpushare-demo/gpushare-demo.ipynb"
c.LabApp.default_url = DEMO_URL
c.ServerApp.default_url = DEMO_URL
