"""The simulated vLLM's P/D hand-off: two real `simserve --kv-transfer` processes, driven by hand
the way vLLM's toy proxy drives two vLLM instances with the NIXL connector."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.processes import SimServeProcess, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

# fmt: off
SPEED = 4.0                # simulated seconds per wall second, every server here
LINK_GB_S = 0.25           # GB/s, the decode's inbound link: slow, so a transfer shows
KV_BYTES = 2 * 32 * 8 * 128 * 2  # bytes per token of llama-3-8b's KV (K and V, 32 layers,
                           # 8 KV heads of 128, bf16), the default preset's model on one GPU
PROMPT = 4000              # tokens: "abcd" is one token of the simulated tokenizer
BLOCK = 16                 # tokens per KV block
# fmt: on
TRANSFER_S = PROMPT * KV_BYTES / (LINK_GB_S * 1e9) / SPEED  # wall s, ~0.52


def _kv(*extra: str) -> tuple[str, ...]:
    return ("--speed", str(SPEED), "--kv-transfer", "--kv-link-gb-s", str(LINK_GB_S),
            "--kv-link-latency-ms", "0", *extra)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimServeProcess]]:
    """A prefill and a decode server with the connector, one without, and one whose held KV
    times out after 2 simulated seconds (half a wall second)."""
    work = tmp_path_factory.mktemp("pd")
    procs = {"prefill": SimServeProcess(work, *_kv()), "decode": SimServeProcess(work, *_kv()),
             "plain": SimServeProcess(work, "--speed", str(SPEED)),
             "short": SimServeProcess(work, *_kv("--kv-hold-timeout-s", "2"))}
    try:
        for p in procs.values():
            p.start()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """A client with a timeout long enough for any answer here."""
    with httpx.Client(timeout=30.0) as c:
        yield c


def _metric(http: httpx.Client, server: SimServeProcess, name: str, **labels: str) -> float:
    text = http.get(f"{server.url}/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def _poll(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _request(tokens: int = PROMPT, max_tokens: int = 8, word: str = "abcd") -> dict[str, Any]:
    return {"prompt": word * tokens, "max_tokens": max_tokens, "ignore_eos": True}


def _prefill(http: httpx.Client, server: SimServeProcess, body: dict[str, Any]) -> httpx.Response:
    """The toy proxy's first step."""
    body = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    for key in ("stream_options", "min_tokens"):
        body.pop(key, None)
    return http.post(f"{server.url}/v1/completions", json=body,
                     headers={"X-Request-Id": str(uuid.uuid4())})


def _stream(http: httpx.Client, server: SimServeProcess, body: dict[str, Any],
            ) -> tuple[float, str, list[str]]:
    """(seconds to the first token, the text, the raw events) of a streamed completion."""
    t0, first, text, events = time.monotonic(), None, "", []
    with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] != "[DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                first = first if first is not None else time.monotonic() - t0
                text += json.loads(line[6:])["choices"][0]["text"]
    assert first is not None
    return first, text, events


def test_the_decode_streams_from_kv_pulled_off_the_prefill(
        servers: dict[str, SimServeProcess], http: httpx.Client) -> None:
    p, d = servers["prefill"], servers["decode"]
    computed = _metric(http, d, "llmflow_sim_prefill_computed_tokens_total")
    r = _prefill(http, p, _request())
    assert r.status_code == 200
    params = r.json()["kv_transfer_params"]
    ids = params.pop("remote_block_ids")
    assert len(ids) == PROMPT // BLOCK
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert isinstance(params.pop("remote_engine_id"), str)
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_host": "127.0.0.1", "remote_port": p.port, "tp_size": 1}
    assert _metric(http, p, "llmflow_sim_kv_held_blocks") == len(ids)  # kept past its end

    ttft, text, events = _stream(http, d, {**_request(), "kv_transfer_params": r.json()[
        "kv_transfer_params"]})
    assert events[-1] == "[DONE]"
    assert len(text.split()) == 8
    # the first token waited for the whole prompt's KV on the 0.25 GB/s link (~0.52 s)
    assert TRANSFER_S <= ttft < TRANSFER_S + 2.0, ttft
    assert _metric(http, p, "llmflow_sim_kv_held_blocks") == 0  # freed once read
    assert _metric(http, p, "llmflow_sim_kv_freed_total", reason="read") == 1
    assert _metric(http, d, "llmflow_sim_kv_bytes_received_total") == PROMPT * KV_BYTES
    # the decode computed only the last prompt token (vLLM recomputes it to sample)
    assert _metric(http, d, "llmflow_sim_prefill_computed_tokens_total") - computed == 1
    again = http.post(f"{p.url}/_sim/kv/pull", json={
        "engine_id": r.json()["kv_transfer_params"]["remote_engine_id"], "block_ids": ids})
    assert again.status_code == 404  # already freed


def test_the_same_prompt_without_the_hand_off_is_computed_locally(
        servers: dict[str, SimServeProcess], http: httpx.Client) -> None:
    # (another prompt: the decode's prefix cache holds the first test's, as vLLM's would)
    d = servers["decode"]
    computed = _metric(http, d, "llmflow_sim_prefill_computed_tokens_total")
    ttft, _, _ = _stream(http, d, _request(word="efgh"))
    assert ttft < TRANSFER_S  # an H100's 4,000-token prefill is far quicker than that link
    assert _metric(http, d, "llmflow_sim_prefill_computed_tokens_total") - computed == PROMPT


def test_a_failed_pull_is_recomputed_on_the_decode(
        servers: dict[str, SimServeProcess], http: httpx.Client) -> None:
    # vLLM's default kv_load_failure_policy is "recompute": the decode prefills the prompt
    p, d = servers["prefill"], servers["decode"]
    bogus = {"engine_id": "nobody", "block_ids": [1_000_000, 1_000_001]}
    assert http.post(f"{p.url}/_sim/kv/pull", json=bogus).status_code == 404
    failed = _metric(http, d, "vllm:nixl_num_failed_transfers_total")
    for port, word in ((p.port, "wxyz"), (free_port(), "qrst")):  # a 404, then no server
        computed = _metric(http, d, "llmflow_sim_prefill_computed_tokens_total")
        r = http.post(f"{d.url}/v1/completions", json={
            **_request(1000, 4, word=word), "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "nobody",
            "remote_block_ids": [1_000_000], "remote_host": "127.0.0.1", "remote_port": port,
            "tp_size": 1}})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 4
        assert r.json()["kv_transfer_params"] is None
        assert _metric(http, d, "llmflow_sim_prefill_computed_tokens_total") - computed == 1000
    assert _metric(http, d, "vllm:nixl_num_failed_transfers_total") - failed == 2
    assert _metric(http, d, "vllm:kv_cache_usage_perc") == 0


def test_a_client_leaving_during_the_transfer_frees_the_decode_blocks(
        servers: dict[str, SimServeProcess], http: httpx.Client) -> None:
    p, d = servers["prefill"], servers["decode"]
    params = _prefill(http, p, _request()).json()["kv_transfer_params"]
    ended = _metric(http, d, "vllm:request_success_total", finished_reason="length")
    body = {**_request(max_tokens=100), "stream": True, "kv_transfer_params": params}
    with http.stream("POST", f"{d.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        # the prompt's blocks are given while its KV is on the wire (~0.52 s)
        assert _poll(lambda: _metric(http, d, "llmflow_sim_kv_loading_requests") == 1, 1.0)
        assert _metric(http, d, "vllm:kv_cache_usage_perc") > 0
    # closed before any token: aborted, its blocks freed before the transfer would have ended
    t0 = time.monotonic()
    assert _poll(lambda: _metric(http, d, "vllm:kv_cache_usage_perc") == 0)
    assert time.monotonic() - t0 < TRANSFER_S
    assert _metric(http, d, "llmflow_sim_kv_loading_requests") == 0
    assert _metric(http, d, "vllm:request_success_total", finished_reason="length") == ended
    # the read already on the wire still ends and tells the prefill side
    assert _poll(lambda: _metric(http, p, "llmflow_sim_kv_held_blocks") == 0)


def test_blocks_nobody_pulls_are_freed_after_the_hold_timeout(
        servers: dict[str, SimServeProcess], http: httpx.Client) -> None:
    s = servers["short"]
    t0 = time.monotonic()
    params = _prefill(http, s, _request(1000)).json()["kv_transfer_params"]
    assert _metric(http, s, "llmflow_sim_kv_held_blocks") == 63  # ceil(1000 / 16)
    assert _poll(lambda: _metric(http, s, "llmflow_sim_kv_held_blocks") == 0)
    assert time.monotonic() - t0 >= 2.0 / SPEED  # 2 simulated seconds
    assert _metric(http, s, "llmflow_sim_kv_freed_total", reason="timeout") == 1
    pull = {"engine_id": params["remote_engine_id"], "block_ids": params["remote_block_ids"]}
    assert http.post(f"{s.url}/_sim/kv/pull", json=pull).status_code == 404


def test_without_kv_transfer_the_params_are_ignored(
        servers: dict[str, SimServeProcess], http: httpx.Client) -> None:
    plain = servers["plain"]
    r = _prefill(http, plain, _request(1000))
    assert r.status_code == 200
    assert r.json()["kv_transfer_params"] is None
    assert _metric(http, plain, "vllm:kv_cache_usage_perc") == 0  # nothing held
    assert "llmflow_sim_kv_held_blocks" not in http.get(f"{plain.url}/metrics").text
    assert http.post(f"{plain.url}/_sim/kv/pull", json={}).status_code == 404
    computed = _metric(http, plain, "llmflow_sim_prefill_computed_tokens_total")
    r = http.post(f"{plain.url}/v1/completions", json={
        **_request(1000, 4, word="mnop"), "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
        "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}})
    assert r.status_code == 200
    assert _metric(http, plain, "llmflow_sim_prefill_computed_tokens_total") - computed == 1000
