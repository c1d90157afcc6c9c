"""The admin boundary and API keys: who may see `/api/state`, `/dashboard`, `/metrics`, and that
no key ever comes out again, in a log, a trace, the state, the metrics or an error body."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from typing import TYPE_CHECKING

import httpx
import pytest
import yaml
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from llmflow.gateway.app import create_admin_app
from llmflow.gateway.ws import PROTOCOL, key_subprotocol
from tests.processes import free_port

from .harness import Harness, serve_asgi, start_gateway
from .outside import ADMIN_KEY, TENANT_KEY, assert_openai_error, outside_gateway

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

ADMIN_PATHS = ("/api/state", "/dashboard", "/metrics")
CHAT = "/v1/chat/completions"
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TENANTS = [{"name": "acme", "tier": "vip", "api_keys": [TENANT_KEY]}]


async def test_by_default_admin_routes_are_open_on_the_main_listener(gw: Harness) -> None:
    for path in ADMIN_PATHS:
        assert (await gw.client.get(path)).status_code == 200


async def test_an_admin_key_alone_guards_them_on_the_main_listener() -> None:
    async with start_gateway(admin={"api_key": ADMIN_KEY}) as h:
        for path in ADMIN_PATHS:
            r = await h.client.get(path)
            assert r.status_code == 401
            assert assert_openai_error(401, r.content, r.headers["content-type"])["code"] == (
                "invalid_admin_key"
            )
            assert r.headers["www-authenticate"].startswith("Basic")  # a browser asks
            ok = await h.client.get(path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
            assert ok.status_code == 200


async def test_with_an_admin_port_they_move_to_the_admin_listener_behind_the_key() -> None:
    admin = {"port": 1, "api_key": ADMIN_KEY}  # the port is the CLI's; here it only moves them
    async with start_gateway(admin=admin, tenants=TENANTS) as h:
        for path in ADMIN_PATHS:
            assert (await h.client.get(path)).status_code == 404
        assert (await h.client.get("/healthz")).status_code == 200
        assert (await h.client.get("/health")).status_code == 200
        assert (await h.client.get("/readyz")).status_code == 200
        app = create_admin_app(h.app)
        async with serve_asgi(app) as (url, _), httpx.AsyncClient(base_url=url) as c:
            basic = base64.b64encode(f"anyone:{ADMIN_KEY}".encode()).decode()
            for path in ADMIN_PATHS:
                assert (await c.get(path)).status_code == 401
                bad = {"authorization": f"Bearer {TENANT_KEY}"}  # a tenant key is not admin
                assert (await c.get(path, headers=bad)).status_code == 401
                good = {"authorization": f"Bearer {ADMIN_KEY}"}
                assert (await c.get(path, headers=good)).status_code == 200
                assert (await c.get(path, headers={"authorization": f"Basic {basic}"})).is_success
            assert (await c.get("/v1/models")).status_code == 404  # nothing else is served


def test_llmflow_serve_starts_both_listeners_and_stops_both(tmp_path: Path) -> None:
    port = free_port()
    with outside_gateway(tmp_path, admin={"port": port, "api_key": ADMIN_KEY}) as g:
        admin_url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{g.url}/metrics").status_code == 404
        assert httpx.get(f"{admin_url}/metrics").status_code == 401
        auth = {"authorization": f"Bearer {ADMIN_KEY}"}
        state = httpx.get(f"{admin_url}/api/state", headers=auth)
        assert state.json()["draining"] is False
        assert "llmflow_" in httpx.get(f"{admin_url}/metrics", headers=auth).text
        assert g.gateway.stop() == 0  # SIGTERM: drained and exited cleanly
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{admin_url}/metrics")


def test_an_admin_port_without_a_key_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"admin": {"port": 9999}}))
    result = _serve(config)
    assert result.returncode == 2
    assert "admin.api_key" in result.stderr


def _serve(config: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "llmflow.cli", "serve", "--config", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


_LAST = ("end", "error")


def test_no_key_comes_out_of_a_run(tmp_path: Path) -> None:
    """Serve with keys at debug level with a trace; use, misuse and probe; grep everything."""
    wrong = "wk-5d0c7e9a1b3f2468ac9e"  # a client's wrong key must not be echoed either
    trace = tmp_path / "trace.jsonl"
    port = free_port()
    outputs: list[str] = []
    with outside_gateway(
        tmp_path,
        extra_args=("--log-level", "debug", "--trace", str(trace)),
        tenants=TENANTS,
        admin={"port": port, "api_key": ADMIN_KEY},
    ) as g:
        with httpx.Client(base_url=g.url, timeout=30) as c:
            for key in (TENANT_KEY, wrong, TENANT_KEY + "x", "k", ADMIN_KEY):
                headers = {"authorization": f"Bearer {key}"}
                for body in (BODY, {**BODY, "stream": True}, {"model": "nope"}, {"x": key}):
                    outputs.append(c.post(CHAT, json=body, headers=headers).text)
                outputs.append(c.get("/v1/models", headers=headers).text)
            outputs.append(c.post(CHAT, json=BODY, headers={"authorization": wrong}).text)
        url = g.url.replace("http://", "ws://") + "/v1/ws"
        for key in (TENANT_KEY, wrong):  # the upgrade's header, then a browser's subprotocol
            for how in ({"additional_headers": {"authorization": f"Bearer {key}"}},
                        {"subprotocols": [PROTOCOL, key_subprotocol(key)]}):  # fmt: skip
                try:
                    ws = connect(url, **how)  # type: ignore[arg-type]
                except InvalidStatus as refused:  # the wrong key: refused before the upgrade
                    outputs.append(refused.response.body.decode())
                    continue
                with ws:
                    request = {"type": "request", "id": 1, "endpoint": "chat", "body": BODY}
                    ws.send(json.dumps(request))
                    while (reply := json.loads(ws.recv(timeout=10)))["type"] not in _LAST:
                        outputs.append(json.dumps(reply))
                    outputs.append(json.dumps(reply))
        admin = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        with admin:
            state = admin.get("/api/state")
            assert state.json()["outcomes"], "the run left no trace in the state"
            outputs += [state.text, admin.get("/metrics").text, admin.get("/dashboard").text]
            outputs.append(
                admin.get("/api/state", headers={"authorization": f"Bearer {wrong}"}).text
            )
        assert g.gateway.stop() == 0
        outputs.append(g.gateway.log_path.read_text())
    outputs.append(trace.read_text())
    assert sum(len(o) for o in outputs) > 10_000  # there was something to grep
    everything = "\n".join(outputs)
    assert "acme" in everything  # tenants do appear, as they should
    for secret in (TENANT_KEY, ADMIN_KEY, wrong):
        encoded = key_subprotocol(secret).removeprefix("llmflow.key.")  # a browser's form
        for part in (secret, secret[3:15], encoded[4:20]):  # not even in part
            at = everything.find(part)
            assert at < 0, everything[max(at - 400, 0) : at + 100]


def test_config_errors_never_quote_a_key(tmp_path: Path) -> None:
    bad = {
        "tenants": [
            {"name": "a", "tier": "vip", "api_keys": [TENANT_KEY]},
            {"name": "b", "tier": "gold", "api_keys": [TENANT_KEY]},
            {"name": "c", "tier": "vip", "api_keys": TENANT_KEY},
        ],
        "admin": {"api_key": ADMIN_KEY, "port": "x"},
    }
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(bad))
    result = _serve(config)
    assert result.returncode == 2
    assert "invalid config" in result.stderr
    assert TENANT_KEY not in result.stderr
    assert ADMIN_KEY not in result.stderr
