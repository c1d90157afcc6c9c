"""The Helm chart (deploy/helm/llmflow), rendered by Helm's engine and checked from outside.

Three value sets: the chart's defaults (one pod), `examples/replicas-redis.yaml` (three pods
sharing the chart's Redis, a ServiceMonitor) and `examples/replicas-external-redis.yaml`.
Every manifest is validated against the Kubernetes API's own schemas (`kubernetes-validate`,
strict: no unknown field), at the oldest and newest version it knows. The config is assembled
as the pod's init container does it (the ConfigMap's script run on the ConfigMap and the
Secret's files) and loaded by `llmflow config check`; the keys must reach the pod only through
the Secret; pods must meet the "restricted" Pod Security Standard; the grace period must cover
the drain.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import helm_python as helm
import httpx
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from llmflow.config import load_settings
from llmflow.gateway.cli import _FORCE_AFTER_DRAIN_S
from llmflow.gateway.routes.ops import router as ops_router
from tests.gateway.certs import Authority
from tests.processes import GatewayProcess

from .chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    Rendered,
    container,
    matches,
    pod_specs,
    render,
    selects,
    values,
)

if TYPE_CHECKING:
    from llmflow.config import Settings

VALUE_SETS = ["default", "replicas-redis", "replicas-external-redis"]
K8S_VERSIONS = [all_versions()[0], all_versions()[-1]]  # 1.25 (the chart's floor) .. newest
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # no schema in kubernetes-validate


@pytest.fixture(scope="module", params=VALUE_SETS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(values(request.param))


def assembled(rendered: Rendered, workdir: Path) -> Path:
    """Run the rendered init step on the rendered ConfigMap and Secret; the config it wrote."""
    done, out = init_step(rendered, rendered.secret, workdir)
    assert done.returncode == 0, done.stderr
    return out


def init_step(
    rendered: Rendered, secret: dict[str, str], workdir: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The init container's command on these files, paths moved under `workdir`."""
    chart, secrets = workdir / "chart", workdir / "secrets"
    chart.mkdir(parents=True)
    for key, text in rendered.configmap.items():
        (chart / key).write_text(text)
    # a Secret volume as the kubelet lays it out: a timestamped dir, ..data, links to it
    (secrets / "..2026_12_02_00_00_00.1").mkdir(parents=True)
    for key, text in secret.items():
        (secrets / "..2026_12_02_00_00_00.1" / key).write_text(text)
        (secrets / key).symlink_to(Path("..data") / key)
    (secrets / "..data").symlink_to("..2026_12_02_00_00_00.1")
    init = container(rendered.gateway, "config")
    args = [a.replace("/etc/llmflow/chart", str(chart)) for a in init["command"][1:]]
    args = [a.replace("/etc/llmflow/secrets", str(secrets)) for a in args]
    args = [a.replace("/run/llmflow", str(workdir)) for a in args]
    out = Path(next(a for a in args if a.startswith("--out=")).removeprefix("--out="))
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False)
    return done, out


def test_every_manifest_validates_against_the_kubernetes_schemas(rendered: Rendered) -> None:
    checked = 0
    for manifest in rendered.manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CRDS:
            continue  # checked against what it selects, below
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)
        checked += 1
    kinds = sorted({m["kind"] for m in rendered.manifests})
    assert {"ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"} <= set(kinds)
    assert checked == len(rendered.manifests) - len(rendered.kind("ServiceMonitor"))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_finds_no_warning_or_error(name: str) -> None:
    report = helm.lint(str(CHART), values(name), strict=True)
    assert report["total_charts_linted"] == 1
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 warning, 3 error
    assert report["errors"] == []


def test_the_configmap_config_loads_once_the_init_step_adds_the_secret(
    rendered: Rendered, tmp_path: Path
) -> None:
    config = assembled(rendered, tmp_path)
    check = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "config", "check", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    assert os.stat(config).st_mode & 0o077 == 0  # keys inside: the pod's user alone reads it
    settings = load_settings(config)
    secret = rendered.secret
    assert settings.admin.api_key == secret["admin-api-key"]
    for tenant in settings.tenants:
        assert tenant.api_keys == secret[f"tenant.{tenant.name}"].splitlines()
    ports = {p["name"]: p["containerPort"] for p in container(rendered.gateway, "llmflow")["ports"]}
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", ports["http"])
    assert (settings.admin.host, settings.admin.port) == ("0.0.0.0", ports["admin"])


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        ({"tenant.ghost": "sk-ghost-key-1"}, "Secret key 'tenant.ghost': no tenant 'ghost'"),
        ({"redis-url": None}, "the Secret has no 'redis-url' key"),
        ({"tenant.shop": "sk-acme-1"}, "share a key"),  # llmflow's own check
    ],
    ids=["unknown-tenant", "no-redis-url", "shared-key"],
)
def test_the_init_step_stops_on_an_existing_secret_that_does_not_fit(
    tamper: dict[str, str | None], says: str, tmp_path: Path
) -> None:
    rendered = render(values("replicas-redis"))
    secret = {**rendered.secret, **tamper}
    done, out = init_step(rendered, {k: v for k, v in secret.items() if v is not None}, tmp_path)
    assert done.returncode == 2
    assert says in done.stderr
    assert "sk-" not in done.stderr  # no key in the pod's log
    assert not out.exists()


def test_no_key_is_inlined_outside_the_secret(rendered: Rendered) -> None:
    secret = rendered.secret
    keys = [secret["admin-api-key"]] + [
        k for name, text in secret.items() if name.startswith("tenant.") for k in text.split()
    ]
    if "redis-url" in secret:
        keys.append(urlsplit(secret["redis-url"]).password or "")
        assert keys[-1], "the test's Redis URLs carry a password"
    assert len(keys[0]) >= 16
    elsewhere = [m for m in rendered.manifests if m["kind"] != "Secret"]
    text = yaml.safe_dump_all(elsewhere)
    assert [k for k in keys if k in text] == []
    # the Secret reaches the gateway as a volume and Redis as a secretKeyRef, by name
    spec = rendered.gateway["spec"]["template"]["spec"]
    assert {"name": "secrets", "secret": {"secretName": "gw-llmflow", "defaultMode": 0o440}} in (
        spec["volumes"]
    )


def test_pods_meet_the_restricted_pod_security_standard(rendered: Rendered) -> None:
    for spec in pod_specs(rendered):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] != 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert not any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC"))
        scratch = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        assert all(set(v) & {"emptyDir", "configMap", "secret"} for v in spec["volumes"])
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, c["name"]
            assert ctx["readOnlyRootFilesystem"] is True, c["name"]
            assert ctx["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert ctx.get("privileged", False) is False
            assert set(c["resources"]["requests"]) == {"cpu", "memory"}, c["name"]
            writable = {m["name"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            assert writable <= scratch, c["name"]  # writes go to emptyDirs only


def test_the_grace_period_covers_the_prestop_sleep_and_the_drain(
    rendered: Rendered, tmp_path: Path
) -> None:
    settings: Settings = load_settings(assembled(rendered, tmp_path))
    spec = rendered.gateway["spec"]["template"]["spec"]
    gateway = container(rendered.gateway, "llmflow")
    sleep = int(gateway["lifecycle"]["preStop"]["exec"]["command"][1])
    drain_s = settings.server.drain_timeout_ms / 1e3
    assert spec["terminationGracePeriodSeconds"] > sleep + drain_s + _FORCE_AFTER_DRAIN_S
    routes = {r.path for r in ops_router.routes}  # type: ignore[attr-defined]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {"/healthz", "/readyz"} <= routes
    strategy = rendered.gateway["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_services_and_the_budget_select_the_gateway_pods_by_their_ports(
    rendered: Rendered,
) -> None:
    ports = {p["name"] for p in container(rendered.gateway, "llmflow")["ports"]}
    for name, port in (("gw-llmflow", "http"), ("gw-llmflow-admin", "admin")):
        service = rendered.one("Service", name)["spec"]
        assert selects(service["selector"], rendered.gateway)
        assert [p["targetPort"] for p in service["ports"]] == [port]
        assert port in ports
    budget = rendered.one("PodDisruptionBudget", "gw-llmflow")["spec"]["selector"]["matchLabels"]
    assert [d["metadata"]["name"] for d in rendered.kind("Deployment") if selects(budget, d)] == [
        "gw-llmflow"
    ]
    annotations = rendered.gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    by_name = {
        p["name"]: p["containerPort"] for p in container(rendered.gateway, "llmflow")["ports"]
    }
    assert int(annotations["prometheus.io/port"]) == by_name["admin"]  # /metrics lives there


def test_the_dashboard_configmap_is_the_shipped_dashboard(rendered: Rendered) -> None:
    board = rendered.one("ConfigMap", "gw-llmflow-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((ROOT / "deploy" / "grafana" / "llmflow.json").read_text())
    assert json.loads(board["data"]["llmflow.json"]) == shipped


def test_replicas_share_the_charts_redis(tmp_path: Path) -> None:
    rendered = render(values("replicas-redis"))
    settings = load_settings(assembled(rendered, tmp_path))
    replicas = rendered.gateway["spec"]["replicas"]
    assert replicas == 3
    assert (settings.state.backend, settings.state.replicas) == ("redis", replicas)
    url = urlsplit(settings.state.url or "")
    redis = rendered.one("Deployment", "gw-llmflow-redis")
    service = rendered.one("Service", "gw-llmflow-redis")["spec"]
    assert (url.hostname, url.port) == ("gw-llmflow-redis", service["ports"][0]["port"])
    assert selects(service["selector"], redis)
    assert not selects(service["selector"], rendered.gateway)
    # the password in the gateway's URL is the one Redis is started with, from the same Secret
    env = container(redis, "redis")["env"][0]["valueFrom"]["secretKeyRef"]
    assert env == {"name": "gw-llmflow", "key": "redis-password"}
    assert url.password == rendered.secret["redis-password"]
    assert "$(REDIS_PASSWORD)" in container(redis, "redis")["args"]


def test_the_servicemonitor_scrapes_the_admin_listener_with_the_admin_key() -> None:
    rendered = render(values("replicas-redis"))
    (monitor,) = rendered.kind("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    admin = rendered.one("Service", "gw-llmflow-admin")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert matches(selector, admin["metadata"]["labels"])
    assert not matches(selector, rendered.one("Service", "gw-llmflow")["metadata"]["labels"])
    assert endpoint["port"] in [p["name"] for p in admin["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"
    credentials = endpoint["authorization"]["credentials"]
    assert credentials["name"] == "gw-llmflow"
    assert credentials["key"] in rendered.secret


def test_a_keyless_gateway_answers_on_its_service_names(tmp_path: Path) -> None:
    # Without API keys the gateway answers only Host names it knows (DNS rebinding): the chart
    # must name its Services, or every in-cluster client would get 403.
    overrides = {
        "config": {
            "backends": [{"name": "sim", "models": ["m"]}],  # no URL: the built-in simulated
            "server": {"allowed_hosts": ["llm.example.com"]},
        }
    }
    config = yaml.safe_load(assembled(render(overrides), tmp_path).read_text())
    assert not any(t.get("api_keys") for t in config.get("tenants", []))
    with GatewayProcess(config, tmp_path) as gateway, httpx.Client() as client:
        port = gateway.port
        for host in (
            f"{RELEASE}-llmflow:{port}",
            f"{RELEASE}-llmflow.{NAMESPACE}.svc.cluster.local:{port}",
            f"{RELEASE}-llmflow-admin.{NAMESPACE}",
            "llm.example.com",  # the user's own, kept beside the chart's
        ):
            answer = client.get(f"{gateway.url}/healthz", headers={"host": host})
            assert answer.status_code == 200, (host, answer.text)
        foreign = client.get(f"{gateway.url}/healthz", headers={"host": "rebound.example"})
        assert foreign.status_code == 403


def test_shadow_mode_and_traces_reach_the_config(tmp_path: Path) -> None:
    endpoint = "http://otel-collector.observability:4318"
    overrides = {"gate": {"mode": "shadow"}, "otel": {"endpoint": endpoint, "sampleRatio": 0.25}}
    settings = load_settings(assembled(render(overrides), tmp_path))
    assert settings.gate.mode == "shadow"
    assert settings.telemetry.otlp_endpoint == endpoint
    assert settings.telemetry.sample_ratio == 0.25
    off = load_settings(assembled(render(), tmp_path / "off"))
    assert (off.gate.mode, off.telemetry.otlp_endpoint) == ("enforce", None)


def test_an_https_backends_ca_is_mounted_where_its_tls_ca_file_names_it(tmp_path: Path) -> None:
    # The CA comes from a Secret the operator made, mounted through `extraVolumes`; the test
    # mounts it under tmp_path (the pod's path, as this process sees it) so the config loads.
    mounted = tmp_path / "backend-ca"
    mounted.mkdir()
    ca = Authority(mounted, "vllm").ca_file
    overrides = {
        "extraVolumes": [{"name": "backend-ca", "secret": {"secretName": "vllm-ca"}}],
        "extraVolumeMounts": [
            {"name": "backend-ca", "mountPath": str(mounted), "readOnly": True}
        ],
        "config": {"backends": [{"name": "gpu0", "url": "https://vllm.llm:8000",
                                 "tls_ca_file": str(ca)}]},
    }
    rendered = render(overrides)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(rendered.gateway, version, strict=True)
    (spec,) = pod_specs(rendered)
    assert {"name": "backend-ca", "secret": {"secretName": "vllm-ca"}} in spec["volumes"]
    mounts = container(rendered.gateway, "llmflow")["volumeMounts"]
    assert {"name": "backend-ca", "mountPath": str(mounted), "readOnly": True} in mounts
    assert all(m["name"] != "backend-ca" for m in container(rendered.gateway, "config")
               ["volumeMounts"])  # the init step reads no backend's CA
    settings = load_settings(assembled(rendered, tmp_path / "pod"))
    assert settings.backends[0].tls_ca_file == str(ca)
    assert str(ca).startswith(str(mounted) + "/")


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"replicaCount": 2}, "set redis.mode to bundled or external"),
        (
            {
                "config": {
                    "backends": [{"name": "b", "url": "http://v:8000"}],
                    "tenants": [{"name": "a", "tier": "vip", "api_keys": ["k"]}],
                }
            },
            "put them in secrets.tenantApiKeys.a",
        ),
        ({"config": {"state": {"backend": "redis"}}}, "use redis.mode"),
        ({"secrets": {"tenantApiKeys": {"ghost": ["k"]}}}, "no tenant ghost in config.tenants"),
        ({"redis": {"mode": "external"}}, "secrets.redisUrl"),
        ({"gate": {"mode": "shadow"}, "redis": {"mode": "bundled"}}, "shadow runs on one gateway"),
        ({"gate": {"mode": "dry-run"}}, "at '/gate/mode': value must be one of"),  # the schema
        ({"replicaCount": "three"}, "at '/replicaCount': got string, want integer"),
        ({"secrets": {"adminKey": "x" * 20}}, "additional properties 'adminKey' not allowed"),
    ],
    ids=[
        "replicas-without-redis",
        "inline-key",
        "state-by-hand",
        "unknown-tenant",
        "no-url",
        "shadow-with-replicas",
        "unknown-mode",
        "replicas-not-a-number",
        "misspelt-secret-value",
    ],
)
def test_values_that_would_misconfigure_the_gateway_stop_the_render(
    overrides: dict[str, Any], says: str
) -> None:
    with pytest.raises(helm.HelmError) as caught:
        render(overrides)
    assert says in str(caught.value)
