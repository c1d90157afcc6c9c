"""Session fixtures that run real vLLM (CPU build) serving a tiny random-weight model.

Fixtures:

* ``vllm_python`` - the vLLM venv's python (``$LLMFLOW_VLLM_PYTHON`` or ``scripts/vllm_env.sh``).
* ``tiny_model_dir`` - the tiny model, built once per session with that python.
* ``vllm_server`` - one server with the default flags, shared by the whole session.
* ``vllm_server_factory`` - ``start(extra_args)`` for servers with other flags; all stopped at
  the end of the session.
* ``vllm`` - the session's default server, once it is idle (for a test that counts on it).
* ``start_gateway`` - ``start(config)`` for `llmflow serve` processes, stopped at the test's end.

These fixtures FAIL, never skip, when vLLM cannot be set up: CI is expected to provide it.
Deselect with ``-m "not integration"`` when it is not wanted.

The venv is resolved in ``pytest_collection_finish`` (once, only if integration tests were
selected) rather than inside a fixture, so that a first-time build (~2.6 GB download, minutes)
is not cut short by the per-test ``pytest-timeout``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.integration.gwtools import GatewayPool, wait_vllm_idle
from tests.integration.vllm_server import VllmServer, find_vllm_python
from tests.processes import free_port

if TYPE_CHECKING:
    from tests.processes import GatewayProcess

TINY_MODEL_SCRIPT = Path(__file__).resolve().parent / "tiny_model.py"

_venv_key = pytest.StashKey[Path | BaseException]()

ServerFactory = Callable[[Sequence[str]], VllmServer]


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marker here too, so this directory also works with a bare pytest config."""
    config.addinivalue_line("markers", "integration: needs a real vLLM server")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Locate (building if needed) the vLLM venv once, outside any test's timeout."""
    if session.config.option.collectonly:
        return
    if not any(item.get_closest_marker("integration") for item in session.items):
        return
    started = time.monotonic()
    try:
        python: Path | BaseException = find_vllm_python()
    except Exception as exc:
        python = exc
    elapsed = time.monotonic() - started
    if elapsed > 5:
        print(f"\n[integration] vLLM venv ready after {elapsed:.0f} s", file=sys.stderr)
    session.config.stash[_venv_key] = python


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> Path:
    """Path to the python of the venv that has vLLM, torch and transformers."""
    found = pytestconfig.stash.get(_venv_key, None)
    if found is None:  # e.g. collected without the hook having run
        try:
            found = find_vllm_python()
        except Exception as exc:
            found = exc
        pytestconfig.stash[_venv_key] = found
    if isinstance(found, BaseException):
        pytest.fail(f"vLLM venv unavailable (run scripts/vllm_env.sh): {found}", pytrace=False)
    return found


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama + BPE tokenizer, built once per session."""
    dest = tmp_path_factory.mktemp("tiny-model")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [str(vllm_python), str(TINY_MODEL_SCRIPT), str(dest)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"building the tiny model failed ({proc.returncode}):\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    return dest


@pytest.fixture(scope="session")
def vllm_server_factory(
    vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerFactory]:
    """Start extra vLLM servers with extra flags, e.g. ``start(["--scheduling-policy",
    "priority"])``; each is healthy on return and stopped at the end of the session."""
    servers: list[VllmServer] = []
    logs = tmp_path_factory.mktemp("vllm-logs")

    def start(extra_args: Sequence[str] = ()) -> VllmServer:
        port = free_port()
        server = VllmServer(
            vllm_python, tiny_model_dir, port, extra_args, log_path=logs / f"vllm-{port}.log"
        )
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
        servers.append(server)
        return server

    yield start
    for server in reversed(servers):
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(vllm_server_factory: ServerFactory) -> VllmServer:
    """One vLLM server with the default flags, shared by the session."""
    return vllm_server_factory(())


@pytest.fixture
def vllm(vllm_server: VllmServer) -> VllmServer:
    """The session's default vLLM server, idle."""
    wait_vllm_idle(vllm_server)
    return vllm_server


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], GatewayProcess]]:
    """Start gateways for this test (stopped at its end)."""
    with GatewayPool.running(tmp_path) as pool:
        yield pool.start
