"""Build the real-engine tier's model: a tiny random-weight Llama and a tokenizer trained here.

Run with the vLLM venv's python (it has ``torch``, ``transformers`` and ``tokenizers``)::

    python tests/real/build_tiny_model.py DIR

Nothing is downloaded. The tokenizer is a byte-pair encoding trained on seeded pseudo-words
(printable ASCII only, so every token decodes to valid text), padded to exactly the model's
vocabulary; the weights are ``torch.manual_seed(0)`` random. Same script, same files.
"""

from __future__ import annotations

import random
import string
import sys
from pathlib import Path

VOCAB_SIZE = 32000
SEED = 0
# ~15 M parameters: most are the two 32000 x 288 embedding matrices
HIDDEN, LAYERS, HEADS, INTERMEDIATE = 288, 6, 6, 768
MAX_POSITIONS = 2048
SPECIAL = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus(rng: random.Random, lines: int = 60000) -> list[str]:
    """Sentences of pseudo-words (consonant-vowel syllables), digits and punctuation."""
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels] + list(vowels)
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(40000)]
    words += ["the", "a", "of", "and", "to", "is", "in", "you", "hello", "world", "tell", "me"]
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
        out.append(sentence.capitalize() + rng.choice(".,!?") + " " + str(rng.randint(0, 999)))
    return out


def build_tokenizer(directory: Path) -> int:
    """Train, pad to :data:`VOCAB_SIZE` and save the tokenizer; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet) + 1,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    missing = VOCAB_SIZE - len(fast)
    if missing > 0:  # every id the model can sample must decode
        fast.add_tokens([f"<x{i}>" for i in range(missing)])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(directory)
    return len(fast)


def build_model(directory: Path) -> int:
    """Save a seeded random-weight Llama in Hugging Face format; return its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    size = build_tokenizer(directory)
    if size != VOCAB_SIZE:
        print(f"tokenizer has {size} tokens, the model {VOCAB_SIZE}", file=sys.stderr)
        return 1
    params = build_model(directory)
    print(f"tiny llama: {params / 1e6:.1f} M parameters, {size} tokens, in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
