"""The native front's non-streamed replies against the reference model's, on random streams.

The gateway streams every completion upstream; a client that asked for one JSON object gets
the stream folded into vLLM's unstreamed reply: by the native front, `rust/src/front/whole.rs`.
The reference folds it as the Python path did before the front served every request (with
`ChunkParser` and `tests/gateway/reference/whole.py`'s `Accumulator`) and renders it with
`JSONResponse`. Fed the same payloads (text and reasoning deltas, tool call
deltas, logprobs, token ids, finish and stop reasons, continuous usage, top-level fields, the
marker, a cut's tail naming the choices still open), for one choice or several (`n`, or the
prompts of a batch), both must give the same bytes, or both fail the request with the same
message.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

from fastapi.responses import JSONResponse
from hypothesis import given
from hypothesis import strategies as st
from tests.gateway.reference import whole
from tests.gateway.reference.whole import Accumulator

from llmflow._core import front_whole_reply
from llmflow.gateway import streaming
from llmflow.gateway.streaming import (
    NOTICES,
    ChunkParser,
    ClientOptions,
    MalformedChunk,
    parse_item,
    tail_chunk,
)

from .strategies import BAD_CHUNKS, JSON_VALUES, stream_chunks

_UNREAD = "the gateway could not read the backend's reply"  # `StreamSession._read`'s words


def python_reply(
    endpoint: str, model: str, payloads: list[bytes], cut: tuple[str, int] | None, n: int = 1
) -> bytes | str:
    """What `StreamSession` makes of the payloads for a client that did not stream: the
    response's body, or the message the request fails with."""
    options = ClientOptions(endpoint, model, False, n)  # type: ignore[arg-type]
    parser, accumulator = ChunkParser(options), Accumulator(options)
    for payload in payloads:
        try:
            chunk, _ = parser.feed(payload)
            if chunk is not None:
                accumulator.add(parse_item(chunk))
        except MalformedChunk as exc:
            return str(exc)
        except Exception:  # what `_read` turns into this request's failure
            return _UNREAD
    if cut is not None:
        open_choices = [i for i in range(options.n) if i not in parser.finished]
        if open_choices:
            reason, request_id = cut
            accumulator.add(tail_chunk(options, parser.template, open_choices, reason, request_id))
    return bytes(JSONResponse(accumulator.response(parser.usage)).body)


@st.composite
def streams(draw: Any) -> tuple[str, list[bytes]]:
    endpoint = draw(st.sampled_from(["chat", "completions"]))
    template = draw(st.none() | st.fixed_dictionaries(
        {"id": st.text(max_size=6)},
        optional={"created": st.integers(0, 2**40) | JSON_VALUES, "model": st.text(max_size=6)},
    ))
    chunks: list[Any] = draw(st.lists(stream_chunks(endpoint == "chat", template), max_size=6))
    bad = draw(st.sampled_from([None] * 18 + list(BAD_CHUNKS)))  # one stream in three
    if bad is not None:
        chunks.insert(draw(st.integers(0, len(chunks))), bad)
    ascii_ = draw(st.booleans())
    return endpoint, [json.dumps(c, ensure_ascii=ascii_).encode() for c in chunks]


@given(
    stream=streams(),
    model=st.text(max_size=8),
    cut=st.none() | st.tuples(
        st.sampled_from(sorted(NOTICES)) | st.text(max_size=8), st.integers(0, 2**64 - 1)
    ),
    now_s=st.integers(0, 2**40),
    n=st.sampled_from([1, 1, 2, 3]),
)
def test_the_native_whole_reply_is_the_reference_models(
    stream: tuple[str, list[bytes]], model: str, cut: tuple[str, int] | None, now_s: int, n: int
) -> None:
    endpoint, payloads = stream
    clock = SimpleNamespace(time=lambda: now_s + 0.75)
    with patch.object(streaming, "time", clock), patch.object(whole, "time", clock):
        expected = python_reply(endpoint, model, payloads, cut, n)
    got = front_whole_reply(endpoint, model, payloads, now_s, cut, n)  # type: ignore[arg-type]
    assert got == expected
