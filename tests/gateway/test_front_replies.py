"""The native front's reply bytes (`rust/src/front/reply.rs`) against the Python path's own.

A refusal must go on the wire byte for byte as uvicorn writes the Python path's
`reply_error(...).response()` (`_reply_bytes`: status line, the server's headers, ours,
Starlette's length and type, the body as `JSONResponse` renders it), for every reason,
status, Retry-After and connection state, and with vLLM's own error object when it refused
the request. A cut must end the stream with the frame `encode_event(tail_chunk(...))`
writes, for any template the upstream's first chunk gave (text, numbers Python writes as
`repr`, non-ASCII escaped), and a failure with the in-band
error frame of `in_band_error`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from llmflow._core import (
    front_cut_frame,
    front_cut_names_itself,
    front_in_band_error,
    front_refusal_bytes,
)
from llmflow.gateway import streaming
from llmflow.gateway.contract import REFUSALS
from llmflow.gateway.session import _MESSAGES, in_band_error, reply_error
from llmflow.gateway.streaming import NOTICES, ClientOptions, tail_chunk
from llmflow.gateway.upstream import UpstreamError

from .reference.frames import encode_event

if TYPE_CHECKING:
    from llmflow.gateway.errors import GatewayError

REASONS = [*sorted(_MESSAGES), "some_new_reason", "upstream_error"]
STATUSES = [400, 401, 404, 413, 418, 422, 429, 499, 500, 502, 503, 504, 507, 599]
SERVER = [(b"server", b"uvicorn")]
# JSON as vLLM's error objects and chunk templates hold it (integers within 64 bits: the
# relay's text of them is serde's, which holds no larger)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=10),
    st.floats(allow_nan=False, allow_infinity=False),
)
VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _reply_bytes(
    error: GatewayError, default_headers: list[tuple[bytes, bytes]], keep_alive: bool
) -> bytes:
    """What uvicorn's httptools protocol writes for `error.response()`: the same head, the
    same body (the status line, the server's default headers, the response's, and
    `connection: close` when the connection ends)."""
    response = error.response()
    out: list[bytes | memoryview] = [STATUS_LINE[error.status]]
    for name, value in (*default_headers, *response.raw_headers):
        out += [name, b": ", value, b"\r\n"]
    if not keep_alive:
        out.append(b"connection: close\r\n")
    out += [b"\r\n", response.body]
    return b"".join(out)


def _reply(reason: str, status: int, retry_after_s: int | None, request_id: int) -> Any:
    return SimpleNamespace(
        reason=reason, status=status, retry_after_s=retry_after_s, request_id=request_id
    )


@pytest.mark.parametrize("reason", REASONS)
@settings(max_examples=40, deadline=None)
@given(
    status=st.sampled_from(STATUSES),
    retry_after_s=st.none() | st.integers(0, 10**6),
    request_id=st.integers(0, 2**64 - 1),
    default_headers=st.sampled_from([[], SERVER, [*SERVER, (b"x-extra", b"1")]]),
    keep_alive=st.booleans(),
)
def test_refusal_bytes_are_pythons(
    reason: str,
    status: int,
    retry_after_s: int | None,
    request_id: int,
    default_headers: list[tuple[bytes, bytes]],
    keep_alive: bool,
) -> None:
    error = reply_error(_reply(reason, status, retry_after_s, request_id))
    expected = _reply_bytes(error, default_headers, keep_alive)
    got = front_refusal_bytes(
        reason, status, retry_after_s, request_id, default_headers, keep_alive
    )
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(
    status=st.sampled_from([400, 404, 422, 502, 504]),
    failed=st.sampled_from([400, 404, 422, 502]),
    message=st.text(max_size=30),
    error=st.none() | st.dictionaries(st.text(max_size=8), VALUES, max_size=4),
    ascii_text=st.booleans(),
)
def test_upstream_refusal_bytes_are_pythons(
    status: int, failed: int, message: str, error: dict[str, Any] | None, ascii_text: bool
) -> None:
    """vLLM refused the request: its object is the body when the reply keeps its status."""
    text = None if error is None else json.dumps(error, ensure_ascii=ascii_text)
    upstream = UpstreamError(failed, "backend_rejected", message, error=error)
    python = reply_error(_reply("upstream_error", status, None, 9), upstream)
    expected = _reply_bytes(python, SERVER, True)
    got = front_refusal_bytes(
        "upstream_error",
        status,
        None,
        9,
        SERVER,
        True,
        upstream=(failed, "backend_rejected", message, text),
    )
    assert got == expected


TEMPLATES = st.none() | st.fixed_dictionaries(
    {}, optional={"id": VALUES, "created": VALUES, "model": VALUES}
)


@settings(max_examples=300, deadline=None)
@given(
    endpoint=st.sampled_from(["chat", "completions"]),
    model=st.text(max_size=12),
    template=TEMPLATES,
    order=st.randoms(use_true_random=False),
    open_choices=st.lists(st.integers(0, 200), min_size=1, max_size=4),
    reason=st.sampled_from(sorted(NOTICES)) | st.text(max_size=12),
    request_id=st.integers(0, 2**64 - 1),
    now_s=st.integers(0, 2**40),
)
def test_cut_frame_is_pythons(
    endpoint: str,
    model: str,
    template: dict[str, Any] | None,
    order: Any,
    open_choices: list[int],
    reason: str,
    request_id: int,
    now_s: int,
) -> None:
    """The template comes as the relay hands it to Python (JSON text, in any key order):
    `json.loads` of it is the template `tail_chunk` gets."""
    text = None
    if template is not None:
        items = list(template.items())
        order.shuffle(items)
        text = json.dumps(dict(items), ensure_ascii=False, separators=(",", ":"))
    options = ClientOptions(endpoint, model, True)  # type: ignore[arg-type]
    with patch.object(streaming, "time", SimpleNamespace(time=lambda: now_s + 0.75)):
        parsed = json.loads(text) if text else None
        expected = encode_event(tail_chunk(options, parsed, open_choices, reason, request_id))
    got = front_cut_frame(endpoint, model, text, open_choices, reason, request_id, now_s)  # type: ignore[arg-type]
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(
    error=st.none() | st.dictionaries(st.text(max_size=8), VALUES, max_size=4),
    message=st.text(max_size=40),
    code=st.sampled_from(["backend_error", "backend_unavailable", "backend_rejected"]),
)
def test_in_band_error_frame_is_pythons(
    error: dict[str, Any] | None, message: str, code: str
) -> None:
    text = None if error is None else json.dumps(error, separators=(",", ":"))
    upstream = UpstreamError(502, code, message, error=error)
    expected = encode_event({"error": in_band_error(upstream)})
    assert front_in_band_error(text, message, code) == expected


def test_floats_are_written_as_python_writes_them() -> None:
    """The float layouts where Rust's own formatting differs from Python's `repr`."""
    values = [1e16, 1e15, 1.5e-7, 0.0001, 1e-05, -0.0, 5e-324, 1.7976931348623157e308, 123.0]
    template = json.dumps({"id": "x", "created": values, "model": "m"})
    options = ClientOptions("chat", "m", True)
    expected = encode_event(tail_chunk(options, json.loads(template), [0], "deadline", 1))
    assert front_cut_frame("chat", "m", template, [0], "deadline", 1, 0) == expected
    assert b"[1e+16,1000000000000000.0,1.5e-07,0.0001,1e-05,-0.0,5e-324," in expected


def test_a_cut_names_its_reason_where_the_contract_says() -> None:
    """The front's `x-llmflow-reason` on a cut whole reply follows `REFUSALS[r].cut`."""
    assert {r: front_cut_names_itself(r) for r in REFUSALS} == {
        r: rule.cut for r, rule in REFUSALS.items()
    }
    assert not front_cut_names_itself("completed")
