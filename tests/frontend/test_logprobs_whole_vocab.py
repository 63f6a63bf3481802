"""``top_logprobs: -1`` / ``prompt_logprobs: -1`` / completions ``logprobs: -1``: the whole
vocabulary, as vLLM has them, when the engine allows as many (``--max-logprobs -1`` makes its
max_logprobs the vocabulary size); a clear 400 otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(60)

USER: Any = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def vocab(hf_tokenizer: Tokenizer) -> int:
    return int(hf_tokenizer.get_vocab_size())


@pytest.fixture(scope="module")
def whole_vocab(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, vocab: int
) -> Iterator[tuple[FakeEngine, GatewayServer]]:
    """An engine started with --max-logprobs -1 (it reports the vocabulary size)."""
    engine = make_engine(tokenizer_dir, hf_tokenizer, max_logprobs=vocab, step_s=0.001)
    engine.start()
    gateway = GatewayServer(engine.address).start()
    gateway.wait_healthy()
    yield engine, gateway
    gateway.stop()
    engine.stop()


def _post(gateway: GatewayServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json={"model": MODEL_NAME, **body}, timeout=20)


def test_minus_one_is_the_whole_vocabulary(
    whole_vocab: tuple[FakeEngine, GatewayServer], vocab: int
) -> None:
    engine, gateway = whole_vocab
    r = _post(
        gateway,
        "/v1/chat/completions",
        messages=USER,
        max_tokens=2,
        logprobs=True,
        top_logprobs=-1,
        prompt_logprobs=-1,
    )
    assert r.status_code == 200, r.text
    sent = engine.add_messages[engine.added[-1]].sampling_params
    assert (sent.logprobs, sent.prompt_logprobs) == (vocab, vocab)
    body = r.json()
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == vocab
    assert body["prompt_logprobs"][0] is None  # the first prompt token has none (vLLM's)
    r = _post(gateway, "/v1/completions", prompt="Hi", max_tokens=1, logprobs=-1)
    assert r.status_code == 200, r.text
    assert engine.add_messages[engine.added[-1]].sampling_params.logprobs == vocab


def test_minus_one_is_refused_where_the_server_caps_logprobs(gateway: GatewayServer) -> None:
    """The default engine answers at most 5: -1 is a 400 naming the field and the flag."""
    for path, fields in (
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -1}),
        ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": -1}),
        ("/v1/completions", {"prompt": "Hi", "logprobs": -1}),
    ):
        r = _post(gateway, path, max_tokens=1, **fields)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "--max-logprobs -1" in error["message"] and "at most 5" in error["message"]
        assert error["param"] in fields
    r = _post(gateway, "/v1/chat/completions", messages=USER, logprobs=True, top_logprobs=-2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
