"""Prompt length before any backend is touched: exact for token ids, estimated for text.

The gateway has no tokenizer. Text is costed at `bytes_per_token` UTF-8 bytes per token (about 4
for English under BPE tokenizers, and 0.75 tokens per CJK character), plus a small per-message
overhead for chat templates. The estimate decides the 400 for prompts longer than the model's
context and the prompt size the core plans KV with; vLLM still checks the exact count.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmflow.gateway.protocol import ChatCompletionRequest, CompletionRequest

__all__ = [
    "chat_prompt_tokens",
    "completion_prompt_tokens",
    "completion_prompts_tokens",
    "text_tokens",
]

_PER_MESSAGE = 4  # role markers and separators a chat template adds around each message
_PER_CHAT = 3  # the assistant header that primes the reply
_PER_IMAGE = 576  # a typical vision encoder's patch count (LLaVA-1.5 at 336 px)


def text_tokens(text: str, bytes_per_token: float) -> int:
    """Estimated tokens in `text`: UTF-8 bytes divided by `bytes_per_token`, rounded up."""
    return math.ceil(len(text.encode("utf-8")) / bytes_per_token)


def chat_prompt_tokens(request: ChatCompletionRequest, bytes_per_token: float) -> int:
    """Estimated prompt tokens of a chat request, chat-template overhead included."""
    total = _PER_CHAT
    for message in request.messages:
        total += _PER_MESSAGE + _content_tokens(message.content, bytes_per_token)
    return total


def completion_prompt_tokens(request: CompletionRequest, bytes_per_token: float) -> int:
    """Prompt tokens of a completion request, every prompt of a batch together."""
    return sum(completion_prompts_tokens(request, bytes_per_token))


def completion_prompts_tokens(request: CompletionRequest, bytes_per_token: float) -> list[int]:
    """Prompt tokens of each prompt of a completion request (one, or each of a batch): exact
    for token ids, estimated for text."""
    return [
        text_tokens(p, bytes_per_token) if isinstance(p, str) else len(p) for p in request.prompts
    ]


def _content_tokens(content: str | list[dict[str, Any]] | None, bytes_per_token: float) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return text_tokens(content, bytes_per_token)
    total = 0
    for part in content:
        text = part.get("text")
        if isinstance(text, str):
            total += text_tokens(text, bytes_per_token)
        elif str(part.get("type", "")).startswith("image"):
            total += _PER_IMAGE
    return total
