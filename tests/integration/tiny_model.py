"""Build a tiny random-weight Llama model that real vLLM can serve, with nothing from a hub.

The model is a ``LlamaForCausalLM`` (hidden 128, 2 layers, 2 heads, 1 KV head, vocab 4096,
2048 positions, ~1M parameters, ~4 MB in float32) with weights drawn from a fixed seed. The
tokenizer is a byte-level BPE trained locally with ``tokenizers`` on generated English-ish text,
wrapped as a ``PreTrainedTokenizerFast`` with a chat template, and saved in the same directory.

This module needs ``torch``, ``transformers`` and ``tokenizers``: it runs inside the vLLM venv
(see ``scripts/vllm_env.sh``), not in the project's main environment::

    $VENV/bin/python tests/integration/tiny_model.py DEST
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 1234
VOCAB_SIZE = 4096
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
MAX_POSITIONS = 2048

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]  # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORD_TEXT = (
    "the a an and or but of to in on at for with from by as is are was were be been has have "
    "had do does did not no yes this that these those it its they them their we our you your "
    "he she his her i me my time request token model server queue cache memory budget tenant "
    "priority latency throughput window limit rate batch prefill decode engine policy gateway "
    "simulator traffic user system data value number first last next small large fast slow "
    "good new old high low long short open close start stop send read write run wait move "
    "make take give find keep call show work help ask say tell think know want need use try "
    "world people water house school market city river light night morning evening question "
    "answer story music money family friend company country problem example reason result"
)
_SYLLABLE_TEXT = "ka lo mi ne ru ta sho ven dar pel quin zor bra tri gle fon"
_WORDS = _WORD_TEXT.split()
_SYLLABLES = _SYLLABLE_TEXT.split()


def _corpus(seed: int, lines: int = 20000) -> Iterator[str]:
    """Yield deterministic English-ish sentences (common words, invented words, digits)."""
    rng = random.Random(seed)
    for _ in range(lines):
        words: list[str] = []
        for _ in range(rng.randint(4, 18)):
            roll = rng.random()
            if roll < 0.80:
                words.append(rng.choice(_WORDS))
            elif roll < 0.92:
                words.append("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))))
            else:
                words.append(str(rng.randint(0, 10000)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "?", "!", ","])
        yield sentence


def build_tokenizer(dest: Path) -> None:
    """Train a byte-level BPE tokenizer (vocab ``VOCAB_SIZE``) and save it to ``dest``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(SEED), trainer=trainer)
    # Prepend BOS to every encoded sequence, like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, wanted {VOCAB_SIZE}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))


def build_model(dest: Path) -> None:
    """Save a random-weight ``LlamaForCausalLM`` (seed ``SEED``) to ``dest`` as safetensors."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(dest), safe_serialization=True)


def build_tiny_model(dest: Path) -> Path:
    """Write the tiny model and its tokenizer into ``dest`` (created if needed); return it."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    build_model(dest)
    build_tokenizer(dest)
    return dest


def main(argv: list[str]) -> int:
    """CLI entry point: ``python tiny_model.py DEST``; prints DEST when done."""
    if len(argv) != 2:
        print(f"usage: {argv[0]} DEST", file=sys.stderr)
        return 2
    print(build_tiny_model(Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
