# jupyter-gpushare for a JupyterHub on one machine (TLJH, SystemdSpawner, DockerSpawner, ...).
#
# This file ships in the package; load it from jupyterhub_config.py with
#     from jupyter_gpushare.hub import SNIPPET
#     load_subconfig(SNIPPET)
# or copy its lines there. It adds:
# - the gpushare service (python -m jupyter_gpushare.hub), managed by the Hub, with a role
#   that has only the scopes it needs;
# - the right to call the gpushare service for users and their servers (a server's token
#   holds only what its user holds): a restore that waits tells the service at once, and
#   each person's panel shows their share;
# - the service's address in every server's environment.
# The single-user servers need jupyter-gpushare installed (it enables itself); the service
# runs in the Hub's environment, which needs it too (pip install jupyter-gpushare).
import os
import sys

c = get_config()  # type: ignore[name-defined]  # noqa: F821 (JupyterHub defines it)

# Where the service listens (a port free on this machine), and where it reaches the users'
# servers: the proxy's address (JupyterHub's bind_url; default http://127.0.0.1:8000).
GPUSHARE_PORT = int(os.environ.get("JUPYTER_GPUSHARE_SERVICE_PORT", "10101"))
PROXY_URL = os.environ.get("JUPYTER_GPUSHARE_PROXY_URL", "http://127.0.0.1:8000")

# The service measures the node itself (NVML; a shared simulated node where the Hub's
# environment names one) and checks what each server reports against it.
GPUSHARE_ENV = {"JUPYTER_GPUSHARE_PROXY_URL": PROXY_URL}
if os.environ.get("JUPYTER_GPUSHARE_SIMULATED_NODE"):
    GPUSHARE_ENV["JUPYTER_GPUSHARE_SIMULATED_NODE"] = os.environ["JUPYTER_GPUSHARE_SIMULATED_NODE"]

c.JupyterHub.services.append({
    "name": "gpushare",
    "command": [sys.executable, "-m", "jupyter_gpushare.hub"],
    "url": f"http://127.0.0.1:{GPUSHARE_PORT}",
    "environment": GPUSHARE_ENV,
    # the admin page logs in through the Hub (OAuth) and lets admins only in
    "oauth_no_confirm": True,
    "display": True,
})

c.JupyterHub.load_roles.extend([
    {
        "name": "gpushare",
        "description": "The gpushare service: see every server's GPU memory, release idle kernels",
        "scopes": [
            "list:users",  # which users there are
            "read:users:groups",  # their groups, for group shares
            "read:servers",  # which servers run, and where
            # call the servers' /api/gpushare (to limit it: "access:servers!group=gpu")
            "access:servers",
        ],
        "services": ["gpushare"],
    },
    {
        # JupyterHub's default "user" role, plus calling the gpushare service (which shows
        # them only their own share and usage; its admin page is for admins only)
        "name": "user",
        "scopes": ["self", "access:services!service=gpushare"],
    },
    {
        # JupyterHub's default "server" role, plus calling the gpushare service
        "name": "server",
        "scopes": [
            "users:activity!user",
            "access:servers!server",
            "access:services!service=gpushare",
        ],
    },
])

c.Spawner.environment.update({
    "JUPYTER_GPUSHARE_HUB_URL": f"http://127.0.0.1:{GPUSHARE_PORT}/services/gpushare/",
})

# The service's options (see docs/hub.md) go in gpushare_hub_config.py in the Hub's working
# directory, e.g.:
#   c.GPUShareHub.shares = {"group:research": "40GiB per node", "*": "8GiB"}
#   c.GPUShareHub.pressure_idle_timeout = 300
