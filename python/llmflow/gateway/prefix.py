"""The prompt's chained block hashes, which a `prefix` routing pool routes on.

vLLM hashes a prompt's token ids block by block (`hash_block_tokens` in
`vllm/v1/core/kv_cache_utils.py`): each full block's hash covers its parent block's hash and its
own tokens, so two prompts share a block hash exactly while they share everything up to the end
of that block, and a partial last block gets none. The gateway has no tokenizer, so it applies
the same chaining to the prompt's UTF-8 bytes in fixed chunks of `block_size x bytes_per_token`
bytes (an approximation of a block's tokens): prompts that share a leading text share leading
hashes, which is all routing needs (the hashes never have to equal vLLM's). Token-id prompts are
hashed by their ids, a block of `block_size` ids at a time, as vLLM does.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llmflow._core import prefix_hashes

if TYPE_CHECKING:
    from llmflow.gateway.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["chain_hashes", "chat_prefix_hashes", "completion_prefix_hashes"]

_MAX_BLOCKS = 4096  # a chain longer than any KV cache holds routes no better


def chain_hashes(data: bytes, chunk: int) -> list[int]:
    """Chained hashes of `data`'s full chunks of `chunk` bytes (a partial tail gets none), each
    below 2**63; computed in the core (`llmflow._core.prefix_hashes`), keyed with this
    process's random key: the hashes reach the trace file, and an unkeyed hash of a short
    secret in a prompt (a PIN) would give it away to anyone who tries every value."""
    return prefix_hashes(data, chunk, _MAX_BLOCKS, keyed=True)


def chat_prefix_hashes(
    request: ChatCompletionRequest, block_size: int, bytes_per_token: float
) -> list[int]:
    """Block hashes of a chat prompt: its messages in order, each as role then content, the
    way a chat template lays them out (a resent history shares its leading blocks)."""
    parts = []
    for message in request.messages:
        parts.append(f"<{message.role}>".encode())
        parts.append(_content_bytes(message.content))
    return chain_hashes(b"".join(parts), _chunk(block_size, bytes_per_token))


def completion_prefix_hashes(
    request: CompletionRequest, block_size: int, bytes_per_token: float
) -> list[int]:
    """Block hashes of a completion prompt: text by bytes, token ids by `block_size` ids."""
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return chain_hashes(prompt.encode("utf-8"), _chunk(block_size, bytes_per_token))
    ids = b"".join(int(t).to_bytes(4, "little") for t in prompt)
    return chain_hashes(ids, 4 * block_size)


def _chunk(block_size: int, bytes_per_token: float) -> int:
    return max(1, round(block_size * bytes_per_token))


def _content_bytes(content: str | list[dict[str, Any]] | None) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode("utf-8")
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode("utf-8")
