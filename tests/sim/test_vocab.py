"""The simulated tokenizer: ids decode back to the text, and their number is the prompt count."""

from __future__ import annotations

import pytest

from llmflow.sim import vocab
from llmflow.sim.server import estimate_tokens


@pytest.mark.parametrize(
    "text", ["", "a", "abcd", "abcde", "你好", "ab中cd e", "tabs\tand\nnewlines", "🙂 emoji"]
)
def test_ids_decode_back_and_count_as_the_server_charges(text: str) -> None:
    ids = vocab.tokenize(text)
    assert vocab.detokenize(ids) == text
    assert all(0 <= i < vocab.VOCAB_SIZE for i in ids)
    assert estimate_tokens(text) == max(1, len(ids))


def test_runs_of_ascii_cost_a_token_per_four_characters() -> None:
    assert len(vocab.tokenize("x" * 17)) == 5
    assert len(vocab.tokenize("abc你def")) == 3


def test_an_id_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="out of vocabulary"):
        vocab.detokenize([vocab.VOCAB_SIZE])
