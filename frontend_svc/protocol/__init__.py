"""OpenAI request bodies: pydantic models that validate them (and document them: /openapi.json
is generated from the models), and the frozen dataclasses the gateway makes of them.

* ``models``: the bodies of /v1/completions, /v1/chat/completions, /tokenize, /detokenize
  (``chat_batch``: /v1/chat/completions/batch's);
  ``messages`` and ``structured``: their chat-message, tool and structured-output parts;
  ``fields``: the field types (ranges, token ids, string lists) they are made of;
  ``base``: the base model (extras ignored, null read as absent) and pydantic errors as 400s.
* ``requests``: the gateway's view of a request; ``parse``: body -> request (``parse_*``).
"""

from frontend_svc.protocol.models import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from frontend_svc.protocol.parse import (
    parse_chat,
    parse_chat_batch,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from frontend_svc.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Prompt,
    ResponseOptions,
    SamplingOptions,
    TokenizeRequest,
)

__all__ = [
    "MAX_BAD_WORD_CHARS",
    "MAX_BAD_WORDS",
    "MAX_CHOICES",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_STRINGS",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "Prompt",
    "ResponseOptions",
    "SamplingOptions",
    "TokenizeRequest",
    "parse_chat",
    "parse_chat_batch",
    "parse_completion",
    "parse_detokenize",
    "parse_tokenize",
]
