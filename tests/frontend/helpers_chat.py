"""What the chat-shaped tests share (chat with tools or reasoning, /v1/responses, /v1/messages):
a tiny tokenizer in Qwen's shape with a chat template of the test's choosing, the scripted engine
serving it, gateways started when first used, the SDK clients, and the script / prompt helpers.

The fixtures stay in each test module (their scope, template and engine speed are the module's);
their bodies are these functions."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import openai
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from tests.frontend.fake_engine import FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.tiny_tokenizer import EOS, build_tiny_tokenizer

K = TypeVar("K", bound=Hashable)
THINK_TAGS = ("<think>", "</think>")
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")


def qwen_tokenizer_dir(
    tmp_path_factory: pytest.TempPathFactory, name: str, template: str, think: bool = False
) -> Path:
    """The tiny tokenizer in Qwen's vocabulary shape: the tool-call tags as special tokens,
    with ``think`` the think tags as plain added tokens (Qwen3's); ``template`` its chat
    template."""
    directory = build_tiny_tokenizer(tmp_path_factory.mktemp(name))
    tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    if think:
        tok.add_tokens([AddedToken(t, special=False) for t in THINK_TAGS])
    tok.add_special_tokens([AddedToken(t, special=True) for t in TOOL_CALL_TAGS])
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def hf_tokenizer_of(directory: Path) -> HFTokenizer:
    return HFTokenizer.from_file(str(directory / "tokenizer.json"))


def serve_engine(directory: Path, hf_tok: HFTokenizer, **kwargs: Any) -> Iterator[FakeEngine]:
    """A scripted engine serving the tokenizer in ``directory`` (a 2048-token context unless
    ``kwargs`` say otherwise), stopped when the fixture ends: ``yield from`` it."""
    options: dict[str, Any] = {"max_model_len": 2048, **kwargs}
    e = FakeEngine(directory, [0], vocab_size=hf_tok.get_vocab_size(), **options)
    e.start()
    yield e
    e.stop()


def lazy_gateways(
    engine: FakeEngine, config: Callable[[K], dict[str, Any]]
) -> Iterator[dict[K, GatewayServer]]:
    """Gateways in front of ``engine`` by key, each started when first used with the
    ``GatewayServer`` options ``config(key)``, all stopped when the fixture ends."""
    started: dict[K, GatewayServer] = {}

    class Lazy(dict[K, GatewayServer]):
        def __missing__(self, key: K) -> GatewayServer:
            g = started[key] = GatewayServer(engine.address, **config(key)).start()
            g.wait_healthy()
            return g

    yield Lazy()
    for g in started.values():
        g.stop()


def openai_client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10)


def anthropic_client(gateway: GatewayServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=10)


def token_id(hf_tok: HFTokenizer, text: str) -> int:
    """The id of ``text``, one token in the vocabulary."""
    i = hf_tok.token_to_id(text)
    assert i is not None, text
    return int(i)


def script(engine: FakeEngine, hf_tok: HFTokenizer, text: str, eos: bool = True) -> list[int]:
    """Make the engine write ``text`` (then EOS unless ``eos`` is false); returns the ids of
    ``text``."""
    ids = list(hf_tok.encode(text, add_special_tokens=False).ids)
    engine.script = [*ids, token_id(hf_tok, EOS)] if eos else list(ids)
    return ids


def prompt_ids(engine: FakeEngine, request_id: str) -> list[int]:
    """The prompt the engine got for a request's (first) sequence."""
    return list(engine.add_messages[f"{request_id}-0"].prompt_token_ids)


def prompt_text(engine: FakeEngine, hf_tok: HFTokenizer, request_id: str) -> str:
    """That prompt as text, special tokens included."""
    return str(hf_tok.decode(prompt_ids(engine, request_id), skip_special_tokens=False))
