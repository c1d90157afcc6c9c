"""Fuzz targets for the Python path's parsers of what a backend sends (issue 26): the SSE
de-framer (`gateway/sse_decode.py`) and the HTTP/1.1 response framing (`gateway/http1.py`).

Each is checked against a one-shot reference of the grammar, for generated inputs and every
way of cutting them into reads, with a bounded number of examples (seconds in `make test`);
the relay's SSE de-framer has the same targets as proptests in `rust/src/relay/sse.rs`. The
corpus of hand-picked inputs (`CORPUS`) runs every time, whatever hypothesis draws.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmflow.gateway.http1 import ProtocolError, _dechunk, chunk_size, content_length
from llmflow.gateway.sse_decode import EventTooLarge, SseDecoder

FUZZ = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

_TOKENS = st.sampled_from(
    [b"data: ", b"data:", b"\n", b"\r\n", b"\r", b"\n\n", b"\r\n\r\n", b": c", b"event: x",
     b"[DONE]", b" ", b'{"a":1}', b"x"]
)  # fmt: skip
sse_bytes = st.lists(_TOKENS | st.binary(max_size=6), max_size=40).map(b"".join)
cuts = st.lists(st.integers(min_value=0, max_value=10_000), max_size=6)


def reference_events(body: bytes) -> tuple[list[bytes], bool]:
    """The SSE grammar the gateway reads, at once: CRLF is LF, events end at a blank line,
    an unfinished event is none, only `data:` lines count, nothing after `[DONE]`."""
    text = body.replace(b"\r\n", b"\n")
    *complete, _rest = text.split(b"\n\n")
    out = []
    for block in complete:
        lines = [ln[5:].strip(b" \t") for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if not lines:
            continue
        data = b"\n".join(lines)
        if data == b"[DONE]":
            return out, True
        out.append(data)
    return out, False


def _pieces(body: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({p % (len(body) + 1) for p in points})
    edges = [0, *marks, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


CORPUS = [
    b"data: a\r\n\r\ndata: b\r\n\r\n",  # a CRLF split at every position (the cuts below)
    b"data: a\r\n\r",  # an event whose end has not come
    b"data: 1\ndata: 2\n\ndata: [DONE]\n\ndata: after\n\n",
    b": comment\n\nevent: x\n\ndata:x\n\n",
    b"\r\r\n\r\n\n\ndata: \r\n\r\n",
]


@FUZZ
@given(body=sse_bytes, points=cuts)
@example(body=CORPUS[0], points=[9, 10])
@example(body=CORPUS[0], points=[8])
@example(body=CORPUS[2], points=[3, 17])
@example(body=CORPUS[4], points=[1, 2, 3])
def test_sse_decoder_reads_any_cutting_of_a_body_as_the_whole(
    body: bytes, points: list[int]
) -> None:
    decoder = SseDecoder(max_event=1 << 20)
    got: list[bytes] = []
    for piece in _pieces(body, points):
        got += decoder.feed(piece)
    assert (got, decoder.done) == reference_events(body)


@FUZZ
@given(body=sse_bytes, limit=st.integers(1, 64), size=st.integers(1, 16))
def test_sse_decoder_never_holds_more_than_its_limit(body: bytes, limit: int, size: int) -> None:
    decoder = SseDecoder(max_event=limit)
    for at in range(0, len(body), size):
        try:
            decoder.feed(body[at : at + size])
        except EventTooLarge:
            assert decoder.pending == b""
            return
        assert len(decoder.pending) <= limit


@pytest.mark.parametrize("body", CORPUS)
def test_the_sse_corpus_at_every_single_cut(body: bytes) -> None:
    for cut in range(len(body) + 1):
        decoder = SseDecoder(1 << 20)
        got = decoder.feed(body[:cut]) + decoder.feed(body[cut:])
        assert (got, decoder.done) == reference_events(body), cut


# -- HTTP/1.1 framing ------------------------------------------------------------------------

_STRICT_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}[ \t]*(;.*)?", re.DOTALL)


@FUZZ
@given(line=st.binary(max_size=24) | st.sampled_from(
    [b"5", b"-5", b"+5", b"0x5", b"5_0", b" 5", b"5 ", b"5;ext=1", b"", b"ff" * 9, b"1\x00"]
))  # fmt: skip
def test_chunk_sizes_are_hex_digits_or_refused(line: bytes) -> None:
    if _STRICT_SIZE.fullmatch(line):
        assert chunk_size(line) == int(line.split(b";")[0].strip(b" \t"), 16)
    else:
        with pytest.raises(ProtocolError):
            chunk_size(line)


@FUZZ
@given(value=st.text(max_size=12) | st.sampled_from(["5", "-5", "+5", " 5", "5, 5", "", "0"]))
def test_content_lengths_are_digits_or_refused(value: str) -> None:
    if re.fullmatch(r"[0-9]{1,18}", value):
        assert content_length(value) == int(value)
    else:
        with pytest.raises(ProtocolError):
            content_length(value)


chunk_lists = st.lists(st.binary(min_size=1, max_size=40), max_size=8)


@FUZZ
@given(chunks=chunk_lists, points=cuts, ext=st.booleans())
def test_dechunking_any_cutting_gives_the_body(
    chunks: list[bytes], points: list[int], ext: bool
) -> None:
    suffix = b";x=1" if ext else b""
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(c), suffix, c) for c in chunks) + b"0\r\n\r\n"
    assert asyncio.run(_dechunked(_pieces(wire, points))) == b"".join(chunks)


@FUZZ
@given(wire=st.binary(max_size=200), points=cuts)
@example(wire=b"-5\r\nhello\r\n0\r\n\r\n", points=[])
@example(wire=b"0x5\r\nhello\r\n0\r\n\r\n", points=[])
@example(wire=b"5\r\nhelloXX0\r\n\r\n", points=[])
def test_dechunking_garbage_ends_in_an_error_never_a_hang(wire: bytes, points: list[int]) -> None:
    # what a backend that sends garbage gets is this stream's failure (or its bytes)
    with contextlib.suppress(ProtocolError, ConnectionError):
        asyncio.run(asyncio.wait_for(_dechunked(_pieces(wire, points)), 2))


async def _dechunked(pieces: list[bytes]) -> bytes:
    reader = asyncio.StreamReader()
    for piece in pieces:
        reader.feed_data(piece)
    reader.feed_eof()
    return b"".join([p async for p in _dechunk(reader)])


def test_a_size_line_without_end_is_refused_not_buffered() -> None:
    with pytest.raises(ProtocolError):
        asyncio.run(_dechunked([b"f" * 4096]))
