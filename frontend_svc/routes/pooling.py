"""POST /v1/embeddings, /pooling and /classify; and the steps every pooling route shares.

A pooling call: parse the body (``pooling_protocol``), check the model serves the task, turn
each input into token ids that fit the context (``truncate_prompt_tokens`` cuts them), send one
engine request per input (``generation.pool``: concurrent, bounded, in order; a client that goes
away aborts them), and answer with one JSON body.
"""

from __future__ import annotations

import base64
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response

from frontend_svc.errors import ApiError, invalid_parameter
from frontend_svc.generation.run import pool, random_id
from frontend_svc.protocol.pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    parse_classification,
    parse_embedding,
    parse_pooling,
)
from frontend_svc.routes.common import gateway, parse_body, prompt_encoder, require_task
from frontend_svc.routes.sse import ClientDisconnected, until_disconnected
from frontend_svc.server.state import GatewayState
from frontend_svc.text.tokenizer import Tokenizer
from protos.types import EngineOutput, EnginePoolingParams, ModelInfo, PoolingTask

# Responses holding this many numbers are serialized in the worker pool, off the event loop.
BIG_RESPONSE_VALUES = 65536


# -- routes ----------------------------------------------------------------------------------


async def create_embedding(request: Request) -> Response:
    """OpenAI's embeddings: one vector per input, as floats or base64 of float32."""
    state = gateway(request)
    tokenizer, info = state.require_engine()
    req = await parse_body(request, parse_embedding)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    model = lora or state.served_model_name or info.served_model_name
    require_task(info, model, "embed", "embeddings (/v1/embeddings)")
    params = embed_params(info, model, req.dimensions, req.resolved_normalize)
    prompts = await encode_inputs(request, tokenizer, info, req)
    request_id = random_id("embd")
    outputs = await run_pooling(request, request_id, prompts, params, req.priority, lora)
    if outputs is None:
        return Response(status_code=499)
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(o, req.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    return await json_response(request, listing(request_id, model, data, outputs, prompts), outputs)


async def create_pooling(request: Request) -> Response:
    """vLLM's /pooling: the task's raw pooled output per input (embedding, label values, score)."""
    state = gateway(request)
    tokenizer, info = state.require_engine()
    req = await parse_body(request, parse_pooling)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    model = lora or state.served_model_name or info.served_model_name
    served = [t for t in ("embed", "classify", "score") if t in info.supported_tasks]
    task = req.task or (served[0] if served else "embed")
    require_task(info, model, task, f"the '{task}' task", param="task" if req.task else "model")
    if task == "embed":
        for name in ("activation", "softmax"):
            if getattr(req, name) is not None:
                raise _wrong_task(name, "'classify' and 'score' tasks")
        params = embed_params(info, model, req.dimensions, req.resolved_normalize)
    else:
        for name in ("dimensions", "normalize"):
            if getattr(req, name) is not None:
                raise _wrong_task(name, "'embed' task")
        params = EnginePoolingParams(PoolingTask(task), activation=req.resolved_activation)
    prompts = await encode_inputs(request, tokenizer, info, req)
    request_id = random_id("pool")
    outputs = await run_pooling(request, request_id, prompts, params, req.priority, lora)
    if outputs is None:
        return Response(status_code=499)
    data = [
        {"object": "pooling", "index": i, "data": encode_vector(o, req.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    return await json_response(request, listing(request_id, model, data, outputs, prompts), outputs)


async def create_classification(request: Request) -> Response:
    """vLLM's /classify: each input's label values (probabilities unless the activation is
    off), the most likely label and the number of classes."""
    state = gateway(request)
    tokenizer, info = state.require_engine()
    req = await parse_body(request, parse_classification)
    lora = await state.resolve_model(req.model)  # the LoRA adapter it names, if any
    model = lora or state.served_model_name or info.served_model_name
    require_task(info, model, "classify", "classification (/classify)")
    params = EnginePoolingParams(PoolingTask.CLASSIFY, activation=req.resolved_activation)
    prompts = await encode_inputs(request, tokenizer, info, req)
    request_id = random_id("classify")
    outputs = await run_pooling(request, request_id, prompts, params, req.priority, lora)
    if outputs is None:
        return Response(status_code=499)
    data = []
    for i, out in enumerate(outputs):
        probs = list(out.pooled or ())
        best = max(range(len(probs)), key=probs.__getitem__) if probs else 0
        label = info.labels[best] if best < len(info.labels) else None
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    payload = listing(request_id, model, data, outputs, prompts)
    return await json_response(request, payload, outputs)


# -- shared steps ----------------------------------------------------------------------------


def embed_params(
    info: ModelInfo, model: str, dimensions: int | None, normalize: bool | None
) -> EnginePoolingParams:
    """The engine's embed parameters; ``dimensions`` only on a Matryoshka model (vLLM's rule:
    one of its trained dimensions when it lists them), never above the embedding size."""
    if dimensions is not None:
        trained = info.matryoshka_dimensions
        if not (info.is_matryoshka or trained):
            raise invalid_parameter(
                f"Model '{model}' does not support Matryoshka representation; changing the "
                "output dimensions would lead to poor results.",
                "dimensions",
            )
        if trained and dimensions not in trained:
            raise invalid_parameter(
                f"Model '{model}' only supports the Matryoshka dimensions {list(trained)}; "
                f"got {dimensions}.",
                "dimensions",
            )
        if info.embedding_size and dimensions > info.embedding_size:
            raise invalid_parameter(
                f"'dimensions' ({dimensions}) must not exceed the embedding size "
                f"({info.embedding_size}).",
                "dimensions",
            )
    return EnginePoolingParams(PoolingTask.EMBED, dimensions=dimensions, normalize=normalize)


def _wrong_task(name: str, tasks: str) -> ApiError:
    return invalid_parameter(f"'{name}' applies to the {tasks} only.", name)


async def encode_inputs(
    request: Request,
    tokenizer: Tokenizer,
    info: ModelInfo,
    req: EmbeddingRequest | ClassificationRequest,
) -> list[list[int]]:
    """Each of ``req.input``'s prompts as token ids that fit the context (400 otherwise)."""
    raw = req.input
    one = isinstance(raw, str) or isinstance(raw[0], int)  # a text, or one prompt's token ids
    prompts = cast(list[str | list[int]], [raw] if one else list(raw))
    texts = [p for p in prompts if isinstance(p, str)]
    return await encode_texts_and_ids(
        request, tokenizer, info, prompts, texts, req.add_special_tokens, req.truncate_prompt_tokens
    )


async def encode_texts_and_ids(
    request: Request,
    tokenizer: Tokenizer,
    info: ModelInfo,
    prompts: Sequence[str | list[int]],
    texts: list[str],
    add_special_tokens: bool,
    truncate: int | None,
    param: str = "input",
) -> list[list[int]]:
    check_truncation(truncate, info)
    encoded = iter(
        await prompt_encoder(request).encode(
            tokenizer, texts, add_special_tokens, max_length=info.max_model_len
        )
    )
    cut = texts and add_special_tokens and truncate is not None
    keep_last = special_suffix_len(tokenizer) if cut else 0
    out = []
    for p in prompts:
        if isinstance(p, str):
            e = next(encoded)
            out.append(fit_prompt(e.ids, e.num_tokens, info, truncate, keep_last, param))
        else:
            out.append(fit_prompt(p, len(p), info, truncate, 0, param))
    return out


def check_truncation(truncate: int | None, info: ModelInfo) -> None:
    if truncate is not None and truncate > info.max_model_len:
        raise invalid_parameter(
            f"'truncate_prompt_tokens' ({truncate}) must not exceed the context length "
            f"({info.max_model_len}).",
            "truncate_prompt_tokens",
        )


def special_suffix_len(tokenizer: Tokenizer) -> int:
    """How many special tokens the tokenizer puts after a text (EOS, [SEP]): a truncated prompt
    keeps them, as the tokenizer's own truncation does (last-token pooling reads the EOS)."""
    content = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return len(full) - start - len(content)
    return 0


def fit_prompt(
    ids: Sequence[int],
    num_tokens: int,
    info: ModelInfo,
    truncate: int | None,
    keep_last: int,
    param: str,
) -> list[int]:
    """The prompt's ids, cut to ``truncate`` tokens when asked (its first ones, plus its last
    ``keep_last`` special tokens); 400 when it is empty, longer than the context or holds an id
    outside the vocabulary. ``num_tokens``: the whole prompt's length (``ids`` may hold only
    its first ids, cut at tokenization)."""
    limit = info.max_model_len
    if truncate is not None:
        k = limit if truncate == -1 else truncate
        if num_tokens > k:
            tail = list(ids[len(ids) - keep_last :]) if 0 < keep_last < k else []
            ids = [*ids[: k - len(tail)], *tail]
            num_tokens = len(ids)
    if num_tokens == 0:
        raise invalid_parameter("The prompt is empty after tokenization.", param)
    if num_tokens > limit:
        raise invalid_parameter(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_tokens} tokens in the input. Please reduce the length of the input, or set "
            "'truncate_prompt_tokens'.",
            param,
            code="context_length_exceeded",
        )
    bad = next((t for t in ids if t >= info.vocab_size), None)
    if bad is not None:
        raise invalid_parameter(
            f"Token id {bad} is out of the vocabulary (size {info.vocab_size}).", param
        )
    return list(ids)


async def run_pooling(
    request: Request,
    request_id: str,
    prompts: Sequence[Sequence[int]],
    params: EnginePoolingParams,
    priority: int,
    lora: str | None = None,
) -> list[EngineOutput] | None:
    """The engine's outputs, in prompt order; None when the client went away (every engine
    request is aborted then)."""
    state: GatewayState = gateway(request)
    try:
        return await until_disconnected(
            request, pool(state, request_id, prompts, params, priority, lora or "")
        )
    except ClientDisconnected:
        return None


def encode_vector(out: EngineOutput, encoding_format: str) -> list[float] | str:
    """The pooled values as floats, or as base64 of little-endian float32 (OpenAI's base64)."""
    values = out.pooled if out.pooled is not None else array("f")
    if encoding_format != "base64":
        return values.tolist()
    if sys.byteorder == "big":
        values = array("f", values)
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def usage(outputs: Sequence[EngineOutput], prompts: Sequence[Sequence[int]]) -> dict[str, int]:
    """Prompt tokens of every engine request (pooling generates none)."""
    n = sum(o.num_prompt_tokens or len(p) for o, p in zip(outputs, prompts, strict=True))
    return {"prompt_tokens": n, "total_tokens": n}


def listing(
    request_id: str,
    model: str,
    data: list[dict[str, Any]],
    outputs: Sequence[EngineOutput],
    prompts: Sequence[Sequence[int]],
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(outputs, prompts),
    }


async def json_response(
    request: Request, payload: dict[str, Any], outputs: Sequence[EngineOutput]
) -> Response:
    num_values = sum(len(o.pooled or ()) for o in outputs)
    if num_values < BIG_RESPONSE_VALUES:
        body = orjson.dumps(payload)
    else:
        body = await prompt_encoder(request).run(orjson.dumps, payload)
    return Response(body, media_type="application/json")
