"""The Helm chart rendered as `helm template` renders it, and the pieces of it the tests read.

Rendering goes through Helm's own Go engine (v4), which the `helm-python-sdk` wheel bundles
as a shared library (no helm binary: there is none to install from PyPI, crates.io or Debian).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "llmflow"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
RELEASE, NAMESPACE = "gw", "llm"


@dataclass
class Rendered:
    """Every manifest of one render, by kind; `text` is the whole render as YAML."""

    manifests: list[dict[str, Any]]
    text: str

    def kind(self, kind: str) -> list[dict[str, Any]]:
        """The manifests of one kind."""
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        """The manifest of `kind` called `name` (exactly one)."""
        found = [m for m in self.kind(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
        return found[0]

    @property
    def gateway(self) -> dict[str, Any]:
        """The gateway's Deployment."""
        return self.one("Deployment", f"{RELEASE}-llmflow")

    @property
    def configmap(self) -> dict[str, str]:
        """The config ConfigMap's data."""
        data: dict[str, str] = self.one("ConfigMap", f"{RELEASE}-llmflow")["data"]
        return data

    @property
    def secret(self) -> dict[str, str]:
        """The chart-created Secret's data, decoded."""
        data = self.one("Secret", f"{RELEASE}-llmflow")["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}


def values(name: str) -> dict[str, Any]:
    """An example values file under deploy/helm/examples ("default": the chart's own)."""
    if name == "default":
        return {}
    loaded: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    return loaded


def render(overrides: dict[str, Any] | None = None) -> Rendered:
    """`helm template gw deploy/helm/llmflow -n llm` with `overrides` as the values."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(overrides or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests: list[dict[str, Any]] = []
    texts = []
    for path, text in sorted(files.items()):
        if not path.endswith(".yaml"):
            continue  # NOTES.txt
        texts.append(text)
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(manifests, "\n---\n".join(texts))


def pod_specs(rendered: Rendered) -> list[dict[str, Any]]:
    """The pod template of every Deployment."""
    return [d["spec"]["template"]["spec"] for d in rendered.kind("Deployment")]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """A container (or init container) of a Deployment's pod, by name."""
    spec = deployment["spec"]["template"]["spec"]
    found = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a label selector (`matchLabels`) picks an object with these labels."""
    return all(labels.get(k) == v for k, v in selector.items())


def selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    """Whether a label selector picks the Deployment's pods."""
    return matches(selector, deployment["spec"]["template"]["metadata"]["labels"])
