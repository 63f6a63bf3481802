"""OpenAI-shaped errors: 400 naming the parameter, 401, 404, 429 + Retry-After, context length."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(30)


def post(gateway: GatewayServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=10)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("presence_penalty", 3),
        ("logprobs", 99),
        ("top_k", -2),
        ("stop", 5),
        ("seed", "x"),
        ("prompt", []),
        ("min_tokens", 50),
    ],
)
def test_invalid_completion_parameter(gateway: GatewayServer, field: str, value: object) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 10, field: value}
    assert_error(post(gateway, "/v1/completions", body), 400, field)


def test_invalid_parameter_through_openai(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], temperature=-0.5
        )
    assert e.value.param == "temperature"


def test_chat_errors(gateway: GatewayServer) -> None:
    msg = [{"role": "user", "content": "Hi"}]
    assert_error(
        post(gateway, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
        400,
        "messages",
    )
    assert_error(
        post(
            gateway,
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": msg, "top_logprobs": 2},
        ),
        400,
        "top_logprobs",
    )
    tool_first = [{"role": "tool", "content": "x"}]  # the template raises on this
    error = assert_error(
        post(gateway, "/v1/chat/completions", {"model": MODEL_NAME, "messages": tool_first}),
        400,
        "messages",
    )
    assert "tool message" in str(error["message"])
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert_error(r, 400)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt="Hello", max_tokens=2)
    assert e.value.code == "model_not_found"


def test_context_length_names_the_numbers(gateway: GatewayServer) -> None:
    error = assert_error(
        post(
            gateway,
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": [5] * 20, "max_tokens": 1000},
        ),
        400,
        "max_tokens",
    )
    message = str(error["message"])
    assert "256" in message and "1020" in message and "20 in the prompt" in message
    error = assert_error(
        post(
            gateway,
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 500,
            },
        ),
        400,
        "max_completion_tokens",
    )
    error = assert_error(
        post(gateway, "/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 300}), 400, "prompt"
    )
    assert "300" in str(error["message"])


def test_queue_full_is_429_with_retry_after(
    gateway: GatewayServer, engine: FakeEngine, client: openai.OpenAI
) -> None:
    engine.max_requests = 0
    try:
        r = post(gateway, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
        assert_error(r, 429)
        assert r.headers["retry-after"] == "2"
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "stream": True}
        assert_error(post(gateway, "/v1/completions", body), 429)  # before the stream starts
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    finally:
        engine.max_requests = 64


@pytest.fixture(scope="module")
def keyed_gateway(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(engine.address, api_key="sekret").start()
    g.wait_healthy()
    yield g
    g.stop()


def test_api_key(keyed_gateway: GatewayServer) -> None:
    url = keyed_gateway.url
    assert_error(httpx.get(f"{url}/v1/models"), 401)
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.post(f"{url}/tokenize", json={"prompt": "x"}), 401)
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    for public in ("/health", "/live", "/metrics"):
        assert httpx.get(f"{url}{public}").status_code == 200, public
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
    assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
