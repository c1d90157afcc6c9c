"""The relay's frames for a streaming client against the Python path's, on random streams.

The Python path shaped each upstream payload with `ChunkParser` and wrote what it returned
with `encode_item` (kept as the reference, `tests/gateway/reference/frames.py`); at the
stream's end it wrote the finishing chunks still held, and a cut wrote them and then the
notice for the choices still open (`StreamSession.on_cut`). The relay does the same in
`rust/src/relay/chunk.rs` (`ChunkShaper`). Fed the same payloads, for one choice or several,
with and without the usage chunk and continuous usage, both must write the same bytes (before
coalescing), or both fail the stream with the same message; and the frames that wait for the
flush interval coalesce into the same bytes (`merge_chunks`, the relay's `merge_frames`).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

from hypothesis import assume, given
from hypothesis import strategies as st
from tests.gateway.reference.frames import encode_event, encode_item

from llmflow._core import front_merge_frames, front_stream_frames
from llmflow.gateway import streaming
from llmflow.gateway.streaming import (
    NOTICES,
    ChunkParser,
    ClientOptions,
    MalformedChunk,
    merge_chunks,
    tail_chunk,
)

from .strategies import BAD_CHUNKS, JSON_VALUES, stream_chunks


def python_frames(
    endpoint: str,
    model: str,
    payloads: list[bytes],
    usage: tuple[bool, bool],
    n: int,
    cut: tuple[str, int] | None,
) -> bytes | str:
    """What `StreamSession` writes for a streaming client (`_stream_from`, `on_cut`), before
    the window coalesces it, or the message the stream fails with."""
    include_usage, continuous = usage
    options = ClientOptions(endpoint, model, True, n, include_usage, continuous)  # type: ignore[arg-type]
    parser = ChunkParser(options)
    out: list[bytes] = []
    for payload in payloads:
        try:
            chunk, _ = parser.feed(payload)
        except MalformedChunk as exc:
            return str(exc)
        out += [encode_item(held) for held in parser.take_held()]
        if chunk is not None:
            out.append(encode_item(chunk))
    out += [encode_item(held) for held in parser.take_held(every=True)]
    if cut is not None:
        open_choices = [i for i in range(n) if i not in parser.finished]
        if open_choices:
            reason, request_id = cut
            out.append(
                encode_event(tail_chunk(options, parser.template, open_choices, reason, request_id))
            )
    return b"".join(out)


@st.composite
def streams(draw: Any) -> tuple[str, list[bytes]]:
    """Chunks as vLLM writes them (compact, so the one-choice passthrough runs) or spaced, in
    UTF-8 or escaped, a malformed one in some."""
    endpoint = draw(st.sampled_from(["chat", "completions"]))
    template = draw(st.none() | st.fixed_dictionaries(
        {"id": st.text(max_size=6)},
        optional={"created": st.integers(0, 2**40) | JSON_VALUES, "model": st.text(max_size=6)},
    ))
    chunks: list[Any] = draw(st.lists(stream_chunks(endpoint == "chat", template), max_size=8))
    bad = draw(st.sampled_from([None] * 18 + list(BAD_CHUNKS)))
    if bad is not None:
        chunks.insert(draw(st.integers(0, len(chunks))), bad)
    ascii_ = draw(st.booleans())
    separators = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    return endpoint, [
        json.dumps(c, ensure_ascii=ascii_, separators=separators).encode() for c in chunks
    ]


@given(
    stream=streams(),
    model=st.text(max_size=8),
    usage=st.tuples(st.booleans(), st.booleans()),
    n=st.sampled_from([1, 1, 2, 3]),
    cut=st.none() | st.tuples(
        st.sampled_from(sorted(NOTICES)) | st.text(max_size=8), st.integers(0, 2**64 - 1)
    ),
    now_s=st.integers(0, 2**40),
)
def test_the_relays_frames_are_the_python_paths(
    stream: tuple[str, list[bytes]],
    model: str,
    usage: tuple[bool, bool],
    n: int,
    cut: tuple[str, int] | None,
    now_s: int,
) -> None:
    endpoint, payloads = stream
    with patch.object(streaming, "time", SimpleNamespace(time=lambda: now_s + 0.75)):
        expected = python_frames(endpoint, model, payloads, usage, n, cut)
    got = front_stream_frames(endpoint, model, payloads, now_s, *usage, n, cut)  # type: ignore[arg-type]
    assert got == expected


@st.composite
def waiting_items(draw: Any) -> list[Any]:
    """What waits for the flush interval: chunks of one stream (several choices, some open,
    some finished), as dicts the parser shaped or frames it passed through."""
    chat = draw(st.booleans())
    template = {"id": "c", "created": 1, "model": "m"}
    chunks = draw(st.lists(stream_chunks(chat, template), max_size=6))
    return [
        encode_event(chunk) if draw(st.booleans()) else chunk for chunk in chunks
    ]


@given(items=waiting_items())
def test_the_relays_coalescing_is_the_python_paths(items: list[Any]) -> None:
    frames = [encode_item(item) for item in items]
    try:
        merged = merge_chunks(copy.deepcopy(items))
    except TypeError:  # text that is not text: Python cannot join it (vLLM sends text)
        assume(False)
    assert front_merge_frames(frames) == [encode_item(item) for item in merged]
