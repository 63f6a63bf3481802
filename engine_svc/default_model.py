"""The embedded default model: a deterministic tiny random-weight Llama with a byte-level BPE
tokenizer trained here on a few paragraphs, and a ChatML chat template.

It exists so the whole system runs on a fresh machine with no network and no weights. Its text
is gibberish by nature.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine_svc import envs

logger = logging.getLogger(__name__)

VERSION = "v1"
NAME = "tandem-tiny-llama"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = """
Tandem serves large language models through two services: a gateway that speaks the OpenAI API
and an engine that owns the accelerator. The gateway validates requests, applies chat templates,
tokenizes text and streams token ids to the engine over one bidirectional gRPC stream. The engine
schedules every request under one token budget, keeps attention keys and values in a paged cache
of fixed-size blocks, reuses blocks whose prefix it has seen before, and sends new tokens back
after every step. Hello world! The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5
6 7 8 9 10 100 1000. Punctuation, quotes "like this", and questions? Yes; no: maybe. Café, naïve,
東京, Привет, 🙂 — unicode text must survive a round trip through bytes.
"""


def default_model_dir() -> Path:
    return envs.cache_dir() / f"{NAME}-{VERSION}"


def ensure_default_model() -> Path:
    """Build the default model once (atomically) and return its directory."""
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_default_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning(
        "serving the embedded default model %s (random weights: its text is not meaningful); "
        "pass --model PATH for a real checkpoint",
        target,
    )
    return target


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on the embedded corpus; write tokenizer files. Returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return int(tok.get_vocab_size())


def build_default_model(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = build_tokenizer(out_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
