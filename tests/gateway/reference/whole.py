"""The Python path's assembly of a non-streamed reply, kept as the reference model of the
native front's (`rust/src/front/whole.rs`, `_core.front_whole_reply`): the property tests fold
random streams through both. It served non-streamed completions until the native front served
every one; nothing in the product calls it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmflow.gateway.streaming import ClientOptions
    from llmflow.gateway.types import Json

__all__ = ["Accumulator"]


def _fields(names: str) -> tuple[str, ...]:
    return tuple(names.split())


# vLLM's non-streamed reply, field by field and in its order (its protocol models, 0.32:
# `CompletionResponse`, `ChatCompletionResponse`, their choices, `ChatMessage`, `UsageInfo`).
# A non-streamed reply is assembled from the stream; each field takes what the stream carried,
# and the fields only a non-streamed answer has get vLLM's own default (null): `service_tier`
# (vLLM never sets it), `kv_transfer_params`/`ec_transfer_params` (a connector's answer to the
# request's own transfer params, which the gateway strips), `routed_experts`. What vLLM
# computes only unstreamed (`prompt_logprobs`) is asked unstreamed (`Prepared.unstreamed`).
_TOP = {
    "completions": _fields(
        "id object created model choices service_tier system_fingerprint usage "
        "kv_transfer_params ec_transfer_params metrics"
    ),
    "chat": _fields(
        "id object created model choices service_tier system_fingerprint usage "
        "prompt_logprobs prompt_token_ids prompt_text kv_transfer_params ec_transfer_params "
        "metrics"
    ),
}
_CHOICE = {
    "completions": _fields(
        "index text logprobs finish_reason stop_reason token_ids prompt_logprobs "
        "prompt_token_ids routed_experts"
    ),
    "chat": _fields("index message logprobs finish_reason stop_reason token_ids routed_experts"),
}
_MESSAGE = _fields("role content refusal annotations audio function_call reasoning")
_USAGE = _fields(
    "prompt_tokens total_tokens completion_tokens prompt_tokens_details completion_tokens_details"
)
_FRAME = frozenset({"id", "object", "created", "model", "choices", "usage", "llmflow"})
_FOLDED = frozenset({"index", "text", "delta", "logprobs", "finish_reason", "token_ids"})
_REASONING = ("reasoning", "reasoning_content")  # vLLM's delta names the reasoning either way


class Accumulator:
    """Builds the non-streaming reply from the chunks of an upstream stream, in the shape vLLM
    gives an unstreamed request (every field of it; see `_TOP`).

    Args:
        options: the client's endpoint, model and choice count (`n`, times the prompts of a
            batch).
    """

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self._choices: dict[int, Json] = {}
        self.template: Json | None = None
        self.marker: Json | None = None
        self._extra: Json = {}  # top-level fields the stream carried (system_fingerprint, ...)

    def open_choices(self) -> list[int]:
        """Indexes of choices that have not finished (all of `n` before any arrived)."""
        seen = [i for i, c in sorted(self._choices.items()) if c.get("finish_reason") is None]
        unseen = [i for i in range(self.options.n) if i not in self._choices]
        return sorted(seen + unseen)

    def add(self, chunk: Json) -> None:
        """Fold one chunk in (text, tool calls, logprobs, token ids, finish reasons, the
        fields only some chunks carry, the marker)."""
        if self.template is None and "id" in chunk:
            self.template = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if "llmflow" in chunk:
            self.marker = chunk["llmflow"]
        for key, value in chunk.items():
            if key not in _FRAME and value is not None:
                self._extra[key] = value
        for choice in chunk.get("choices") or ():
            acc = self._choices.setdefault(
                choice.get("index", 0), {"text": [], "tools": {}, "reasoning": [], "extra": {}}
            )
            _fold(acc, choice)

    def response(self, usage: Json | None) -> Json:
        """The complete `chat.completion` or `text_completion` object."""
        endpoint = "chat" if self.options.endpoint == "chat" else "completions"
        base = self.template or {
            "id": "llmflow",
            "created": int(time.time()),
            "model": self.options.model,
        }
        empty: Json = {"text": [], "tools": {}, "reasoning": [], "extra": {}}
        choices = [
            _finish_choice(i, self._choices.get(i, empty), endpoint)
            for i in sorted(set(self._choices) | set(range(self.options.n)))
        ]
        known: Json = {
            **self._extra,
            **base,
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "choices": choices,
            "usage": None if usage is None else {k: usage.get(k) for k in _USAGE} | usage,
        }
        body: Json = {key: known.get(key) for key in _TOP[endpoint]}
        body.update((k, v) for k, v in known.items() if k not in body)  # newer vLLM fields
        if self.marker is not None:
            body["llmflow"] = self.marker
        return body


def _fold(acc: Json, choice: Json) -> None:
    delta = choice.get("delta")
    if delta is None:
        text = choice.get("text")
        acc["text"].append(text if isinstance(text, str) else "")
    delta = delta or {}
    content = delta.get("content")
    if isinstance(content, str):
        acc["text"].append(content)
    for key in _REASONING:
        if isinstance(delta.get(key), str):
            acc["reasoning"].append(delta[key])
    for call in delta.get("tool_calls") or ():
        slot = acc["tools"].setdefault(call.get("index", 0), {"function": {"arguments": ""}})
        for key in ("id", "type"):
            if call.get(key):
                slot[key] = call[key]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] = function["name"]
        slot["function"]["arguments"] += function.get("arguments") or ""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        merged = acc.setdefault("logprobs", {})
        for key, value in logprobs.items():
            merged.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        acc.setdefault("token_ids", []).extend(token_ids)
    if choice.get("finish_reason") is not None:
        acc["finish_reason"] = choice["finish_reason"]
    if "stop_reason" in choice:
        acc["stop_reason"] = choice["stop_reason"]
    for key, value in choice.items():  # prompt_token_ids (first chunk), and newer fields
        if key not in _FOLDED and key != "stop_reason" and value is not None:
            acc["extra"][key] = value


def _finish_choice(index: int, acc: Json, endpoint: str) -> Json:
    text = "".join(acc["text"])
    known: Json = {
        **acc["extra"],
        "index": index,
        "logprobs": acc.get("logprobs"),
        "finish_reason": acc.get("finish_reason"),
        "stop_reason": acc.get("stop_reason"),
        "token_ids": acc.get("token_ids"),
    }
    if endpoint == "chat":
        message: Json = {key: None for key in _MESSAGE}
        message.update(role="assistant", content=text)
        if acc["reasoning"]:
            message["reasoning"] = "".join(acc["reasoning"])
        if acc.get("tools"):  # vLLM leaves the key out when there are none
            message["tool_calls"] = [acc["tools"][k] for k in sorted(acc["tools"])]
        known["message"] = message
    else:
        known["text"] = text
    out: Json = {key: known.get(key) for key in _CHOICE[endpoint]}
    out.update((k, v) for k, v in known.items() if k not in out)
    return out
