"""The pooling routes (/v1/embeddings, /pooling, /classify, /score, /rerank) against the scripted
engine: shapes, values and order (the fake engine's vector is a function of each prompt's ids, so
a result in the wrong place or from the wrong prompt shows), parameters forwarded, every bad
input a 400 naming its parameter with nothing sent to the engine, and aborts."""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from frontend_svc.errors import ApiError
from frontend_svc.generation.run import POOLING_MAX_IN_FLIGHT
from frontend_svc.protocol.pooling import MAX_INPUTS
from frontend_svc.routes.pooling import fit_prompt
from protos.convert import pooled_values
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import ModelInfo
from tests.frontend.conftest import make_engine
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine, fake_pooled
from tests.frontend.harness import GatewayServer, wait_for

pytestmark = pytest.mark.timeout(60)

LABELS = ("negative", "neutral", "positive")
# Engines by what they serve (started on first use, one gateway each).
SETUPS: dict[str, dict[str, Any]] = {
    "embed": dict(supported_tasks=("generate", "embed"), embedding_size=32, is_matryoshka=True),
    "embed_fixed": dict(supported_tasks=("embed",), embedding_size=16),
    "embed_listed": dict(
        supported_tasks=("embed",), embedding_size=32, matryoshka_dimensions=(8, 16)
    ),
    "classify": dict(supported_tasks=("classify",), labels=LABELS),
    "cross": dict(supported_tasks=("classify", "score"), labels=("relevant",)),
    "generate": dict(),
}


@dataclass
class Served:
    engine: FakeEngine
    gateway: GatewayServer

    @property
    def url(self) -> str:
        return self.gateway.url

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=kw.pop("timeout", 10), **kw)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def serve(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> Iterator[Callable[[str], Served]]:
    started: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in started:
            engine = make_engine(tokenizer_dir, hf_tokenizer, **SETUPS[name])
            engine.start()
            gateway = GatewayServer(engine.address).start()
            started[name] = Served(engine, gateway)
            gateway.wait_healthy()
        return started[name]

    yield get
    for s in started.values():
        s.gateway.stop()
        s.engine.stop()


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text).ids)


def embed_params(**kw: Any) -> pb.PoolingParams:
    return pb.PoolingParams(task=pb.POOLING_TASK_EMBED, **kw)


def expected(s: Served, prompt: list[int], params: pb.PoolingParams) -> list[float]:
    e = s.engine
    return fake_pooled(prompt, params, e.embedding_size, len(e.labels))


def sent_prompts(engine: FakeEngine, request_id: str) -> list[list[int]]:
    """The prompts the engine received for one API call, in input order."""
    rids = sorted(
        (r for r in engine.add_messages if r.startswith(request_id + "-")),
        key=lambda r: int(r.rsplit("-", 1)[1]),
    )
    return [list(engine.add_messages[r].prompt_token_ids) for r in rids]


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


# -- /v1/embeddings ----------------------------------------------------------------------------


def test_embedding_with_the_openai_sdk(
    serve: Callable[[str], Served], hf_tokenizer: Tokenizer
) -> None:
    s = serve("embed")
    r = s.client().embeddings.create(model=MODEL_NAME, input="Hello world", encoding_format="float")
    prompt = ids_of(hf_tokenizer, "Hello world")
    assert r.object == "list" and r.model == MODEL_NAME
    assert [(d.object, d.index) for d in r.data] == [("embedding", 0)]
    assert r.data[0].embedding == expected(s, prompt, embed_params())
    assert len(r.data[0].embedding) == 32
    assert math.isclose(math.fsum(x * x for x in r.data[0].embedding), 1.0, rel_tol=1e-5)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (len(prompt), len(prompt))
    extra = r.model_extra or {}
    assert str(extra["id"]).startswith("embd-") and int(extra["created"]) > 0
    # The engine got a pooling request (no sampling parameters), the prompt as tokenized here.
    [add] = [s.engine.add_messages[rid] for rid in sent_rids(s.engine, str(extra["id"]))]
    assert add.HasField("pooling_params") and not add.HasField("sampling_params")
    assert add.pooling_params == embed_params()
    assert list(add.prompt_token_ids) == prompt


def sent_rids(engine: FakeEngine, request_id: str) -> list[str]:
    return [r for r in engine.add_messages if r.startswith(request_id + "-")]


def test_sdk_default_base64_round_trips(serve: Callable[[str], Served]) -> None:
    """The SDK asks for base64 unless told otherwise and decodes float32 itself: the same
    numbers as the float format."""
    client = serve("embed").client()
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    as_b64 = client.embeddings.create(model=MODEL_NAME, input=texts)
    as_float = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    assert [d.embedding for d in as_b64.data] == [d.embedding for d in as_float.data]
    raw = (
        serve("embed")
        .post("/v1/embeddings", {"input": texts[0], "encoding_format": "base64"})
        .json()
    )
    blob = base64.b64decode(raw["data"][0]["embedding"])
    assert len(blob) == 4 * 32
    values = array("f")
    values.frombytes(blob)  # little-endian float32 (this machine is little-endian)
    assert values.tolist() == as_float.data[0].embedding


def test_inputs_come_back_in_order(serve: Callable[[str], Served], hf_tokenizer: Tokenizer) -> None:
    s = serve("embed")
    texts = [f"Hello {w}" for w in ("world", "fox", "dog", "tiny model", "gateway", "engine")]
    r = s.post("/v1/embeddings", {"model": MODEL_NAME, "input": texts}).json()
    assert [d["index"] for d in r["data"]] == list(range(len(texts)))
    prompts = [ids_of(hf_tokenizer, t) for t in texts]
    assert [d["embedding"] for d in r["data"]] == [expected(s, p, embed_params()) for p in prompts]
    assert sent_prompts(s.engine, r["id"]) == prompts
    assert r["usage"] == {
        "prompt_tokens": sum(map(len, prompts)),
        "total_tokens": sum(map(len, prompts)),
    }


def test_token_id_inputs(serve: Callable[[str], Served]) -> None:
    s = serve("embed")
    one = s.post("/v1/embeddings", {"input": [5, 6, 7]}).json()
    assert [d["embedding"] for d in one["data"]] == [expected(s, [5, 6, 7], embed_params())]
    batch = [[9, 8], [7, 6, 5], [4]]
    many = s.post("/v1/embeddings", {"input": batch}).json()
    assert [d["embedding"] for d in many["data"]] == [expected(s, p, embed_params()) for p in batch]
    assert sent_prompts(s.engine, many["id"]) == batch
    assert many["usage"]["prompt_tokens"] == 6


def test_many_inputs_run_a_bounded_number_at_a_time(serve: Callable[[str], Served]) -> None:
    s = serve("embed")
    prompts = [[10 + i % 50, 11 + i % 7, i % 300 + 1] for i in range(POOLING_MAX_IN_FLIGHT + 44)]
    s.engine.peak_in_flight = 0
    s.engine.pooling_steps, s.engine.max_requests = 50, 1000  # the requests overlap
    try:
        r = s.post("/v1/embeddings", {"input": prompts}, timeout=30).json()
    finally:
        s.engine.pooling_steps, s.engine.max_requests = 1, 64
    assert s.engine.peak_in_flight == POOLING_MAX_IN_FLIGHT
    assert [d["index"] for d in r["data"]] == list(range(len(prompts)))
    assert [d["embedding"] for d in r["data"]] == [expected(s, p, embed_params()) for p in prompts]


def test_dimensions_and_normalize_are_forwarded(serve: Callable[[str], Served]) -> None:
    s = serve("embed")
    r = s.post("/v1/embeddings", {"input": [3, 4, 5], "dimensions": 8}).json()
    [vector] = [d["embedding"] for d in r["data"]]
    assert vector == expected(s, [3, 4, 5], embed_params(dimensions=8)) and len(vector) == 8
    raw = s.post("/v1/embeddings", {"input": [3, 4, 5], "normalize": False}).json()
    [vector] = [d["embedding"] for d in raw["data"]]
    assert vector == expected(s, [3, 4, 5], embed_params(normalize=False))
    assert not math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-3)
    [rid] = sent_rids(s.engine, raw["id"])
    assert s.engine.add_messages[rid].pooling_params == embed_params(normalize=False)
    # newer vLLM's name for it
    newer = s.post("/v1/embeddings", {"input": [3, 4, 5], "use_activation": False}).json()
    assert newer["data"][0]["embedding"] == vector
    prio = s.post("/v1/embeddings", {"input": [3, 4, 5], "priority": -3}).json()
    [rid] = sent_rids(s.engine, prio["id"])
    assert s.engine.add_messages[rid].priority == -3


@pytest.mark.parametrize(
    ("setup", "dimensions", "needle"),
    [
        ("embed", 33, "must not exceed the embedding size (32)"),
        ("embed_fixed", 8, "does not support Matryoshka"),
        ("embed_listed", 12, "[8, 16]"),
    ],
)
def test_dimensions_the_model_does_not_allow(
    serve: Callable[[str], Served], setup: str, dimensions: int, needle: str
) -> None:
    s = serve(setup)
    before = len(s.engine.added)
    error = error_of(s.post("/v1/embeddings", {"input": "Hello", "dimensions": dimensions}))
    assert error["param"] == "dimensions" and needle in error["message"]
    assert len(s.engine.added) == before


def test_listed_matryoshka_dimensions_are_accepted(serve: Callable[[str], Served]) -> None:
    s = serve("embed_listed")
    r = s.post("/v1/embeddings", {"input": [7, 8], "dimensions": 16}).json()
    assert len(r["data"][0]["embedding"]) == 16


LONG_TEXT = "Hello world! The quick brown fox jumps over the lazy dog. " * 20  # > 256 tokens


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input", "'input[1]' must not be empty"),
        ({"input": [[1, 2], []]}, "input", "'input[1]' must not be empty"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"input": [[1]] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"input": [1, -2]}, "input", "token ids"),
        ({"input": [1, "a"]}, "input", "token ids"),
        ({"input": {"text": "a"}}, "input", "must be a string"),
        ({"input": [1, 99999]}, "input", "out of the vocabulary"),
        ({}, "input", "'input' is required"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "a", "dimensions": 2.5}, "dimensions", "integer"),
        ({"input": "a", "normalize": "yes please"}, "normalize", "boolean"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"input": "a", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens", "(256)"),
        ({"input": "a", "priority": 2**31}, "priority", "less than or equal"),
        ({"input": LONG_TEXT}, "input", "maximum context length is 256"),
        ({"input": ["Hi", LONG_TEXT]}, "input", "maximum context length is 256"),
        ({"input": list(range(1, 258))}, "input", "maximum context length is 256"),
    ],
)
def test_bad_embedding_requests(
    serve: Callable[[str], Served], body: dict[str, Any], param: str, needle: str
) -> None:
    s = serve("embed")
    before = len(s.engine.added)
    error = error_of(s.post("/v1/embeddings", body))
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and needle in error["message"], error
    if "context length" in needle:
        assert error["code"] == "context_length_exceeded"
    assert len(s.engine.added) == before  # refused before anything reached the engine


def test_body_that_is_not_an_object(serve: Callable[[str], Served]) -> None:
    error = error_of(serve("embed").post("/v1/embeddings", ["Hello"]))
    assert "JSON object" in error["message"]


def test_unknown_model_is_404(serve: Callable[[str], Served]) -> None:
    error = error_of(serve("embed").post("/v1/embeddings", {"input": "a", "model": "x"}), 404)
    assert error["code"] == "model_not_found"


def test_unknown_fields_are_ignored_and_null_is_absent(serve: Callable[[str], Served]) -> None:
    s = serve("embed")
    r = s.post("/v1/embeddings", {"input": [1, 2], "no_such_field": {"a": 1}})
    assert r.status_code == 200, r.text
    nulls = {"encoding_format": None, "dimensions": None, "add_special_tokens": None}
    r = s.post("/v1/embeddings", {"input": [1, 2], **nulls})
    assert r.json()["data"][0]["embedding"] == expected(s, [1, 2], embed_params())


def test_truncate_prompt_tokens_keeps_the_first_tokens(
    serve: Callable[[str], Served], hf_tokenizer: Tokenizer
) -> None:
    s = serve("embed")
    prompt = ids_of(hf_tokenizer, LONG_TEXT)
    assert len(prompt) > 256
    for k, want in ((10, prompt[:10]), (-1, prompt[:256])):
        r = s.post("/v1/embeddings", {"input": LONG_TEXT, "truncate_prompt_tokens": k}).json()
        assert sent_prompts(s.engine, r["id"]) == [want]
        assert r["data"][0]["embedding"] == expected(s, want, embed_params())
        assert r["usage"]["prompt_tokens"] == len(want)
    ids = s.post("/v1/embeddings", {"input": list(range(1, 300)), "truncate_prompt_tokens": 5})
    assert sent_prompts(s.engine, ids.json()["id"]) == [[1, 2, 3, 4, 5]]
    # A short prompt is left whole.
    short = s.post("/v1/embeddings", {"input": [4, 5, 6], "truncate_prompt_tokens": 5}).json()
    assert sent_prompts(s.engine, short["id"]) == [[4, 5, 6]]


def test_truncation_keeps_the_special_tokens_at_the_end() -> None:
    """Last-token pooling reads the EOS the tokenizer appends: a cut prompt keeps it."""
    info = ModelInfo("m", 16, 100, (1,), 0, 4, 8, 32, 5)
    ids = list(range(10, 30)) + [2]  # content, then EOS
    assert fit_prompt(ids, len(ids), info, 5, 1, "input") == [10, 11, 12, 13, 2]
    assert fit_prompt(ids, len(ids), info, -1, 1, "input") == [*range(10, 25), 2]
    assert fit_prompt(ids, len(ids), info, 5, 0, "input") == [10, 11, 12, 13, 14]
    with pytest.raises(ApiError) as e:
        fit_prompt(ids, len(ids), info, None, 1, "text_2")
    assert e.value.param == "text_2" and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 4096, 70_000])
def test_pooled_values_cross_the_adapter_exactly(n: int) -> None:
    """The engine client copies the packed floats from the wire bytes: the same float32 values
    as the parsed field, for any length of the length varint."""
    values = array("f", [math.sin(i) * 10 ** (i % 7 - 3) for i in range(n)]).tolist()
    message = pb.PooledData(data=values)
    got = pooled_values(message)
    assert got.typecode == "f" and got.tolist() == list(message.data) == values
    # A field this client does not know yet (kept as an unknown field): still right.
    newer = pb.PooledData.FromString(message.SerializeToString() + b"\x10\x05")
    assert pooled_values(newer).tolist() == values


def test_a_model_that_does_not_embed(serve: Callable[[str], Served]) -> None:
    s = serve("generate")
    with pytest.raises(openai.BadRequestError) as e:
        s.client().embeddings.create(model=MODEL_NAME, input="Hello")
    body = e.value.body
    assert isinstance(body, dict) and body["code"] == "unsupported_task"
    assert (
        "does not support embeddings" in body["message"] and "serves: generate" in body["message"]
    )
    error = error_of(serve("embed").post("/classify", {"input": "Hello"}))
    assert error["code"] == "unsupported_task" and "serves: generate, embed" in error["message"]


def test_models_list_the_tasks(serve: Callable[[str], Served]) -> None:
    for setup, tasks in (("embed", ["generate", "embed"]), ("generate", ["generate"])):
        [card] = httpx.get(f"{serve(setup).url}/v1/models").json()["data"]
        assert card["supported_tasks"] == tasks and card["max_model_len"] == 256


def test_generation_still_works_on_an_embedding_engine(serve: Callable[[str], Served]) -> None:
    r = serve("embed").client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3)
    assert r.usage is not None and r.usage.completion_tokens == 3


# -- /pooling ------------------------------------------------------------------------------------


def test_pooling_defaults_to_embed(serve: Callable[[str], Served]) -> None:
    s = serve("embed")
    r = s.post("/pooling", {"input": [[3, 4], [5]]}).json()
    assert r["id"].startswith("pool-") and r["object"] == "list"
    assert [(d["object"], d["index"]) for d in r["data"]] == [("pooling", 0), ("pooling", 1)]
    assert [d["data"] for d in r["data"]] == [
        expected(s, [3, 4], embed_params()),
        expected(s, [5], embed_params()),
    ]


def test_pooling_with_a_classifier(serve: Callable[[str], Served]) -> None:
    s = serve("classify")
    r = s.post("/pooling", {"input": [3, 4], "task": "classify", "activation": False}).json()
    raw = pb.PoolingParams(task=pb.POOLING_TASK_CLASSIFY, activation=False)
    assert r["data"][0]["data"] == expected(s, [3, 4], raw)
    default = s.post("/pooling", {"input": [3, 4], "encoding_format": "base64"}).json()
    values = array("f")
    values.frombytes(base64.b64decode(default["data"][0]["data"]))
    probs = pb.PoolingParams(task=pb.POOLING_TASK_CLASSIFY)
    assert values.tolist() == expected(s, [3, 4], probs)


@pytest.mark.parametrize(
    ("setup", "body", "param", "needle"),
    [
        ("embed", {"input": "a", "task": "score"}, "task", "serves: generate, embed"),
        ("embed", {"input": "a", "task": "token_embed"}, "task", "'embed', 'classify' or"),
        ("embed", {"input": "a", "activation": False}, "activation", "'classify' and 'score'"),
        ("classify", {"input": "a", "dimensions": 2}, "dimensions", "'embed' task"),
        ("classify", {"input": "a", "normalize": True}, "normalize", "'embed' task"),
        ("generate", {"input": "a"}, "model", "serves: generate"),
    ],
)
def test_bad_pooling_requests(
    serve: Callable[[str], Served], setup: str, body: dict[str, Any], param: str, needle: str
) -> None:
    error = error_of(serve(setup).post("/pooling", body))
    assert error["param"] == param and needle in error["message"], error


# -- /classify -----------------------------------------------------------------------------------


def test_classify(serve: Callable[[str], Served], hf_tokenizer: Tokenizer) -> None:
    s = serve("classify")
    texts = ["Hello world", "The lazy dog", "A tiny model"]
    r = s.post("/classify", {"model": MODEL_NAME, "input": texts}).json()
    assert r["id"].startswith("classify-") and r["object"] == "list" and r["model"] == MODEL_NAME
    params = pb.PoolingParams(task=pb.POOLING_TASK_CLASSIFY)
    for i, (text, d) in enumerate(zip(texts, r["data"], strict=True)):
        probs = expected(s, ids_of(hf_tokenizer, text), params)
        assert d["index"] == i and d["probs"] == probs and d["num_classes"] == 3
        assert d["label"] == LABELS[probs.index(max(probs))]
        assert math.isclose(sum(d["probs"]), 1.0, rel_tol=1e-5)
    raw = s.post("/classify", {"input": "Hello world", "activation": False}).json()
    logits = pb.PoolingParams(task=pb.POOLING_TASK_CLASSIFY, activation=False)
    assert raw["data"][0]["probs"] == expected(s, ids_of(hf_tokenizer, "Hello world"), logits)
    [rid] = sent_rids(s.engine, raw["id"])
    assert s.engine.add_messages[rid].pooling_params == logits


def test_classify_with_the_cross_encoder(serve: Callable[[str], Served]) -> None:
    s = serve("cross")
    r = s.post("/classify", {"input": [[4, 5, 6]]}).json()
    [d] = r["data"]
    assert d["num_classes"] == 1 and d["label"] == "relevant"
    assert 0.0 < d["probs"][0] < 1.0  # a sigmoid


# -- /score and /rerank --------------------------------------------------------------------------


def pair_ids(tok: Tokenizer, a: str, b: str) -> list[int]:
    return list(tok.encode(a, b).ids)


def score_of(s: Served, prompt: list[int], **kw: Any) -> float:
    return expected(s, prompt, pb.PoolingParams(task=pb.POOLING_TASK_SCORE, **kw))[0]


@pytest.mark.parametrize(
    ("names", "left", "right"),
    [
        (("text_1", "text_2"), "What is Tandem?", "Tandem serves language models"),
        (("text_1", "text_2"), "What is Tandem?", ["A gateway", "An engine", "The lazy dog"]),
        (("queries", "documents"), ["Hello", "The quick"], ["world", "brown fox"]),
        (("queries", "items"), "Hello", ["world", "fox"]),
        (("data_1", "data_2"), ["a", "b"], ["c", "d"]),
    ],
)
def test_score_with_a_cross_encoder(
    serve: Callable[[str], Served],
    hf_tokenizer: Tokenizer,
    names: tuple[str, str],
    left: str | list[str],
    right: str | list[str],
) -> None:
    s = serve("cross")
    r = s.post("/score", {names[0]: left, names[1]: right}).json()
    lefts = [left] if isinstance(left, str) else left
    rights = [right] if isinstance(right, str) else right
    lefts = lefts * len(rights) if len(lefts) == 1 else lefts
    prompts = [pair_ids(hf_tokenizer, a, b) for a, b in zip(lefts, rights, strict=True)]
    assert sent_prompts(s.engine, r["id"]) == prompts  # the tokenizer's pair template
    assert r["id"].startswith("score-") and r["object"] == "list"
    assert [(d["index"], d["object"]) for d in r["data"]] == [
        (i, "score") for i in range(len(rights))
    ]
    assert [d["score"] for d in r["data"]] == [score_of(s, p) for p in prompts]
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_score_activation_and_v1_path(
    serve: Callable[[str], Served], hf_tokenizer: Tokenizer
) -> None:
    s = serve("cross")
    r = s.post("/v1/score", {"text_1": "a", "text_2": "b", "activation": False}).json()
    assert r["data"][0]["score"] == score_of(s, pair_ids(hf_tokenizer, "a", "b"), activation=False)


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


def test_score_with_an_embedding_model_is_cosine_similarity(
    serve: Callable[[str], Served], hf_tokenizer: Tokenizer
) -> None:
    s = serve("embed")
    query, docs = "What is Tandem?", ["A gateway and an engine", "The lazy dog"]
    r = s.post("/score", {"text_1": query, "text_2": docs}).json()
    q = expected(s, ids_of(hf_tokenizer, query), embed_params())
    want = [cosine(q, expected(s, ids_of(hf_tokenizer, d), embed_params())) for d in docs]
    got = [d["score"] for d in r["data"]]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    # the query once, then each document, embedded (not joined as pairs)
    assert sent_prompts(s.engine, r["id"]) == [ids_of(hf_tokenizer, t) for t in [query, *docs]]


@pytest.mark.parametrize(
    ("setup", "body", "param", "needle"),
    [
        ("cross", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "1:1, 1:N or N:N"),
        ("cross", {"queries": "a"}, "text_1", "'queries' and 'documents'"),
        ("cross", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
        ("cross", {"text_1": 5, "text_2": "b"}, "text_1", "string or an array of strings"),
        ("cross", {"text_1": "a", "text_2": ["x"] * (MAX_INPUTS + 1)}, "text_2", "at most"),
        ("cross", {"text_1": "a", "text_2": LONG_TEXT}, "text_2", "maximum context length"),
        ("classify", {"text_1": "a", "text_2": "b"}, "model", "serves: classify"),
        ("generate", {"text_1": "a", "text_2": "b"}, "model", "serves: generate"),
    ],
)
def test_bad_score_requests(
    serve: Callable[[str], Served], setup: str, body: dict[str, Any], param: str, needle: str
) -> None:
    s = serve(setup)
    before = len(s.engine.added)
    error = error_of(s.post("/score", body))
    assert error["param"] == param and needle in error["message"], error
    assert len(s.engine.added) == before


def test_score_truncation_keeps_the_start_of_the_pair(
    serve: Callable[[str], Served], hf_tokenizer: Tokenizer
) -> None:
    s = serve("cross")
    r = s.post("/score", {"text_1": "a", "text_2": LONG_TEXT, "truncate_prompt_tokens": 12})
    want = pair_ids(hf_tokenizer, "a", LONG_TEXT)[:12]
    assert sent_prompts(s.engine, r.json()["id"]) == [want]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank(serve: Callable[[str], Served], hf_tokenizer: Tokenizer, path: str) -> None:
    s = serve("cross")
    query = "What does the gateway do?"
    docs = ["It speaks HTTP", "The lazy dog", "It detokenizes tokens", "Café", "An engine"]
    r = s.post(path, {"model": MODEL_NAME, "query": query, "documents": docs, "top_n": 3}).json()
    scores = [score_of(s, pair_ids(hf_tokenizer, query, d)) for d in docs]
    ranked = sorted(range(len(docs)), key=lambda i: -scores[i])[:3]
    assert r["id"].startswith("rerank-") and r["model"] == MODEL_NAME
    assert [x["index"] for x in r["results"]] == ranked
    assert [x["relevance_score"] for x in r["results"]] == [scores[i] for i in ranked]
    assert [x["document"] for x in r["results"]] == [{"text": docs[i]} for i in ranked]
    assert r["usage"]["total_tokens"] == sum(len(pair_ids(hf_tokenizer, query, d)) for d in docs)


def test_rerank_options(serve: Callable[[str], Served]) -> None:
    s = serve("cross")
    docs: list[Any] = [{"text": "It speaks HTTP"}, "The lazy dog", {"text": "Café"}]
    r = s.post("/rerank", {"query": "q", "documents": docs, "return_documents": False}).json()
    assert len(r["results"]) == 3 and all("document" not in x for x in r["results"])
    scores = [x["relevance_score"] for x in r["results"]]
    assert scores == sorted(scores, reverse=True)
    assert sorted(x["index"] for x in r["results"]) == [0, 1, 2]
    on_embed = serve("embed").post("/rerank", {"query": "q", "documents": ["a", "b"]})
    assert on_embed.status_code == 200 and len(on_embed.json()["results"]) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", {"txt": "b"}]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"documents": ["a"]}, "query"),
    ],
)
def test_bad_rerank_requests(
    serve: Callable[[str], Served], body: dict[str, Any], param: str
) -> None:
    assert error_of(serve("cross").post("/rerank", body))["param"] == param


# -- aborts, errors, keys, metrics -------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "n"),
    [
        ("/v1/embeddings", {"input": [[1], [2], [3]]}, 3),
        ("/v1/embeddings", {"input": "Hello"}, 1),
        ("/rerank", {"query": "q", "documents": ["a", "b"]}, 3),  # embedded: the query too
    ],
)
def test_disconnect_aborts_every_input(
    serve: Callable[[str], Served], path: str, body: dict[str, Any], n: int
) -> None:
    s = serve("embed")
    s.engine.pooling_steps = 100_000  # never finishes on its own
    before = set(s.engine.aborted)
    try:
        with pytest.raises(httpx.ReadTimeout):
            s.post(path, body, timeout=0.5)
        wait_for(lambda: s.engine.num_in_flight == 0, 5, "the aborts")
    finally:
        s.engine.pooling_steps = 1
    aborted = set(s.engine.aborted) - before
    assert len(aborted) == n and len({rid.rsplit("-", 1)[0] for rid in aborted}) == 1


def test_an_engine_error_aborts_the_other_inputs(serve: Callable[[str], Served]) -> None:
    """The third input finds the queue full: 429, and the two admitted are aborted."""
    s = serve("embed")
    s.engine.pooling_steps, s.engine.max_requests = 100_000, 2
    before = set(s.engine.aborted)
    try:
        r = s.post("/v1/embeddings", {"input": [[1], [2], [3]]})
        wait_for(lambda: s.engine.num_in_flight == 0, 5, "the aborts")
    finally:
        s.engine.pooling_steps, s.engine.max_requests = 1, 64
    assert error_of(r, 429)["code"] == "rate_limit_exceeded"
    assert len(set(s.engine.aborted) - before) == 2


def test_the_api_key_guards_the_pooling_routes(serve: Callable[[str], Served]) -> None:
    engine = serve("cross").engine
    g = GatewayServer(engine.address, api_key="sekret").start()
    try:
        g.wait_healthy()
        body = {"query": "q", "documents": ["a"]}
        assert httpx.post(f"{g.url}/v1/rerank", json=body).status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(f"{g.url}/v1/rerank", json=body, headers=auth).status_code == 200
        assert httpx.post(f"{g.url}/score", json={}, headers={}).status_code == 401
    finally:
        g.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **want: str
) -> float:
    return sum(
        v
        for (n, labels), v in metrics.items()
        if n == name and want.items() <= dict(labels).items()
    )


def test_pooling_requests_are_counted_in_the_metrics(serve: Callable[[str], Served]) -> None:
    s = serve("embed")
    before = scrape(s.url)
    s.post("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}).raise_for_status()
    after = scrape(s.url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="stop") == 2
    assert delta("vllm:prompt_tokens_total") == 5
    assert delta("vllm:generation_tokens_total") == 0
    assert delta("vllm:request_prompt_tokens_sum") == 5
    assert delta("vllm:request_prompt_tokens_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
