"""Prefix-sharing workloads: shared system prompts and multi-turn chats, as block hash ids.

vLLM caches KV blocks by chained hashes: a block's hash covers its parent's and its own tokens,
so two prompts share a block exactly while they share every token up to its end, and only full
blocks are hashed. A generated prompt here is a system prompt (one of a few, shared by every
chat that uses it), then its chat's history (each earlier turn's message and answer, resent),
then the new message. Its hash ids are one per full block: the system prompt's blocks are the
same ids in every chat that opens with it; a chat's later blocks are ids of that chat alone, the
same in every turn once full (the history only grows), so turn n+1 shares turn n's blocks. A
chat whose next prompt would pass `max_context` starts over as a new chat.

Turns of a chat arrive as the class's arrivals pick it (uniformly among `conversations`), so a
turn may come before the previous answer is done; with many chats that is rare, and it does not
change which blocks are shared.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmflow.sim.scenario import PrefixSpec

__all__ = ["block_id", "prefixed_prompts"]


def block_id(*key: object) -> int:
    """A stable id below 2**63 for a block (the core takes unsigned 64-bit ids)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest) >> 1


def prefixed_prompts(
    spec: PrefixSpec,
    messages: np.ndarray,
    answers: np.ndarray,
    rng: np.random.Generator,
    salt: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lengths and hash ids of requests whose new messages are `messages` and whose
    answers will be `answers` tokens, in arrival order.

    Args:
        spec: the class's prefix spec.
        messages: each request's new message (tokens).
        answers: each request's answer (tokens): it joins its chat's history.
        rng: the class's generator (picks each request's chat and each chat's system prompt).
        salt: (seed, class index), so ids differ between classes and seeds.

    Returns:
        (prompt tokens, an object array of hash-id tuples).
    """
    n, bt = messages.size, spec.block_tokens
    chat_of = rng.integers(0, spec.conversations, size=n)
    system_of = rng.integers(0, spec.system_prompts, size=spec.conversations)
    history = [0] * spec.conversations  # tokens after the system prompt
    epoch = [0] * spec.conversations  # bumped when a chat starts over
    prompts = np.empty(n, np.int64)
    ids = np.empty(n, dtype=object)
    system_blocks = [
        [block_id(salt, "system", s, j) for j in range(spec.system_tokens // bt)]
        for s in range(spec.system_prompts)
    ]
    for i in range(n):
        c, message = int(chat_of[i]), int(messages[i])
        if spec.system_tokens + history[c] + message > spec.max_context:
            history[c], epoch[c] = 0, epoch[c] + 1
        prompt = spec.system_tokens + history[c] + message
        full = prompt // bt
        own = range(spec.system_tokens // bt, full)
        head = system_blocks[int(system_of[c])][:full]
        ids[i] = (*head, *(block_id(salt, "chat", c, epoch[c], j) for j in own))
        prompts[i] = prompt
        history[c] += message + int(answers[i])
    return prompts, ids
