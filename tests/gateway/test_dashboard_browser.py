"""The live KV dashboard in a real browser: Debian's headless chromium renders `/dashboard`
from a running `llmflow serve` (embedded simulated vLLM) while a request streams."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(tmp_path: Path) -> object:
    port = _free_port()
    config = tmp_path / "llmflow.yaml"
    config.write_text("backends:\n  - {name: sim0}\nstreaming: {first_token_timeout_ms: null}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmflow.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "llmflow serve exited during startup"
            assert time.monotonic() < deadline, "llmflow serve did not become ready"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_dashboard_renders_live_state(served: str, tmp_path: Path) -> None:
    assert CHROMIUM, "chromium is required for this test (.ci/run installs Debian's chromium)"
    body = {
        "model": "llmflow-sim",
        "prompt": "hello " * 200,
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    stop = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{served}/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    deadline = time.monotonic() + 20
    while httpx.get(f"{served}/api/state").json()["core"]["running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    common = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=4000",
    ]
    env = {**os.environ, "HOME": str(tmp_path)}
    dom = subprocess.run(
        [*common, "--dump-dom", f"{served}/dashboard"],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
        env=env,
    ).stdout
    shot = Path(os.environ.get("LLMFLOW_SCREENSHOT_DIR", tmp_path)) / "dashboard.png"
    subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1200,900", f"{served}/dashboard"],
        capture_output=True,
        timeout=90,
        check=True,
        env=env,
    )
    stop.set()
    assert "<b>sim0</b>" in dom
    assert "running 1" in dom
    assert "<td>anonymous</td><td>normal</td><td>sim0</td>" in dom
    assert shot.stat().st_size > 10_000, "the screenshot is blank"
