"""The gateway's chained block hashes: shared leading text gives shared leading hashes, one
changed byte changes its block's hash and every one after it, and a partial block has none."""

from __future__ import annotations

from llmflow.gateway.prefix import chain_hashes, completion_prefix_hashes
from llmflow.gateway.protocol import CompletionRequest


def test_a_shared_head_shares_hashes_and_a_change_breaks_the_chain() -> None:
    a = chain_hashes(b"x" * 64 + b"y" * 64 + b"z" * 10, 64)
    assert len(a) == 2  # the 10-byte tail is no full block
    b = chain_hashes(b"x" * 64 + b"y" * 64 + b"w" * 64, 64)
    assert (b[:2], len(b)) == (a, 3)
    c = chain_hashes(b"X" + b"x" * 63 + b"y" * 64, 64)
    assert not set(c) & set(a)  # the first block differs: so does every later hash
    assert all(0 <= h < 2**63 for h in a + b + c)


def test_equal_blocks_at_different_places_hash_differently() -> None:
    # Each block's hash covers its parent's: the same bytes twice give two hashes.
    first, second = chain_hashes(b"q" * 128, 64)
    assert first != second


def test_token_ids_hash_by_block_of_ids() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": list(range(40))})
    hashes = completion_prefix_hashes(request, block_size=16, bytes_per_token=4.0)
    assert len(hashes) == 2  # 40 ids: two full blocks of 16
    longer = CompletionRequest.model_validate({"model": "m", "prompt": list(range(48))})
    assert completion_prefix_hashes(longer, 16, 4.0)[:2] == hashes
