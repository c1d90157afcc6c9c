"""Chunk logic of the stream: parse, count tokens, coalesce, and the truncation tail.

Pure functions and small classes over OpenAI chunk dicts; no I/O. Coalescing merges consecutive
chunks only when the result is itself a valid chunk (text deltas of open choices); anything else
(tool calls, a choice that already finished) stays a chunk of its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from llmflow.gateway.types import Endpoint, Json

__all__ = [
    "ChunkParser",
    "ClientOptions",
    "Item",
    "merge_chunks",
    "notice_for",
    "parse_item",
    "tail_chunk",
]

Item = Union["Json", bytes]
"""A chunk on its way to a client: a dict, or an SSE frame kept as upstream wrote it."""

_DIGITS = frozenset(b"0123456789 ")
_TEXT_DELTAS = frozenset({"content", "reasoning_content", "reasoning"})
# A choice's fields that a merge carries (any other, such as `token_ids`, keeps it apart).
_MERGEABLE = frozenset({"index", "delta", "text", "finish_reason", "logprobs", "stop_reason"})
NOTICES = {  # visible text appended when the gateway cuts a reply
    "deadline": "\n\n[llmflow: reply truncated: the request reached its total deadline]",
    "first_token_timeout": "[llmflow: the model did not start answering in time; please retry]",
    "shutdown": "\n\n[llmflow: reply truncated: the gateway is shutting down]",
}


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """What the client asked for that changes the shape of the reply."""

    endpoint: Endpoint
    model: str
    stream: bool
    n: int = 1
    include_usage: bool = False
    continuous_usage: bool = False


def notice_for(reason: str) -> str:
    """The visible notice for a cut reply."""
    return NOTICES.get(reason, f"\n\n[llmflow: reply truncated ({reason})]")


def parse_item(item: Item) -> Json:
    """The chunk dict of an item (frames are parsed)."""
    if isinstance(item, bytes):
        parsed: Json = json.loads(item[6:-2])
        return parsed
    return item


class ChunkParser:
    """Reads upstream payloads: counts new tokens and shapes chunks for the client.

    Upstream is always asked for continuous usage stats, so each chunk states the tokens
    generated so far; chunks without usage count one token per text delta.

    Args:
        options: the client's requested shape (usage reporting in particular).
    """

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.completion_tokens = 0
        self.usage: Json | None = None
        self.template: Json | None = None  # id/created/model of the upstream reply
        self.finished: set[int] = set()  # indexes of choices that sent a finish_reason
        # Byte-level passthrough: one-choice streams whose usage need not reach the client.
        self._fast = options.stream and options.n == 1 and not options.continuous_usage
        # A stream whose client asked for no usage: vLLM stamps `system_fingerprint` on each
        # finishing chunk when no usage chunk follows, and upstream is always asked for one,
        # so a finishing chunk waits for the usage chunk behind it (`take_held`).
        self._hold = options.stream and not options.include_usage
        self._held: list[Json] = []
        self._stamped: list[Json] = []  # held chunks the usage chunk stamped: to send now

    def feed(self, data: bytes) -> tuple[Item | None, int]:
        """Read one `data:` payload.

        Returns:
            (what to forward, or None; tokens generated since the previous payload). On the
            passthrough path the item is the upstream frame with only its usage cut off.
        """
        if self._fast and self.template is not None:
            fast = self._passthrough(data)
            if fast is not None:
                return fast
        chunk: Any = json.loads(data)
        problem = _malformed(chunk)
        if problem is not None:
            raise MalformedChunk(f"backend sent {problem} in its stream")
        if self.template is None and "id" in chunk:
            self.template = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        usage = chunk.get("usage")
        new = self._count(chunk, usage)
        choices = chunk.get("choices")
        for choice in choices or ():
            if choice.get("finish_reason") is not None:
                self.finished.add(choice.get("index", 0))
        if isinstance(usage, dict):
            self.usage = usage
        if not choices and self._held and "error" not in chunk:
            fingerprint = chunk.get("system_fingerprint")
            if fingerprint is not None:
                for held in self._held:
                    held["system_fingerprint"] = fingerprint
            self._stamped, self._held = self._held, []
        if not choices:  # the usage-only chunk that ends an include_usage stream
            # A whole reply takes its top-level fields (`system_fingerprint`) from it too.
            keep = "error" in chunk or self.options.include_usage or not self.options.stream
            return (chunk if keep else None), new
        if not self.options.continuous_usage and "usage" in chunk:
            del chunk["usage"]  # vLLM sends a chunk no usage key unless continuous usage
        if self._hold and any(c.get("finish_reason") is not None for c in choices):
            self._held.append(chunk)
            return None, new
        return chunk, new

    def take_held(self, *, every: bool = False) -> list[Json]:
        """Finishing chunks to send now, before what `feed` returned: those the usage chunk
        stamped, and with `every` those still waiting (the stream ended, or is cut)."""
        out, self._stamped = self._stamped, []
        if every:
            out, self._held = out + self._held, []
        return out

    def _passthrough(self, data: bytes) -> tuple[bytes, int] | None:
        """vLLM puts continuous usage last: cut it off without parsing the chunk."""
        cut = data.rfind(b',"usage":{')
        if cut < 0 or not data.endswith(b"}}") or data.find(b"}", cut) != len(data) - 2:
            return None
        head = data[:cut]
        if b'"choices":[]' in head or b'"error"' in head:
            return None
        if self._hold and b'"finish_reason":"' in head:
            return None  # the last chunk waits for the fingerprint (`take_held`)
        at = data.find(b'"completion_tokens":', cut)
        if at < 0:
            return None
        start = end = at + 20  # len('"completion_tokens":')
        while end < len(data) and data[end] in _DIGITS:
            end += 1
        digits = data[start:end].strip()
        if not digits.isdigit():
            return None
        total = int(digits)
        new, self.completion_tokens = max(total - self.completion_tokens, 0), total
        if b'"finish_reason":"' in head:
            self.finished.add(0)
        return b"data: " + head + b"}\n\n", new

    def _count(self, chunk: Json, usage: Any) -> int:
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            total: int = usage["completion_tokens"]
            new = total - self.completion_tokens
            self.completion_tokens = total
            return max(new, 0)
        new = sum(1 for c in chunk.get("choices") or () if _text_of(c))
        self.completion_tokens += new
        return new


class MalformedChunk(ValueError):
    """A stream payload that is JSON but not a chunk (read wrong, its text would be lost)."""


def _malformed(chunk: Any) -> str | None:
    """What is wrong with a chunk's shape, if anything (`rust/src/relay/chunk.rs` checks the
    same): an object whose `choices` is a list of objects, each `delta` (when present) an
    object, and whose `usage` is an object."""
    if not isinstance(chunk, dict):
        return "a chunk that is not a JSON object"
    choices = chunk.get("choices")
    if choices is not None:
        if not isinstance(choices, list):
            return "choices that are not a list"
        for choice in choices:
            if not isinstance(choice, dict):
                return "a choice that is not an object"
            if not isinstance(choice.get("delta", {}), (dict, type(None))):
                return "a choice whose delta is not an object"
    if not isinstance(chunk.get("usage", {}), (dict, type(None))):
        return "usage that is not an object"
    return None


def _text_of(choice: Json) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return "".join(v for k, v in delta.items() if k in _TEXT_DELTAS and isinstance(v, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def merge_chunks(items: list[Item]) -> list[Item]:
    """Coalesce consecutive chunks into as few valid chunks as possible (order kept)."""
    if len(items) < 2:
        return items
    out: list[Item] = []
    for item in items:
        chunk = parse_item(item)
        if not out or not _merge_into(out[-1], chunk):  # type: ignore[arg-type]
            out.append(chunk)
    return out


def _merge_into(a: Json, b: Json) -> bool:
    choices_a, choices_b = a.get("choices"), b.get("choices")
    if not choices_a or not choices_b or a.get("object") != b.get("object") or "error" in b:
        return False
    by_index = {c.get("index", 0): c for c in choices_a}
    for cb in choices_b:
        ca = by_index.get(cb.get("index", 0))
        if ca is not None and not _choice_mergeable(ca, cb):
            return False
    for cb in choices_b:
        ca = by_index.get(cb.get("index", 0))
        if ca is None:
            choices_a.append(cb)
            by_index[cb.get("index", 0)] = cb
        else:
            _merge_choice(ca, cb)
    for key in ("usage", "llmflow"):  # the later chunk's usage, and the truncation marker
        if key in b:
            a[key] = b[key]
    return True


def _choice_mergeable(ca: Json, cb: Json) -> bool:
    if ca.get("finish_reason") is not None or ca.get("logprobs") or cb.get("logprobs"):
        return False
    if not isinstance(ca.get("delta", {}), dict) or not isinstance(cb.get("delta", {}), dict):
        return False  # a `"delta": null` (not vLLM's) goes out as it came, unmerged
    if not set(ca) | set(cb) <= _MERGEABLE:
        return False
    for key, value in (cb.get("delta") or {}).items():
        if key not in _TEXT_DELTAS and key != "role" and value not in (None, "", []):
            return False
    return all(
        k in _TEXT_DELTAS or k == "role" or v in (None, "", [])
        for k, v in (ca.get("delta") or {}).items()
    )


def _merge_choice(ca: Json, cb: Json) -> None:
    if "text" in cb:
        ca["text"] = (ca.get("text") or "") + (cb.get("text") or "")
    if "delta" in cb:
        delta = ca.setdefault("delta", {})
        for key, value in (cb["delta"] or {}).items():
            if key in _TEXT_DELTAS and isinstance(value, str):
                delta[key] = (delta.get(key) or "") + value
            elif key == "role":
                delta.setdefault("role", value)
    ca["finish_reason"] = cb.get("finish_reason")
    if "stop_reason" in cb:
        ca["stop_reason"] = cb["stop_reason"]


def tail_chunk(
    options: ClientOptions,
    template: Json | None,
    open_choices: list[int],
    reason: str,
    request_id: int,
) -> Json:
    """The chunk that ends a reply the gateway cut: the notice, a finish_reason, the marker.

    Args:
        options: the client's endpoint and model.
        template: id/created/model of the upstream reply, when one arrived.
        open_choices: indexes of choices still unfinished.
        reason: why it was cut (`deadline`, `first_token_timeout`, `shutdown`).
        request_id: the gateway's request id, for an id when upstream sent none.

    Returns:
        A valid chunk with a top-level `"llmflow": {"truncated": true, "reason": ...}`.
    """
    notice = notice_for(reason)
    chat = options.endpoint == "chat"
    base = template or {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-llmflow-{request_id}",
        "created": int(time.time()),
        "model": options.model,
    }
    choices = [
        {"index": i, "delta": {"content": notice}, "logprobs": None, "finish_reason": "length"}
        if chat
        else {"index": i, "text": notice, "logprobs": None, "finish_reason": "length"}
        for i in open_choices
    ]
    return {
        **base,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "choices": choices,
        "llmflow": {"truncated": True, "reason": reason},
    }
