"""Which node a new user server lands on: a JupyterHub ``pre_spawn_hook`` that asks the
gpushare service to rank the nodes (room for the server's kernels, SM load over a window,
the user's share: the rule kernels are placed by) and steers the spawner there.

KubeSpawner (Zero to JupyterHub) is steered with preferred node affinity on the node's name
label: the best nodes that fit and are not contended are preferred (the best most), nodes
without room are avoided. Preferences, not requirements: the Kubernetes scheduler still
decides, and a node the service does not know (no gpushare server there yet: empty) is
neither preferred nor avoided. A spawner that cannot be steered is reported to the service,
whose admin page says so. The spawn never waits on the service for more than ``timeout``
seconds and never fails because of it.

In ``jupyterhub_config.py`` (Zero to JupyterHub: ``hub.extraConfig``)::

    from jupyter_gpushare.hub.spawner_hook import steer
    c.KubeSpawner.pre_spawn_hook = steer

or, from a pre_spawn_hook of your own, ``await steer(spawner)``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

HOSTNAME_LABEL = "kubernetes.io/hostname"
DEFAULT_URL = "http://127.0.0.1:10101/services/gpushare/"
URL_ENV = "JUPYTER_GPUSHARE_HUB_URL"
TIMEOUT = 2.0  # s a spawn waits for the service's ranking at most
PREFER = 3  # nodes preferred, at most
WROTE = "_gpushare_terms"  # the spawner's attribute with the terms this hook wrote last


def affinity_terms(nodes: Sequence[dict[str, Any]], label: str = HOSTNAME_LABEL,
                   prefer: int = PREFER) -> list[dict[str, Any]]:
    """KubeSpawner ``node_affinity_preferred`` terms from the service's ranking (best first):
    the first ``prefer`` nodes that fit, are within the user's share and are not contended,
    weights 100, 80, 60, ...; every node where the server does not fit, one term that avoids
    them (weight 100). Empty when the ranking says nothing useful."""
    terms: list[dict[str, Any]] = []
    good = [n["node"] for n in nodes if n.get("fits") and n.get("within_share", True)
            and not n.get("contended")][:prefer]
    for i, node in enumerate(good):
        terms.append({"weight": 100 - 20 * i, "preference": {"matchExpressions": [
            {"key": label, "operator": "In", "values": [node]}]}})
    bad = [n["node"] for n in nodes if not n.get("fits")]
    if bad:
        terms.append({"weight": 100, "preference": {"matchExpressions": [
            {"key": label, "operator": "NotIn", "values": bad}]}})
    return terms


def steerable(spawner: Any) -> bool:
    """The spawner places servers by node affinity (KubeSpawner and its subclasses)."""
    has_trait = getattr(spawner, "has_trait", None)
    return bool(has_trait and has_trait("node_affinity_preferred"))


def service_url(spawner: Any) -> str:
    env = getattr(spawner, "environment", None) or {}
    url = env.get(URL_ENV) if isinstance(env, dict) else None
    return str(url or os.environ.get(URL_ENV) or DEFAULT_URL)


async def rank(spawner: Any, url: str, gpus: int = 1, memory: int | None = None,
               timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    """The service's ranking of the nodes for ``spawner``'s new server, asked with the
    server's own token (so the user's share counts, and nothing else is revealed)."""
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    body = {"gpus": gpus, "memory": memory, "spawner": type(spawner).__name__,
            "steerable": steerable(spawner)}
    request = HTTPRequest(url.rstrip("/") + "/api/nodes", method="POST", body=json.dumps(body),
                          headers={"Authorization": f"token {spawner.api_token}",
                                   "Content-Type": "application/json"},
                          request_timeout=timeout, connect_timeout=timeout)
    response = await AsyncHTTPClient().fetch(request)
    nodes = json.loads(response.body).get("nodes")
    if not isinstance(nodes, list):
        raise ValueError("the service's answer has no list of nodes")
    return [n for n in nodes if isinstance(n, dict) and isinstance(n.get("node"), str)]


async def steer(spawner: Any, *, gpus: int = 1, memory: int | None = None,
                label: str = HOSTNAME_LABEL, timeout: float = TIMEOUT) -> list[str]:
    """A ``pre_spawn_hook``: rank the nodes for this server and, where the spawner can be
    steered, prefer the best ones and avoid those without room. Returns the ranking (node
    names, best first; [] when the service did not answer: the spawn goes on unsteered)."""
    name = getattr(getattr(spawner, "user", None), "name", "?")
    try:
        nodes = await rank(spawner, service_url(spawner), gpus, memory, timeout)
    except Exception as e:  # never fail a spawn for this: the scheduler places it as before
        log.warning("gpushare: %s's new server: the gpushare service did not rank the nodes (%s); "
                    "placed by the spawner alone", name, e or type(e).__name__)
        return []
    order = [n["node"] for n in nodes]
    if not steerable(spawner):
        log.info("gpushare: %s's new server: %s cannot be steered to a node (best: %s)",
                 name, type(spawner).__name__, order[0] if order else "none known")
        return order
    terms = affinity_terms(nodes, label)
    # a respawn reuses the spawner: replace what this hook wrote last time, keep the admin's
    before = getattr(spawner, WROTE, [])
    kept = [t for t in (spawner.node_affinity_preferred or []) if t not in before]
    spawner.node_affinity_preferred = kept + terms
    setattr(spawner, WROTE, terms)
    log.info("gpushare: %s's new server: nodes ranked %s; preferred %s", name, order,
             [t["preference"]["matchExpressions"][0]["values"] for t in terms])
    return order

