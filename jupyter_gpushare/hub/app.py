"""``python -m jupyter_gpushare.hub``: the JupyterHub service that coordinates every user's
server on shared GPUs (fair shares, cross-user make-room, an admin view).

Run it as a hub-managed service (``c.JupyterHub.services``) with a role of its own: it
reads its token, the Hub API URL and its prefix from the environment the Hub gives it.
Options as ``c.GPUShareHub.NAME`` in ``gpushare_hub_config.py`` (or on the command line,
``--GPUShareHub.NAME=VALUE``); see docs/hub.md.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import signal
from typing import Any
from urllib.parse import urlparse

from tornado import web
from traitlets import Bool, Dict, Enum, Float, Int, TraitError, Unicode, Union, default, validate
from traitlets.config import Application

from ..node.measure import BACKENDS, open_meter
from ..policy.fairshare import parse_caps, parse_table
from .coordinator import Coordinator, Settings, hub_policy
from .daemons import NodeDaemons
from .hubapi import HubAPI
from .web import routes


class GPUShareHub(Application):
    """Coordinates the GPU memory of every user's server of a JupyterHub."""

    name = "gpushare-hub"
    description = __doc__

    config_file = Unicode(
        "gpushare_hub_config.py",
        help="""Config file to load (Python, c.GPUShareHub.NAME = ...), looked up in the working
        directory. Default "gpushare_hub_config.py"; a missing file is fine.""",
    ).tag(config=True)

    api_url = Unicode(
        help="""The Hub's REST API, e.g. http://127.0.0.1:8081/hub/api. Default: the environment
        variable JUPYTERHUB_API_URL (set by the Hub for the services it manages).""",
    ).tag(config=True)

    @default("api_url")
    def _default_api_url(self) -> str:
        return os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")

    api_token = Unicode(
        help="""The service's token. Default: the environment variable JUPYTERHUB_API_TOKEN (set
        by the Hub). Its role needs list:users, read:users:groups, read:servers and
        access:servers (see docs/hub.md); nothing more.""",
    ).tag(config=True)

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    proxy_url = Unicode(
        help="""Where user servers are reached (the proxy: /user/NAME/... under it), e.g.
        http://127.0.0.1:8000, or http://proxy-public in Zero to JupyterHub. Default: the
        environment variable JUPYTER_GPUSHARE_PROXY_URL, else http://127.0.0.1:8000
        (JupyterHub's default bind_url).""",
    ).tag(config=True)

    @default("proxy_url")
    def _default_proxy_url(self) -> str:
        return os.environ.get("JUPYTER_GPUSHARE_PROXY_URL", "http://127.0.0.1:8000")

    service_url = Unicode(
        help="""Where this service listens, e.g. http://127.0.0.1:10101. Default: the
        environment variable JUPYTERHUB_SERVICE_URL (the service's url in the Hub's config),
        else http://127.0.0.1:10101.""",
    ).tag(config=True)

    @default("service_url")
    def _default_service_url(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101")

    listen_ip = Unicode(
        help="""The address to listen on. Default: the host of service_url when it is an IP
        address or localhost, else "" = all interfaces (a name such as "hub" in Kubernetes is
        the pod's service, reached from other pods).""",
    ).tag(config=True)

    @default("listen_ip")
    def _default_listen_ip(self) -> str:
        host = urlparse(self.service_url).hostname or ""
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            return host if host == "localhost" else ""

    prefix = Unicode(
        help="""The service's URL prefix on the Hub. Default: the environment variable
        JUPYTERHUB_SERVICE_PREFIX, else /services/gpushare/.""",
    ).tag(config=True)

    @default("prefix")
    def _default_prefix(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpushare/")

    poll_interval = Float(
        10.0,
        help="""Seconds between two rounds of reading every user server's status. Default 10.
        Must be > 0. Restores that wait are pushed by their servers at once; this poll is the
        fallback, and feeds the admin page and the metrics.""",
    ).tag(config=True)

    pressure_idle_timeout = Float(
        120.0,
        help="""Seconds another person's kernel must have been idle before it may be released
        to make room for a waiting restore. Default 120. 0 = any idle kernel (never a busy or
        GPU-active one) may be taken at once.""",
    ).tag(config=True)

    over_share_idle_timeout = Float(
        30.0,
        help="""The same for a kernel whose owner holds more than their share: shorter, so
        people over their share give memory back first. Default 30 s. 0 = at once. Used only
        when shares are set.""",
    ).tag(config=True)

    idle_utilization = Float(
        5.0,
        help="""SM utilization (percent, 0-100) above which a kernel counts as working and is
        never released for someone else. Default 5.""",
    ).tag(config=True)

    min_release_bytes = Int(
        256 << 20,
        help="""Kernels holding less GPU memory than this (bytes) are not released for others:
        not worth the pause. Default 256 MiB. 0 = any.""",
    ).tag(config=True)

    shares = Dict(
        help="""Guaranteed GPU memory, by user ("alice"), group ("group:NAME") or everyone else
        ("*"): bytes (an int, or "8GiB", "512MiB"), or a percentage of a GPU ("25%"), per GPU
        unless followed by "per node". Default {} = no shares: everyone is treated alike.
        Someone without an entry (and no "*") is guaranteed nothing. Example:
        {"group:research": "40GiB per node", "alice": "16GiB", "*": "4GiB"}.""",
    ).tag(config=True)

    caps = Dict(
        help="""The most GPU memory one kernel may hold per GPU, by user ("alice"), group
        ("group:NAME") or everyone else ("*"), keyed as shares: bytes (an int, or "8GiB",
        "512MiB"; no percentages). A user's cap is their own entry, else the most generous
        of their groups', else "*". Their servers apply it to each new kernel (through the
        kernel's frameworks where they can be limited; the server flags a kernel over it);
        a kernel may lower it, not raise it. Default {} = no caps. Example:
        {"group:students": "8GiB", "*": "40GiB"}.""",
    ).tag(config=True)

    @validate("caps")
    def _check_caps(self, proposal: Any) -> dict:
        try:
            parse_caps(proposal["value"])
        except ValueError as e:
            raise TraitError(f"GPUShareHub.caps: {e}") from None
        return proposal["value"]

    @validate("shares")
    def _check_shares(self, proposal: Any) -> dict:
        try:
            parse_table(proposal["value"])
        except ValueError as e:
            raise TraitError(f"GPUShareHub.shares: {e}") from None
        return proposal["value"]

    concurrency = Int(
        10,
        help="""Requests to user servers and the Hub in flight at once. Default 10. Must be >= 1.""",
    ).tag(config=True)

    request_timeout = Float(
        10.0,
        help="""Seconds one request to a user server or the Hub may take. Default 10. Must be > 0.""",
    ).tag(config=True)

    metrics_public = Bool(
        False,
        help="""Serve /metrics to anyone who can reach the service, without a token (an
        in-cluster Prometheus). Default False: an admin, or a token with read:metrics. The
        metrics name users.""",
    ).tag(config=True)

    read_deadline = Float(
        1.0,
        help="""Seconds room for someone's restore waits for the fresh status of other users'
        servers. A server that answers later, or was slower than this the last time, is judged
        by its last status, and its kernels are released only when no prompt server's can make
        the room: one slow server slows only its own users. Default 1. Must be > 0.""",
    ).tag(config=True)

    backend = Enum(
        list(BACKENDS), "auto",
        help="""What the service measures the node with, to check what servers claim: "nvml"
        (the service runs on the GPU node), "simulated" (the shared simulated node in
        simulated_node), "off" (the hub runs elsewhere: servers' numbers are taken as they
        are, bounded by shares and what unused claims cost). Default "auto": the simulated node
        when simulated_node is set, else NVML when it sees a GPU, else off.""",
    ).tag(config=True)

    simulated_node = Unicode(
        help="""The shared simulated node's file, as the users' servers have it. Default: the
        environment variable JUPYTER_GPUSHARE_SIMULATED_NODE, else "" (none).""",
    ).tag(config=True)

    @default("simulated_node")
    def _default_simulated_node(self) -> str:
        return os.environ.get("JUPYTER_GPUSHARE_SIMULATED_NODE", "")

    unix_user = Unicode(
        "{username}",
        help="""The OS account a user's kernels run as, {username} being the Hub's name: a
        process of such an account belongs to that user. Default "{username}" (LocalProcessSpawner); "jupyter-{username}" for The Littlest JupyterHub and SystemdSpawner
        with dynamic users. A process of any other account (every server as one account) is
        told apart by the JUPYTERHUB_USER the Hub put in its environment.""",
    ).tag(config=True)

    context_bytes = Int(
        None, allow_none=True,
        help="""Bytes of a waiting restore's need that may be missing from its kernel's host
        memory (a CUDA context: a release frees it, a restore builds it again). Default None:
        768 MiB with NVML, 0 on the simulated node.""",
    ).tag(config=True)

    claim_grace = Float(
        120.0,
        help="""Seconds a restore that got room made from other people's kernels has to land on
        the GPU. Default 120. Must be > 0. One that does not is an unused claim: see
        claim_penalty.""",
    ).tag(config=True)

    claim_penalty = Float(
        600.0,
        help="""Seconds no room is made from other people's kernels for a user whose claimed
        restore got room and did not use it; doubled for each further one within an hour (at
        most an hour). Default 600. 0 = no pause.""",
    ).tag(config=True)

    load_window = Float(
        120.0,
        help="""Seconds of SM history a GPU's load is the mean of when new servers' nodes are
        ranked and servers place kernels (with the service's view). Default 120. 0 = the last
        reading alone. The history has one reading per poll_interval.""",
    ).tag(config=True)

    server_memory = Int(
        1 << 30,
        help="""Bytes a new server's kernel is expected to need on each of its GPUs when its
        node is chosen (a node qualifies when a GPU there has this much room; among those, the
        least loaded wins). Default 1 GiB. 0 = any node qualifies and load alone decides. A
        spawner hook may ask for more (its request's "memory").""",
    ).tag(config=True)

    node_daemons = Union(
        [Unicode(), Dict(value_trait=Unicode())], default_value="",
        help="""Where the node daemons listen for this service (their --listen), to check
        servers' claims on the GPUs this service does not measure itself (a hub that runs off
        the GPU nodes, as in Zero to JupyterHub): "HOST:PORT" with {node} for the node's name
        as its servers give it (e.g. "{node}:10102"), or a dict of node name -> "HOST:PORT"
        ("*": the template for the others). Default "" = none: claims on GPUs the service does
        not measure are taken as they are, bounded by shares.""",
    ).tag(config=True)

    node_daemon_secret_file = Unicode(
        "",
        help="""The file holding the secret this service and the node daemons share (their
        --secret-file; at least 16 bytes; a file others cannot read, mode 0400 or 0440, e.g. a
        mounted Kubernetes Secret). Default "" = none (no daemon is asked).""",
    ).tag(config=True)

    node_daemon_timeout = Float(
        1.0,
        help="""Seconds a node daemon has to answer one check (connect, proofs, measure). A
        daemon that does not answer in time leaves its GPUs in the weaker mode until it answers
        again. Default 1. Must be > 0.""",
    ).tag(config=True)

    @validate("poll_interval", "request_timeout", "read_deadline", "claim_grace", "node_daemon_timeout")
    def _check_positive(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise TraitError(f"GPUShareHub.{proposal['trait'].name} must be > 0")
        return proposal["value"]

    @validate("pressure_idle_timeout", "over_share_idle_timeout", "min_release_bytes", "claim_penalty",
              "load_window", "server_memory")
    def _check_non_negative(self, proposal: Any) -> Any:
        if proposal["value"] < 0:
            raise TraitError(f"GPUShareHub.{proposal['trait'].name} must be >= 0")
        return proposal["value"]

    @validate("context_bytes")
    def _check_context(self, proposal: Any) -> Any:
        if proposal["value"] is not None and proposal["value"] < 0:
            raise TraitError("GPUShareHub.context_bytes must be >= 0 (or None)")
        return proposal["value"]

    @validate("idle_utilization")
    def _check_percent(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] <= 100:
            raise TraitError("GPUShareHub.idle_utilization is a percentage (0-100)")
        return proposal["value"]

    @validate("concurrency")
    def _check_concurrency(self, proposal: Any) -> int:
        if proposal["value"] < 1:
            raise TraitError("GPUShareHub.concurrency must be >= 1")
        return proposal["value"]

    # -- running ---------------------------------------------------------------------------
    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        if self.config_file and os.path.exists(self.config_file):
            self.load_config_file(self.config_file)
        logging.getLogger("jupyter_gpushare").setLevel(self.log.getEffectiveLevel())
        if not logging.getLogger("jupyter_gpushare").handlers:
            logging.getLogger("jupyter_gpushare").handlers = list(self.log.handlers)

    def make_coordinator(self) -> Coordinator:
        api = HubAPI(self.api_url, self.proxy_url, self.api_token, self.request_timeout, self.concurrency)
        settings = Settings(
            shares=parse_table(self.shares),
            caps=parse_caps(self.caps),
            policy=hub_policy(self.pressure_idle_timeout, self.over_share_idle_timeout,
                              self.idle_utilization, self.min_release_bytes),
            admin_url=self.prefix,
            read_deadline=self.read_deadline,
            claim_grace=self.claim_grace,
            claim_penalty=self.claim_penalty,
            load_window=self.load_window,
            server_memory=self.server_memory,
        )
        meter, measuring = open_meter(self.backend, self.simulated_node, self.unix_user, self.context_bytes)
        (self.log.info if meter is not None else self.log.warning)(
            "gpushare hub: %s", f"measuring the node with {measuring}" if meter is not None else
            f"not measuring the node: {measuring}; servers' claims are checked only against shares")
        daemons = None
        if self.node_daemons or self.node_daemon_secret_file:
            daemons = NodeDaemons(self.node_daemons, self.node_daemon_secret_file, self.node_daemon_timeout)
            (self.log.warning if daemons.off else self.log.info)(
                "gpushare hub: %s", f"node daemons not asked: {daemons.off}" if daemons.off else
                f"the GPUs it does not measure are checked with their node daemons at {self.node_daemons}")
        return Coordinator(api, settings, poll_interval=self.poll_interval, meter=meter,
                           measuring=measuring, daemons=daemons)

    def make_web_app(self, coordinator: Coordinator) -> web.Application:
        from jupyterhub.services.auth import HubOAuth

        hub_auth = HubOAuth(api_token=self.api_token, api_url=self.api_url, cache_max_age=60)
        return web.Application(
            routes(self.prefix, coordinator, hub_auth, {"metrics_public": self.metrics_public}),
            cookie_secret=secrets.token_bytes(32), xsrf_cookies=True, login_url=hub_auth.login_url,
        )

    async def serve(self) -> None:
        coordinator = self.make_coordinator()
        app = self.make_web_app(coordinator)
        port = urlparse(self.service_url).port or 10101
        app.listen(port, self.listen_ip)
        self.log.info("gpushare hub service on %s:%d%s (Hub API %s, servers through %s)",
                      self.listen_ip or "*", port, self.prefix, self.api_url, self.proxy_url)
        while True:
            try:
                await coordinator.poll_once()
            except Exception:  # one bad round must not stop the service
                self.log.exception("gpushare hub: poll failed")
            await asyncio.sleep(self.poll_interval)

    def start(self) -> None:
        if not self.api_token:
            self.exit("gpushare hub: no token (JUPYTERHUB_API_TOKEN): run it as a JupyterHub service")
        loop = asyncio.new_event_loop()
        task = loop.create_task(self.serve())
        for sig in (signal.SIGTERM, signal.SIGINT):  # the Hub stops its services with SIGTERM
            loop.add_signal_handler(sig, task.cancel)
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            self.log.info("gpushare hub service stopped")
        finally:
            loop.close()


def main(argv: list[str] | None = None) -> None:
    app = GPUShareHub.instance()
    app.initialize(argv)
    app.start()
