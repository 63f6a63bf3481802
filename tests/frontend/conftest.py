"""Fixtures: a tiny tokenizer, the scripted fake engine and the real gateway in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from tests.frontend.fake_engine import SCRIPT, FakeEngine
from tests.frontend.harness import GatewayServer
from tests.frontend.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def make_engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer, **kwargs: object) -> FakeEngine:
    script = hf_tokenizer.encode(SCRIPT, add_special_tokens=False).ids
    return FakeEngine(
        tokenizer_dir,
        script,
        vocab_size=hf_tokenizer.get_vocab_size(),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[FakeEngine]:
    e = make_engine(tokenizer_dir, hf_tokenizer)
    e.start()
    yield e
    e.stop()


def _serving(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(engine.address).start()
    g.wait_healthy()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def gateway(engine: FakeEngine) -> Iterator[GatewayServer]:
    yield from _serving(engine)


@pytest.fixture()
def own_gateway(engine: FakeEngine) -> Iterator[GatewayServer]:
    """A gateway of its own: its figures count this test's requests only."""
    yield from _serving(engine)


@pytest.fixture()
def client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10)
