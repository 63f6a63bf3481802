"""A tiny byte-level BPE tokenizer built locally (no downloads) for the gateway tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [BOS, EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('Conversations cannot start with a tool message.') }}"
    "{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Deliberately without "☕": that character stays three separate byte tokens.
_CORPUS = """
Hello world! The quick brown fox jumps over the lazy dog. A tiny model says hello to the world.
Tandem serves language models: a gateway speaks HTTP, an engine speaks gRPC and runs the model.
The engine batches requests, the gateway detokenizes tokens into text and streams it back.
Café, naïve, résumé, 日本語のテキスト, emoji and other bytes make byte-level BPE interesting.
user assistant system: what is the answer? The answer is forty-two. Stop here. END of text.
"""


def build_tiny_tokenizer(directory: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
