"""POST /score and /v1/score (vLLM's), /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's
shape, as vLLM serves them).

A model that serves "score" (a one-label classifier: a cross-encoder) scores each pair as the
tokenizer's pair template joins it (``tokenizer(text_1, text_2)``); a model that serves only
"embed" scores a pair by the cosine similarity of the two texts' embeddings, as vLLM does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import Response

from frontend_svc.generation.run import random_id
from frontend_svc.protocol.pooling import RerankRequest, ScoreRequest, parse_rerank, parse_score
from frontend_svc.routes.common import gateway, parse_body, prompt_encoder
from frontend_svc.routes.pooling import (
    check_truncation,
    encode_texts_and_ids,
    fit_prompt,
    json_response,
    require_task,
    run_pooling,
    special_suffix_len,
    usage,
)
from frontend_svc.text.prompt_encoder import OFFLOAD_MIN_CHARS
from frontend_svc.text.tokenizer import Tokenizer
from protos.types import EngineOutput, EnginePoolingParams, ModelInfo, PoolingTask

Scored = tuple[list[float], list[EngineOutput], list[list[int]]]


async def create_score(request: Request) -> Response:
    """One score per pair: text_1[i] (or the one text_1) against text_2[i]."""
    state = gateway(request)
    _, info = state.require_engine()
    req = await parse_body(request, parse_score)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    model = lora or state.served_model_name or info.served_model_name
    left, right = req.sides
    request_id = random_id("score")
    scored = await score_pairs(request, model, lora, request_id, left, right, req, req.side_names)
    if scored is None:
        return Response(status_code=499)
    scores, outputs, prompts = scored
    payload = {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage(outputs, prompts),
    }
    return await json_response(request, payload, ())


async def rerank(request: Request) -> Response:
    """The documents ranked by relevance to the query, most relevant first, each with its
    index in the request; ``top_n`` of them when given."""
    state = gateway(request)
    _, info = state.require_engine()
    req = await parse_body(request, parse_rerank)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    model = lora or state.served_model_name or info.served_model_name
    documents = req.texts
    request_id = random_id("rerank")
    names = ("query", "documents")
    scored = await score_pairs(request, model, lora, request_id, [req.query], documents, req, names)
    if scored is None:
        return Response(status_code=499)
    scores, outputs, prompts = scored
    order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties by index
    results = []
    for i in order[: req.top_n or len(documents)]:
        result: dict[str, object] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    payload = {
        "id": request_id,
        "model": model,
        "usage": usage(outputs, prompts),
        "results": results,
    }
    return await json_response(request, payload, ())


async def score_pairs(
    request: Request,
    model: str,
    lora: str | None,
    request_id: str,
    left: list[str],
    right: list[str],
    req: ScoreRequest | RerankRequest,
    names: tuple[str, str],
) -> Scored | None:
    """The score of each pair (left[i] or the one left, right[i]), the engine outputs and the
    prompts they came from; None when the client went away."""
    tokenizer, info = gateway(request).require_engine()
    check_truncation(req.truncate_prompt_tokens, info)
    if "score" in info.supported_tasks:
        return await _cross_encode(
            request, tokenizer, info, request_id, left, right, req, names, lora
        )
    if "embed" in info.supported_tasks:
        return await _cosine(request, tokenizer, info, request_id, left, right, req, names, lora)
    require_task(info, model, "score", "scoring (neither 'score' nor 'embed')")
    raise AssertionError("require_task raised")


async def _cross_encode(
    request: Request,
    tokenizer: Tokenizer,
    info: ModelInfo,
    request_id: str,
    left: list[str],
    right: list[str],
    req: ScoreRequest | RerankRequest,
    names: tuple[str, str],
    lora: str | None,
) -> Scored | None:
    pairs = list(zip(left * len(right) if len(left) == 1 else left, right, strict=True))
    if sum(len(a) + len(b) for a, b in pairs) < OFFLOAD_MIN_CHARS:
        encoded = encode_pairs(tokenizer, pairs)
    else:
        encoded = await prompt_encoder(request).run(encode_pairs, tokenizer, pairs)
    truncate = req.truncate_prompt_tokens
    keep_last = special_suffix_len(tokenizer) if truncate is not None else 0
    prompts = [fit_prompt(ids, len(ids), info, truncate, keep_last, names[1]) for ids in encoded]
    params = EnginePoolingParams(PoolingTask.SCORE, activation=req.resolved_activation)
    outputs = await run_pooling(request, request_id, prompts, params, req.priority, lora)
    if outputs is None:
        return None
    return [(o.pooled or (0.0,))[0] for o in outputs], outputs, prompts


def encode_pairs(tokenizer: Tokenizer, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """Each pair's ids as the tokenizer's pair template joins the two texts."""
    return tokenizer.encode_pairs_releasing_gil(pairs)


async def _cosine(
    request: Request,
    tokenizer: Tokenizer,
    info: ModelInfo,
    request_id: str,
    left: list[str],
    right: list[str],
    req: ScoreRequest | RerankRequest,
    names: tuple[str, str],
    lora: str | None,
) -> Scored | None:
    truncate = req.truncate_prompt_tokens
    prompts = await encode_texts_and_ids(
        request, tokenizer, info, left, left, True, truncate, names[0]
    )
    prompts += await encode_texts_and_ids(
        request, tokenizer, info, right, right, True, truncate, names[1]
    )
    params = EnginePoolingParams(PoolingTask.EMBED)
    outputs = await run_pooling(request, request_id, prompts, params, req.priority, lora)
    if outputs is None:
        return None
    return cosine_scores(outputs[: len(left)], outputs[len(left) :]), outputs, prompts


def cosine_scores(left: Sequence[EngineOutput], right: Sequence[EngineOutput]) -> list[float]:
    """cos(left[i], right[i]), or cos(the one left, right[i]) (torch's cosine_similarity, eps
    1e-8), in float64."""
    if len(left) == 1:
        left = list(left) * len(right)
    scores = []
    for x, y in zip(left, right, strict=True):
        a, b = x.pooled or (), y.pooled or ()
        norms = math.sqrt(math.fsum(v * v for v in a)) * math.sqrt(math.fsum(v * v for v in b))
        scores.append(math.fsum(u * v for u, v in zip(a, b, strict=True)) / max(norms, 1e-8))
    return scores
