"""The gateway's HTTP errors against the real engine: status, OpenAI error body, param named.

(429 with Retry-After is in test_grpc_errors.py, 503 in test_engine_restart.py: both need an
engine of their own.)
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.harness import API_KEY, MODEL, Gateway

pytestmark = pytest.mark.timeout(60)


def _post(gateway: Gateway, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}{path}",
        json=body,
        headers=gateway.headers if headers is None else headers,
        timeout=20,
    )


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": [100000]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": "nope"}, "messages"),
    ],
)
def test_400_invalid_parameter(gateway: Gateway, path: str, body: dict, param: str) -> None:
    error = _error(_post(gateway, path, {"model": MODEL, **body}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_400_invalid_parameter_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert info.value.status_code == 400
    assert "temperature" in info.value.message


def test_400_context_length(gateway: Gateway) -> None:
    error = _error(_post(gateway, "/v1/completions", {"model": MODEL, "prompt": [300] * 2048}), 400)
    assert error["param"] == "prompt"
    assert "2048" in error["message"]
    error = _error(
        _post(
            gateway, "/v1/completions", {"model": MODEL, "prompt": [300] * 2000, "max_tokens": 100}
        ),
        400,
    )
    assert error["param"] == "max_tokens"
    for number in ("2048", "2100", "2000", "100"):
        assert number in error["message"], error["message"]


@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key", API_KEY], ids=["missing", "wrong-key", "no-bearer-scheme"]
)
def test_401_without_or_with_wrong_key(gateway: Gateway, auth: str | None) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
        r = httpx.request(
            method,
            f"{gateway.url}{path}",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
            headers=headers,
            timeout=10,
        )
        error = _error(r, 401)
        assert error["code"] == "invalid_api_key"


def test_401_openai_client_wrong_key(gateway: Gateway) -> None:
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_public_paths_need_no_key(gateway: Gateway) -> None:
    for path in ("/health", "/live", "/metrics"):
        assert httpx.get(f"{gateway.url}{path}", timeout=10).status_code == 200, path


def test_404_unknown_model(gateway: Gateway, client: openai.OpenAI) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        error = _error(_post(gateway, path, {"model": "no-such-model", **body}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi")
