"""Chunk logic: token counting, usage shaping, coalescing, assembling, the truncation tail."""

from __future__ import annotations

import json
from typing import Any

from llmflow.gateway.protocol import ChatCompletionRequest, CompletionRequest
from llmflow.gateway.streaming import (
    ChunkParser,
    ClientOptions,
    merge_chunks,
    notice_for,
    tail_chunk,
)
from llmflow.gateway.tokens import chat_prompt_tokens, completion_prompt_tokens, text_tokens

from .reference.whole import Accumulator

CHAT = ClientOptions("chat", "m", stream=True)


def _chat(
    text: str | None = None, finish: str | None = None, index: int = 0, **delta: Any
) -> dict[str, Any]:
    if text is not None:
        delta["content"] = text
    return {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}


def test_parser_counts_tokens_from_continuous_usage_and_hides_it() -> None:
    parser = ChunkParser(CHAT)
    role = {**_chat(role="assistant", content=""), "usage": _usage(0)}
    assert parser.feed(json.dumps(role).encode()) == (_chat(role="assistant", content=""), 0)
    chunk, n = parser.feed(json.dumps({**_chat("ab"), "usage": _usage(3)}).encode())
    assert (n, "usage" in (chunk or {})) == (3, False)
    final, n = parser.feed(json.dumps({**_chat(), "choices": [], "usage": _usage(3)}).encode())
    assert (final, n, parser.usage) == (None, 0, _usage(3))


def test_a_last_chunk_takes_the_fingerprint_of_the_usage_chunk_behind_it() -> None:
    # vLLM stamps system_fingerprint on a stream's last chunk when the client asked no usage;
    # upstream (always asked for usage) puts it on the usage chunk, which the client does not get
    parser = ChunkParser(ClientOptions("chat", "m", stream=True, n=2))
    first, _ = parser.feed(json.dumps({**_chat("a", finish="stop"), "usage": _usage(1)}).encode())
    other, _ = parser.feed(json.dumps({**_chat("b", index=1), "usage": _usage(2)}).encode())
    assert first is None  # held: choice 0 finished
    assert other == _chat("b", index=1)
    assert parser.take_held() == []
    usage = {**_chat(), "choices": [], "usage": _usage(2), "system_fingerprint": "fp-1"}
    assert parser.feed(json.dumps(usage).encode()) == (None, 0)
    (held,) = parser.take_held()
    assert held == {**_chat("a", finish="stop"), "system_fingerprint": "fp-1"}
    ended = ChunkParser(ClientOptions("chat", "m", stream=True))
    ended.feed(json.dumps(_chat("a", finish="length")).encode())
    assert ended.take_held(every=True) == [_chat("a", finish="length")]  # never lost
    asked = ChunkParser(ClientOptions("chat", "m", stream=True, include_usage=True))
    chunk, _ = asked.feed(json.dumps(_chat("a", finish="stop")).encode())
    assert chunk == _chat("a", finish="stop")  # the usage chunk carries it for this client


def test_parser_without_usage_counts_one_token_per_text_delta() -> None:
    parser = ChunkParser(ClientOptions("completions", "m", stream=True))
    for text in ("a", "", "b"):
        parser.feed(json.dumps({"choices": [{"index": 0, "text": text}]}).encode())
    assert parser.completion_tokens == 2


def test_parser_keeps_usage_shape_the_client_asked_for() -> None:
    asked = ChunkParser(ClientOptions("chat", "m", stream=True, include_usage=True))
    chunk, _ = asked.feed(json.dumps({**_chat("a"), "usage": _usage(1)}).encode())
    assert chunk is not None
    assert "usage" not in chunk  # as vLLM streams it: usage only on the final chunk
    final, _ = asked.feed(json.dumps({**_chat(), "choices": [], "usage": _usage(1)}).encode())
    assert final is not None
    assert final["usage"] == _usage(1)
    continuous = ChunkParser(ClientOptions("chat", "m", True, 1, True, True))
    chunk, _ = continuous.feed(json.dumps({**_chat("a"), "usage": _usage(1)}).encode())
    assert chunk is not None
    assert chunk["usage"] == _usage(1)


def test_merge_concatenates_text_and_keeps_the_last_finish_reason() -> None:
    merged = merge_chunks(
        [_chat(role="assistant", content=""), _chat("a"), _chat("b"), _chat("c", finish="stop")]
    )
    assert merged == [_chat(role="assistant", content="abc", finish="stop")]


def test_merge_never_crosses_a_finished_choice_tool_calls_or_errors() -> None:
    tool = _chat(tool_calls=[{"index": 0, "function": {"name": "f"}}])
    assert len(merge_chunks([_chat("a", finish="stop"), _chat("b")])) == 2
    assert len(merge_chunks([_chat("a"), tool, _chat("b")])) == 3
    assert len(merge_chunks([_chat("a"), {"error": {"message": "x"}}])) == 2


def test_merge_combines_interleaved_choices_by_index() -> None:
    merged = merge_chunks([_chat("a", index=0), _chat("x", index=1), _chat("b", index=0)])
    (chunk,) = merged
    assert [(c["index"], c["delta"]["content"]) for c in chunk["choices"]] == [(0, "ab"), (1, "x")]


def test_accumulator_builds_a_chat_completion_with_tools_and_the_marker() -> None:
    acc = Accumulator(ClientOptions("chat", "m", stream=False, n=2))
    acc.add(_chat(role="assistant", content="Hel"))
    acc.add(_chat("lo", finish="stop"))
    acc.add(
        _chat(
            index=1,
            tool_calls=[
                {
                    "index": 0,
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a"'},
                }
            ],
        )
    )
    acc.add(_chat(index=1, tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]))
    assert acc.open_choices() == [1]
    acc.add(tail_chunk(acc.options, acc.template, acc.open_choices(), "deadline", 7))
    body = acc.response({"completion_tokens": 3})
    assert body["object"] == "chat.completion"
    assert body["id"] == "x"
    first, second = body["choices"]
    none = dict.fromkeys(("refusal", "annotations", "audio", "function_call", "reasoning"))
    assert first["message"] == {"role": "assistant", "content": "Hello", **none}  # vLLM's shape
    assert first["finish_reason"] == "stop"
    assert second["message"]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert second["message"]["content"] == notice_for("deadline")
    assert second["finish_reason"] == "length"
    assert body["llmflow"] == {"truncated": True, "reason": "deadline"}


def test_tail_for_completions_without_any_upstream_chunk() -> None:
    options = ClientOptions("completions", "m", stream=True, n=1)
    tail = tail_chunk(options, None, [0], "first_token_timeout", 9)
    assert tail["id"] == "cmpl-llmflow-9"
    assert tail["object"] == "text_completion"
    assert tail["choices"][0]["text"] == notice_for("first_token_timeout")


def test_prompt_estimates() -> None:
    assert text_tokens("abcd" * 10, 4.0) == 10
    assert text_tokens("漢字", 4.0) == 2  # 6 UTF-8 bytes
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "abcd"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "abcdabcd"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                    ],
                },
            ],
        }
    )
    assert chat_prompt_tokens(chat, 4.0) == 3 + (4 + 1) + (4 + 2 + 576)
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2, 3]]})
    assert completion_prompt_tokens(ids, 4.0) == 3


def test_passthrough_cuts_usage_from_vllm_frames_without_reparsing() -> None:
    parser = ChunkParser(CHAT)
    first = {**_chat(role="assistant", content=""), "usage": _usage(0)}
    assert isinstance(parser.feed(json.dumps(first).encode())[0], dict)  # learns the template
    raw = json.dumps({**_chat("ab"), "usage": _usage(2)}, separators=(",", ":")).encode()
    frame, n = parser.feed(raw)
    assert isinstance(frame, bytes)
    assert n == 2
    assert json.loads(frame.removeprefix(b"data: ")) == _chat("ab")
    last = json.dumps({**_chat("c", finish="stop"), "usage": _usage(3)}, separators=(",", ":"))
    frame, n = parser.feed(last.encode())
    assert n == 1
    assert parser.finished == {0}
    spaced = json.dumps({**_chat("d"), "usage": _usage(4)}).encode()  # not vLLM's layout
    chunk, n = parser.feed(spaced)
    assert chunk == _chat("d")
    assert n == 1


def test_passthrough_drops_the_usage_when_the_client_asked_for_usage() -> None:
    parser = ChunkParser(ClientOptions("chat", "m", stream=True, include_usage=True))
    parser.feed(json.dumps(_chat(role="assistant")).encode())
    raw = json.dumps({**_chat("a"), "usage": _usage(1)}, separators=(",", ":")).encode()
    frame, _ = parser.feed(raw)
    assert isinstance(frame, bytes)
    assert "usage" not in json.loads(frame.removeprefix(b"data: "))


def test_merging_the_tail_keeps_the_truncation_marker() -> None:
    tail = tail_chunk(CHAT, {"id": "x", "created": 1, "model": "m"}, [0], "deadline", 1)
    (merged,) = merge_chunks([_chat("a"), tail])
    assert isinstance(merged, dict)
    assert merged["llmflow"] == {"truncated": True, "reason": "deadline"}
    assert merged["choices"][0]["delta"]["content"] == "a" + notice_for("deadline")
    assert merged["choices"][0]["finish_reason"] == "length"
