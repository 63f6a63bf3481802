"""The pooling routes end to end: real engine processes serving tiny pooling checkpoints
(``tiny_pooling_models``) behind real gateways, driven by the ``openai`` SDK and httpx.

Every number the HTTP API returns is checked against what the same engine answers over gRPC for
the same prompt (the engine's own parity with transformers is tests/parity/test_pooling_parity.py):
the HTTP path must hand back the engine's numbers, for the right input, in order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from frontend_svc.protocol.pooling import MAX_INPUTS
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.harness import API_KEY, Engine, Gateway

pytestmark = pytest.mark.timeout(300)

MAX_LEN = 128
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", str(MAX_LEN))
ENGINE_FLAGS += ("--max-num-seqs", "8", "--kv-cache-memory", "32MiB")
TEXTS = ["Hello world", "The quick brown fox", "Tandem serves models", "A tiny embedding"]
# Two runs of one prompt may differ in the last bits (another batch, the prefix cache).
CLOSE = {"rel": 1e-4, "abs": 1e-5}


class Served:
    """One engine process serving ``model_dir`` as ``name``, a gateway in front of it, and the
    checkpoint's tokenizer (the one the gateway fetches from the engine)."""

    def __init__(self, name: str, model_dir: Path, cache_dir: Path, log_dir: Path) -> None:
        self.name = name
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        flags = ("--model", str(model_dir), "--served-model-name", name, *ENGINE_FLAGS)
        self.engine = Engine(cache_dir, log_dir, *flags)
        self.gateway: Gateway | None = None
        self.channel: grpc.Channel | None = None

    def start(self, cache_dir: Path, log_dir: Path) -> Served:
        self.engine.wait_ready(120)
        self.gateway = Gateway(self.engine.address, cache_dir, log_dir).wait_healthy()
        self.channel = grpc.insecure_channel(self.engine.address)
        return self

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.gateway is not None:
            self.gateway.stop()
        self.engine.stop()

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def ids(self, text: str, pair: str | None = None) -> list[int]:
        return list(self.tokenizer.encode(text, pair).ids)

    def pooled(self, prompt: list[int], task: int, **params: Any) -> list[float]:
        """The engine's own answer over gRPC (the Generate rpc) for ``prompt``."""
        assert self.channel is not None
        request = pb.AddRequest(
            prompt_token_ids=prompt, pooling_params=pb.PoolingParams(task=task, **params)
        )
        stub = pb_grpc.EngineStub(self.channel)
        [response] = list(stub.Generate(pb.GenerateRequest(request=request), timeout=60))
        assert response.output.finish_reason == pb.FINISH_REASON_STOP
        return list(response.output.pooled.data)


@pytest.fixture(scope="module")
def served(
    tiny_pooling_models: dict[str, Path], cache_dir: Path, log_dir: Path
) -> Iterator[dict[str, Served]]:
    """Three engines started together (they load in parallel): an embedding model, a 3-label
    classifier and a cross-encoder."""
    kinds = {"embed": "tiny-embed", "classify_qwen3": "tiny-classifier"}
    kinds["cross_encoder"] = "tiny-reranker"
    procs = {
        k: Served(name, tiny_pooling_models[k], cache_dir, log_dir) for k, name in kinds.items()
    }
    try:
        yield {k: s.start(cache_dir, log_dir) for k, s in procs.items()}
    finally:
        for s in procs.values():
            s.stop()


@pytest.fixture()
def embed(served: dict[str, Served]) -> Served:
    return served["embed"]


def distinct(vectors: list[list[float]]) -> bool:
    """No two vectors alike (so a result in the wrong place could not pass)."""
    return all(
        max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-3
        for i, a in enumerate(vectors)
        for b in vectors[i + 1 :]
    )


def test_models_say_what_each_serves(served: dict[str, Served]) -> None:
    want = {
        "embed": ["generate", "embed"],
        "classify_qwen3": ["classify"],
        "cross_encoder": ["classify", "score"],
    }
    for kind, s in served.items():
        [card] = s.client().models.list().data
        assert card.id == s.name
        assert (card.model_extra or {})["supported_tasks"] == want[kind]


def test_sdk_embeddings_of_a_string_and_a_list(embed: Served) -> None:
    client = embed.client()
    one = client.embeddings.create(model=embed.name, input=TEXTS[0], encoding_format="float")
    want = embed.pooled(embed.ids(TEXTS[0]), pb.POOLING_TASK_EMBED)
    assert one.data[0].embedding == pytest.approx(want, **CLOSE)
    assert len(want) == 64 and math.isclose(math.fsum(x * x for x in want), 1.0, rel_tol=1e-4)
    assert one.usage.prompt_tokens == len(embed.ids(TEXTS[0]))

    many = client.embeddings.create(model=embed.name, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    wants = [embed.pooled(embed.ids(t), pb.POOLING_TASK_EMBED) for t in TEXTS]
    assert distinct(wants)
    for d, w in zip(many.data, wants, strict=True):
        assert d.embedding == pytest.approx(w, **CLOSE)
    assert many.usage.prompt_tokens == sum(len(embed.ids(t)) for t in TEXTS)


def test_sdk_embeddings_of_token_ids_and_base64(embed: Served) -> None:
    client = embed.client()
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 7]]
    wants = [embed.pooled(p, pb.POOLING_TASK_EMBED) for p in prompts]
    as_b64 = client.embeddings.create(model=embed.name, input=prompts)  # the SDK's base64
    as_float = client.embeddings.create(model=embed.name, input=prompts, encoding_format="float")
    for b, f, w in zip(as_b64.data, as_float.data, wants, strict=True):
        assert b.embedding == pytest.approx(w, **CLOSE)
        assert f.embedding == pytest.approx(w, **CLOSE)
    single = client.embeddings.create(model=embed.name, input=prompts[1], encoding_format="float")
    assert single.data[0].embedding == pytest.approx(wants[1], **CLOSE)


def test_sdk_embeddings_with_dimensions(embed: Served) -> None:
    r = embed.client().embeddings.create(
        model=embed.name, input=TEXTS[1], dimensions=16, encoding_format="float"
    )
    want = embed.pooled(embed.ids(TEXTS[1]), pb.POOLING_TASK_EMBED, dimensions=16)
    assert len(r.data[0].embedding) == 16
    assert r.data[0].embedding == pytest.approx(want, **CLOSE)
    full = embed.pooled(embed.ids(TEXTS[1]), pb.POOLING_TASK_EMBED)
    norm = math.sqrt(math.fsum(x * x for x in full[:16]))
    assert want == pytest.approx([x / norm for x in full[:16]], **CLOSE)  # cut, normalized again


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["ok"] * (MAX_INPUTS + 1)}, "input", None),
        ({"input": "Hello world " * 100}, "input", "context_length_exceeded"),
        ({"input": [1] * (MAX_LEN + 1)}, "input", "context_length_exceeded"),
        ({"input": [1, 100_000]}, "input", None),
        ({"input": "Hello", "dimensions": 65}, "dimensions", None),
    ],
)
def test_bad_embedding_input(
    embed: Served, body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        embed.client().embeddings.create(model=embed.name, **body)
    error = e.value.body
    assert isinstance(error, dict) and error["param"] == param and error["code"] == code


def test_truncation_reaches_the_engine(embed: Served) -> None:
    text = "Hello world " * 100
    r = embed.post("/v1/embeddings", {"input": text, "truncate_prompt_tokens": 20}).json()
    want = embed.pooled(embed.ids(text)[:20], pb.POOLING_TASK_EMBED)
    assert r["data"][0]["embedding"] == pytest.approx(want, **CLOSE)
    assert r["usage"]["prompt_tokens"] == 20


def test_a_model_without_the_task(served: dict[str, Served]) -> None:
    s = served["classify_qwen3"]
    with pytest.raises(openai.BadRequestError) as e:
        s.client().embeddings.create(model=s.name, input="Hello")
    error = e.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_task"
    assert "it serves: classify" in error["message"]


def test_classify(served: dict[str, Served]) -> None:
    s = served["classify_qwen3"]
    r = s.post("/classify", {"model": s.name, "input": TEXTS[:3]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    wants = [s.pooled(s.ids(t), pb.POOLING_TASK_CLASSIFY) for t in TEXTS[:3]]
    assert distinct(wants)
    for i, (d, want) in enumerate(zip(data, wants, strict=True)):
        assert d["index"] == i and d["num_classes"] == 3
        assert d["probs"] == pytest.approx(want, **CLOSE)
        assert math.isclose(sum(d["probs"]), 1.0, rel_tol=1e-4)
        assert d["label"] == ["negative", "neutral", "positive"][want.index(max(want))]
    raw = s.post("/classify", {"input": TEXTS[0], "activation": False}).json()["data"][0]
    logits = s.pooled(s.ids(TEXTS[0]), pb.POOLING_TASK_CLASSIFY, activation=False)
    assert raw["probs"] == pytest.approx(logits, **CLOSE)


def test_score_with_the_cross_encoder(served: dict[str, Served]) -> None:
    s = served["cross_encoder"]
    query, docs = "What is Tandem?", TEXTS
    r = s.post("/score", {"model": s.name, "text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    wants = [s.pooled(s.ids(query, d), pb.POOLING_TASK_SCORE)[0] for d in docs]
    assert len(set(wants)) == len(wants) and all(0.0 < w < 1.0 for w in wants)
    assert scores == pytest.approx(wants, **CLOSE)
    pairs = s.post("/v1/score", {"text_1": docs[:2], "text_2": docs[2:]}).json()["data"]
    want_pairs = [
        s.pooled(s.ids(a, b), pb.POOLING_TASK_SCORE)[0]
        for a, b in zip(docs[:2], docs[2:], strict=True)
    ]
    assert [d["score"] for d in pairs] == pytest.approx(want_pairs, **CLOSE)


def test_rerank(served: dict[str, Served]) -> None:
    s = served["cross_encoder"]
    query = "What is Tandem?"
    r = s.post("/v1/rerank", {"query": query, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    scores = [s.pooled(s.ids(query, d), pb.POOLING_TASK_SCORE)[0] for d in TEXTS]
    best = sorted(range(len(TEXTS)), key=lambda i: -scores[i])[:2]
    results = r.json()["results"]
    assert [x["index"] for x in results] == best
    assert [x["document"]["text"] for x in results] == [TEXTS[i] for i in best]
    assert [x["relevance_score"] for x in results] == pytest.approx(
        [scores[i] for i in best], **CLOSE
    )


def test_score_with_the_embedding_model_is_cosine_similarity(embed: Served) -> None:
    query = "What is Tandem?"
    r = embed.post("/score", {"text_1": query, "text_2": TEXTS[:2]})
    assert r.status_code == 200, r.text
    q = embed.pooled(embed.ids(query), pb.POOLING_TASK_EMBED)
    wants = []
    for text in TEXTS[:2]:
        d = embed.pooled(embed.ids(text), pb.POOLING_TASK_EMBED)
        wants.append(math.fsum(x * y for x, y in zip(q, d, strict=True)))  # unit vectors
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(wants, **CLOSE)


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_pooling_requests_in_the_metrics(embed: Served) -> None:
    names = (
        ("vllm:request_success_total", {"finished_reason": "stop"}),
        ("vllm:prompt_tokens_total", {}),
        ("vllm:request_queue_time_seconds_count", {}),
        ("vllm:request_prefill_time_seconds_count", {}),
        ("vllm:request_prompt_tokens_sum", {}),
    )
    before = [_metric(embed.url, n, **labels) for n, labels in names]
    prompts = [[5, 6, 7], [8, 9]]
    r = embed.post("/v1/embeddings", {"input": prompts})
    assert r.status_code == 200, r.text
    after = [_metric(embed.url, n, **labels) for n, labels in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 5, 2, 2, 5]
