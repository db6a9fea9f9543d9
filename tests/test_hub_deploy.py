"""The deployment files agree with the shipped snippet and the service's metrics: the Zero to
JupyterHub values give the same service, roles and scopes as the one-machine snippet (which
the hub tests load as it is), the node daemon's DaemonSet and the values agree on its port,
secret and network policy, and every metric the Grafana dashboard queries exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from traitlets.config import Config

from jupyter_gpushare.hub import SNIPPET
from jupyter_gpushare.hub.metrics import HubMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy"


def snippet_config() -> Config:
    c = Config()
    exec(compile(Path(SNIPPET).read_text(), SNIPPET, "exec"), {"get_config": lambda: c})
    return c


def test_the_snippet_adds_the_service_with_the_least_scopes():
    c = snippet_config()
    (service,) = c.JupyterHub.services.get_value([])
    assert service["name"] == "gpushare" and service["command"][1:] == ["-m", "jupyter_gpushare.hub"]
    roles = {r["name"]: r for r in c.JupyterHub.load_roles.get_value([])}
    assert roles["gpushare"]["scopes"] == ["list:users", "read:users:groups", "read:servers", "access:servers"]
    assert roles["gpushare"]["services"] == ["gpushare"]
    assert "access:services!service=gpushare" in roles["server"]["scopes"]
    assert roles["user"]["scopes"] == ["self", "access:services!service=gpushare"]
    env = c.Spawner.environment.get_value({})
    assert env["JUPYTER_GPUSHARE_HUB_URL"] == "http://127.0.0.1:10101/services/gpushare/"


def test_the_helm_values_match_the_snippet():
    values = yaml.safe_load((DEPLOY / "z2jh-values.yaml").read_text())
    c = snippet_config()
    roles = {r["name"]: r for r in c.JupyterHub.load_roles.get_value([])}
    for name, role in values["hub"]["loadRoles"].items():
        assert role["scopes"] == roles[name]["scopes"], name
    service = values["hub"]["services"]["gpushare"]
    assert service["command"][1:] == ["-m", "jupyter_gpushare.hub"]
    port = service["url"].rsplit(":", 1)[1]
    assert values["singleuser"]["extraEnv"]["JUPYTER_GPUSHARE_HUB_URL"] == f"http://hub:{port}/services/gpushare/"
    assert {"port": int(port)} in values["hub"]["networkPolicy"]["ingress"][0]["ports"]
    assert values["hub"]["service"]["annotations"]["prometheus.io/path"] == "/services/gpushare/metrics"
    config = values["hub"]["extraFiles"]["gpushare-config"]["stringData"]
    exec(compile(config, "gpushare_hub_config.py", "exec"), {"c": Config()})  # valid Python
    # new servers go where the service ranks best: the hook, and the node name it steers by
    hub_config = Config()
    exec(compile(values["hub"]["extraConfig"]["gpushare-nodes"], "extraConfig", "exec"), {"c": hub_config})
    from jupyter_gpushare.hub.spawner_hook import HOSTNAME_LABEL, steer

    assert hub_config.KubeSpawner.pre_spawn_hook is steer and HOSTNAME_LABEL == "kubernetes.io/hostname"
    assert values["singleuser"]["extraEnv"]["JUPYTER_GPUSHARE_NODE"] == {
        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}


def test_every_dashboard_query_uses_a_metric_the_service_exports():
    exported = set()
    for family in HubMetrics().registry.collect():
        exported |= {s.name for s in family.samples} | {family.name}
        exported |= {family.name + suffix for suffix in ("_total", "_bucket", "_sum", "_count")}
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for t in panel["targets"]
               for name in re.findall(r"gpushare_hub_\w+", t["expr"])}
    assert queried and queried <= exported, queried - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("held", "released", "restores", "latency", "waiting", "gpu-hours"):
        assert topic in titles, topic


def test_the_daemonset_and_the_values_agree_on_the_daemons_port_secret_and_name():
    import argparse

    from jupyter_gpushare.node import daemon

    values = yaml.safe_load((DEPLOY / "z2jh-values.yaml").read_text())
    ds, policy = yaml.safe_load_all((DEPLOY / "node-daemon-daemonset.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    parser = argparse.ArgumentParser()
    daemon.add_arguments(parser)
    args = parser.parse_args([a.replace("$(JUPYTER_GPUSHARE_NODE)", "gpu-1") for a in container["command"][2:]])
    assert args.node == "gpu-1" and args.unix_user == "" and pod["hostPID"] is True
    config = Config()
    exec(compile(values["hub"]["extraFiles"]["gpushare-config"]["stringData"], "config", "exec"), {"c": config})
    port = int(args.listen.rsplit(":", 1)[1])
    assert config.GPUShareHub.node_daemons == f"{{node}}:{port}"
    assert {"name": "gpushare", "containerPort": port, "hostPort": port, "protocol": "TCP"} in container["ports"]
    # the one secret, mounted where each side reads it
    hub_secret = values["hub"]["extraVolumes"][0]["secret"]
    ds_secret = next(v["secret"] for v in pod["volumes"] if "secret" in v)
    assert hub_secret["secretName"] == ds_secret["secretName"] == "gpushare-node-daemon"
    assert config.GPUShareHub.node_daemon_secret_file.startswith(values["hub"]["extraVolumeMounts"][0]["mountPath"])
    assert args.secret_file.startswith(next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "secret"))
    assert hub_secret["defaultMode"] & 0o007 == 0 and ds_secret["defaultMode"] == 0o400
    # the hub pod alone reaches the port; the hub may call it; the user pods use the socket
    assert policy["spec"]["ingress"] == [{"ports": [{"port": port, "protocol": "TCP"}],
                                          "from": [{"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}}]}]
    assert any(r["ports"] == [{"port": port, "protocol": "TCP"}] for r in values["hub"]["networkPolicy"]["egress"])
    assert values["singleuser"]["extraEnv"]["JUPYTER_GPUSHARE_NODE_DAEMON"] == args.socket
