"""Schemathesis over the gateway's own /openapi.json (against the scripted engine): generated
requests, valid and invalid, must never get a 5xx, every response must match what the document
says (status codes, content types, headers, bodies), a request the document forbids must be
refused, and a request it allows must be accepted unless it breaks a rule the document cannot
state (token ids below the vocabulary size, a prompt that fits the context, ...: see
``BEYOND_THE_DOCUMENT``). The document is generated from the request models, so this checks
the models' schemas against their validation. Bounded for CI: a few dozen examples per
operation."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from tokenizers import Tokenizer

from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

schemathesis = pytest.importorskip("schemathesis")
checks = schemathesis.checks
pytestmark = pytest.mark.timeout(600)
EXAMPLES = 50
# CI runs the same examples every time (a failure there is the change's, not the draw's); set
# TANDEM_FUZZ_RANDOM=1 to explore new ones.
DERANDOMIZE = not os.environ.get("TANDEM_FUZZ_RANDOM")
# Why a request the document allows may still be a 400: facts of the served model and server
# (its name, vocabulary, context length, max_logprobs, tool parser), the chat template's own
# refusals, and rules JSON Schema cannot state (a JSON text inside a string, unique tool names,
# one structured output constraint, min_tokens <= max_tokens, prompts x n <= 1024). Most
# generated requests name a model the server does not serve (404), after their body is parsed.
BEYOND_THE_DOCUMENT = re.compile(
    "|".join(
        [
            r"vocabulary",
            r"this server's max_logprobs",
            r"--enable-auto-tool-choice",
            r"empty after tokenization",
            r"tokenizes to no token",
            r"is not valid JSON|must be a JSON Schema object",
            r"has two (functions|tools) named",
            r"which is not in 'tools'",
            r"at most one structured output constraint",
            r"either use constraints for structured outputs or tools",
            r"'(min_tokens|truncate_prompt_tokens)' \(\d+\) must not exceed",
            r"at most \d+ choices \(prompts x n\)",
            # pooling: the model's embedding size, and pairings JSON Schema cannot state
            r"must not exceed the embedding size",
            r"applies to the .* only",
            r"Input lengths must be either 1:1, 1:N or N:N",
            r"Give the texts to score as",
            # Anthropic's error shape has no code or param: the context length and the test
            # template's own refusal (a conversation whose first turn is a tool result) by name
            r"This model's maximum context length is",
            r"Conversations cannot start with a tool message",
        ]
    )
)


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[FakeEngine]:
    """An engine that serves every task, so every route's positive requests get past the
    task check (a Matryoshka embedder with one label: classify and score too)."""
    e = make_engine(
        tokenizer_dir,
        hf_tokenizer,
        supported_tasks=("generate", "embed", "classify", "score"),
        embedding_size=16,
        is_matryoshka=True,
        labels=("relevant",),
    )
    e.start()
    yield e
    e.stop()


def assert_accepted(response: Any) -> None:
    """A request the document allows got a success, or a refusal the document cannot foresee
    (404: a model name it does not serve, or a model path that normalizes to another route;
    429 and 503: load)."""
    if response.status_code < 400 or response.status_code in (404, 429, 503):
        return
    error = response.json()["error"]
    # the OpenAI shape (Anthropic's, on /v1/messages, has only type and message)
    message, param, code = error["message"], error.get("param"), error.get("code")
    assert response.status_code == 400, error
    # the chat template's own refusal of a conversation (chat's messages, a response's input)
    template_refusal = param in ("messages", "input") and not message.startswith(f"'{param}")
    assert (
        code == "context_length_exceeded" or template_refusal or BEYOND_THE_DOCUMENT.search(message)
    ), f"a request the document allows was refused: {error}"


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_every_operation(gateway: GatewayServer, mode: str) -> None:
    """``positive``: requests the document allows; ``negative``: requests it forbids."""
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10  # the document lists the routes
    for operation in operations:
        if mode == "negative" and operation.method.upper() in ("GET", "DELETE"):
            continue  # nothing to get wrong in a body-less call but the path, which is any string

        @given(case=operation.as_strategy(schemathesis.GenerationMode(mode)))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=DERANDOMIZE,
        )
        def check(case: Any) -> None:
            body = case.body
            if mode == "positive" and isinstance(body, dict) and "model" in body:
                # half the requests name the served model, to reach past the 404
                if len(str(body["model"])) % 2 == 0:
                    body["model"] = MODEL_NAME
            # schemathesis' own positive_data_acceptance would allow no 400 at all
            response = case.call_and_validate(excluded_checks=[checks.positive_data_acceptance])
            if mode == "positive":
                assert_accepted(response)

        check()


def test_bearer_security_is_declared_only_with_a_key(engine: FakeEngine) -> None:
    with_key = GatewayServer(engine.address, api_key="sekret").start()
    try:
        with_key.wait_healthy()
        doc = httpx.get(f"{with_key.url}/openapi.json").json()
        assert doc["security"] == [{"bearer": []}]
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]
        assert doc["paths"]["/health"]["get"]["security"] == []  # probes need no key
        assert doc["paths"]["/openapi.json"]["get"]["security"] == []  # nor this document
    finally:
        with_key.stop()
    keyless = GatewayServer(engine.address).start()
    try:
        keyless.wait_healthy()
        doc = httpx.get(f"{keyless.url}/openapi.json").json()
        assert "security" not in doc and "securitySchemes" not in doc["components"]
        assert "401" not in doc["paths"]["/v1/completions"]["post"]["responses"]
    finally:
        keyless.stop()
