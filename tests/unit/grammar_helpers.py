"""What the structured-output tests share besides the fixtures in conftest.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_svc.structured_output import RequestGrammar

VOCAB = 520  # the model's logits: wider than the 512-token tokenizer, as padded vocabularies are
EOS = 2  # <|im_end|> in the default model's tokenizer


def ready(grammar: RequestGrammar) -> RequestGrammar:
    """``grammar`` once compiled (at most 30 s)."""
    grammar.future.result(timeout=30)
    assert grammar.ready()
    return grammar
