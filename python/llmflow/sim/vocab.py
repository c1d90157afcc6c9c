"""The simulated vLLM's tokenizer: reversible token ids whose count is the server's prompt count.

A real tokenizer would need a vocabulary file; the simulated server only needs ids that are
deterministic, that decode back to the text, and whose number is the number of prompt tokens the
server charges for the same text. So a run of ASCII characters is cut into pieces of 4 (the last
may be shorter), each piece one token whose id packs its bytes, and every other character is a
token of its own whose id is its code point above the ASCII ids.
"""

from __future__ import annotations

__all__ = ["VOCAB_SIZE", "count", "detokenize", "tokenize"]

_PIECE = 4  # ASCII characters per token
_ASCII_IDS = 1 << (7 * _PIECE + 2)  # 4 chars of 7 bits, plus 2 bits for the piece's length
VOCAB_SIZE = _ASCII_IDS + 0x110000  # every ASCII piece, then every code point


def tokenize(text: str) -> list[int]:
    """The token ids of `text` (empty text has none)."""
    ids: list[int] = []
    run: list[str] = []
    for ch in text:
        if ord(ch) < 128:
            run.append(ch)
            if len(run) == _PIECE:
                ids.append(_piece_id(run))
                run = []
        else:
            if run:
                ids.append(_piece_id(run))
                run = []
            ids.append(_ASCII_IDS + ord(ch))
    if run:
        ids.append(_piece_id(run))
    return ids


def detokenize(ids: list[int]) -> str:
    """The text of token ids from `tokenize`.

    Raises:
        ValueError: an id outside the vocabulary.
    """
    out: list[str] = []
    for token in ids:
        if not 0 <= token < VOCAB_SIZE:
            raise ValueError(f"token id {token} is out of vocabulary (0 to {VOCAB_SIZE - 1})")
        if token >= _ASCII_IDS:
            out.append(chr(token - _ASCII_IDS))
            continue
        length = (token >> (7 * _PIECE)) + 1
        out.extend(chr((token >> (7 * i)) & 0x7F) for i in range(length))
    return "".join(out)


def count(text: str) -> int:
    """How many tokens `text` is, at least 1 (what the server charges for a prompt)."""
    return max(1, len(tokenize(text)))


def _piece_id(chars: list[str]) -> int:
    value = (len(chars) - 1) << (7 * _PIECE)
    for i, ch in enumerate(chars):
        value |= ord(ch) << (7 * i)
    return value
