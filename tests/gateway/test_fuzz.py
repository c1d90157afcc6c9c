"""Fuzzing from outside: hypothesis and schemathesis against a real `llmflow serve` process.

No answer may be a 5xx, every error is OpenAI's JSON shape with a message, and the fake vLLM's
own counters show that exactly the requests the gateway answered 2xx (or passed a backend's own
4xx) reached it, and that nothing is left running there. Examples are bounded so the file runs
in well under a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from .outside import Outside, assert_openai_error, outside_gateway

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream",
    "stream_options", "temperature", "top_p", "stop", "seed", "user", "echo", "priority",
]  # fmt: skip
# Values that broke, or could break, a JSON parser or what reads its output.
NASTY = [
    b"NaN", b"-Infinity", b"1e400", b"-1e999", b"9" * 5000, b"[" * 300 + b"]" * 300,
    b'"\\ud800"', b'"\\udfff"', b'"\\u12"', b'"\xff"', b'"a\x00"', b"{", b"", b"null",
    b"99999999999999999999999999", b"-1", b"0", b"1.5", b'"x"', b"[]", b"{}", b"true",
]  # fmt: skip
VALID_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
VALID_COMPLETION = {"model": "fake-model", "prompt": "hi"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8).filter(lambda k: k != "fake"), inner, max_size=4)
    ),
    max_leaves=12,
)


def _with(valid: dict[str, Any], field: str, value: Any) -> bytes:
    return json.dumps({**valid, field: value, "max_tokens": 2} | ({field: value})).encode()


def _spliced(valid: dict[str, Any], field: str, nasty: bytes) -> bytes:
    # The raw bytes go where the field's value belongs: json.dumps could not write them.
    body = {**valid, "max_tokens": 2}
    body.pop(field, None)
    head = json.dumps(body).encode()[:-1]
    return head + b', "' + field.encode() + b'": ' + nasty + b"}"


bodies = st.one_of(
    st.builds(_with, st.sampled_from([VALID_CHAT, VALID_COMPLETION]), st.sampled_from(FIELDS),
              json_values),
    st.builds(_spliced, st.sampled_from([VALID_CHAT, VALID_COMPLETION]),
              st.sampled_from(FIELDS), st.sampled_from(NASTY)),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
)  # fmt: skip


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outside]:
    """One gateway process for the module; its log must show no traceback at the end."""
    workdir: Path = tmp_path_factory.mktemp("fuzz")
    with outside_gateway(workdir) as gateway:
        yield gateway
        log = gateway.gateway.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def _reached_backend(response: httpx.Response) -> bool:
    if response.status_code < 400:
        return True
    return str(response.json()["error"]["code"]).startswith("backend_")


def _check(outside: Outside, client: httpx.Client, path: str, body: bytes) -> None:
    seen = outside.fake.seen
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body[:200], r.text[:300])
    if r.status_code >= 400:
        assert_openai_error(r.status_code, r.content, r.headers.get("content-type"))
    assert outside.settled()
    assert outside.fake.seen - seen == int(_reached_backend(r)), (body[:200], r.text[:300])


@pytest.mark.slow
def test_fuzzed_bodies_never_5xx_and_only_served_ones_reach_the_backend(
    outside: Outside,
) -> None:
    with httpx.Client(base_url=outside.url, timeout=30) as client:

        @FUZZ
        @given(path=st.sampled_from([CHAT, COMPLETIONS]), body=bodies)
        def run(path: str, body: bytes) -> None:
            _check(outside, client, path, body)

        run()


ws_messages = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["request", "ack", "cancel", "bogus"])},
        optional={
            "id": json_values,
            "endpoint": st.sampled_from(["chat", "completions", "x"]) | json_values,
            "body": st.builds(lambda f, v: {**VALID_CHAT, "max_tokens": 2, f: v},
                              st.sampled_from(FIELDS), json_values) | json_values,
            "seq": json_values,
            "api_key": json_values,
        },
    ).map(lambda m: json.dumps(m).encode()),
    st.sampled_from(NASTY).map(lambda n: b'{"type": "request", "id": ' + n + b"}"),
    st.binary(max_size=32),
)  # fmt: skip


@pytest.mark.slow
def test_fuzzed_websocket_messages_get_json_answers_and_leave_nothing_running(
    outside: Outside,
) -> None:
    url = outside.url.replace("http://", "ws://") + "/v1/ws"

    @settings(FUZZ, max_examples=60)
    @given(messages=st.lists(ws_messages, min_size=1, max_size=3))
    def run(messages: list[bytes]) -> None:
        with connect(url, open_timeout=10, close_timeout=5) as ws:
            for raw in messages:
                try:
                    ws.send(raw.decode("utf-8") if _is_text(raw) else raw)
                except Exception:  # closed by the gateway after a protocol violation
                    break
            replies = _drain(ws)
        for reply in replies:
            message = json.loads(reply)  # every answer is JSON
            if message.get("type") == "error":
                assert message["status"] < 500, message
                body = json.dumps({"error": message["error"]}).encode()
                assert_openai_error(message["status"], body, "application/json")
        assert outside.settled()

    run()


def _is_text(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _drain(ws: Any) -> list[str | bytes]:
    out: list[str | bytes] = []
    try:
        while True:
            out.append(ws.recv(timeout=0.3))
    except TimeoutError:
        pass
    except Exception:  # closed
        pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_5xx_and_only_openai_errors(outside: Outside, mode: str) -> None:
    """Every operation of the served OpenAPI document, with bodies that fit it and that do not.

    schemathesis's own pytest plugin (`from_fixture`) does not run under pytest 9, so its
    strategies are driven by hypothesis here.
    """
    schema = schemathesis.openapi.from_url(f"{outside.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {CHAT, COMPLETIONS, "/v1/models"}
    calls: list[int] = []
    for operation in operations:
        has_body = operation.method.upper() == "POST"
        if mode == "negative" and not has_body:
            continue  # nothing in a bare GET can be made to not fit the schema

        @settings(FUZZ, max_examples=30 if has_body else 3)
        @given(case=operation.as_strategy(schemathesis.GenerationMode(mode)))
        def run(case: Any) -> None:
            seen = outside.fake.seen
            response = case.call(timeout=30)
            calls.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:300])
            if response.status_code >= 400:
                (kind,) = response.headers.get("content-type", [""])
                assert_openai_error(response.status_code, response.content, kind)
            assert outside.settled()
            reached = response.status_code < 400 and case.path in (CHAT, COMPLETIONS)
            assert outside.fake.seen - seen == int(reached), (case.body, response.text[:300])

        run()
    assert len(calls) >= 2
