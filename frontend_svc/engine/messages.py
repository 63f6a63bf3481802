"""The contract's messages as the gateway's own types, both ways: a request to ``AddRequest``;
an engine step's ``RequestOutput``, ``LoadStats`` and error codes, and the unary calls' replies
(model info, LoRA adapters) to the types in :mod:`protos.types`.

With :mod:`frontend_svc.engine.client` (the stream and the calls), the only modules that import
the generated stubs. The conversions of what every engine step carries (:func:`engine_output`,
:func:`load_figures`) run once per request per step: they skip what is empty or unset rather
than convert it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import (
    EngineErrorCode,
    EngineOutput,
    EnginePoolingParams,
    EngineRequest,
    FinishReason,
    LoadFigures,
    LoraAdapter,
    ModelInfo,
    PoolingTask,
    TokenLogprob,
)

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_ERROR_CODES = {
    pb.ERROR_CODE_INVALID_ARGUMENT: EngineErrorCode.INVALID_ARGUMENT,
    pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: EngineErrorCode.CONTEXT_LENGTH_EXCEEDED,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: EngineErrorCode.RESOURCE_EXHAUSTED,
    pb.ERROR_CODE_DUPLICATE_REQUEST_ID: EngineErrorCode.DUPLICATE_REQUEST_ID,
    pb.ERROR_CODE_UNAVAILABLE: EngineErrorCode.UNAVAILABLE,
    pb.ERROR_CODE_INTERNAL: EngineErrorCode.INTERNAL,
    pb.ERROR_CODE_NOT_FOUND: EngineErrorCode.NOT_FOUND,
}


def error_code(code: pb.ErrorCode) -> EngineErrorCode:
    """A request error's code as the domain's (one this gateway does not know: INTERNAL)."""
    return _ERROR_CODES.get(code, EngineErrorCode.INTERNAL)


def add_request(request: EngineRequest) -> pb.AddRequest:
    if request.pooling_params is not None:
        return _add_pooling_request(request, request.pooling_params)
    sp = request.sampling_params
    params = pb.SamplingParams(
        min_tokens=sp.min_tokens,
        top_k=sp.top_k,
        min_p=sp.min_p,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        allowed_token_ids=list(sp.allowed_token_ids),
        logit_bias=dict(sp.logit_bias),
        bad_words=[pb.TokenIds(token_ids=list(w)) for w in sp.bad_words],
    )
    optionals = {
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "seed": sp.seed,
        "repetition_penalty": sp.repetition_penalty,
        "logprobs": sp.logprobs,
        "prompt_logprobs": sp.prompt_logprobs,
    }
    for name, value in optionals.items():
        if value is not None:
            setattr(params, name, value)
    so = sp.structured_output
    if so is not None:
        constraint = params.structured_output
        if so.kind == "choice":
            constraint.choice.choices.extend(so.choices)
        elif so.kind == "json_object":
            constraint.json_object = True
        else:
            setattr(constraint, so.kind, so.spec)
    return pb.AddRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=params,
        priority=request.priority,
        arrival_time=request.arrival_time,
        lora_name=request.lora_name,
    )


_POOLING_TASKS = {
    PoolingTask.EMBED: pb.POOLING_TASK_EMBED,
    PoolingTask.CLASSIFY: pb.POOLING_TASK_CLASSIFY,
    PoolingTask.SCORE: pb.POOLING_TASK_SCORE,
}


def _add_pooling_request(request: EngineRequest, pp: EnginePoolingParams) -> pb.AddRequest:
    params = pb.PoolingParams(task=_POOLING_TASKS[pp.task])
    if pp.dimensions is not None:
        params.dimensions = pp.dimensions
    if pp.normalize is not None:
        params.normalize = pp.normalize
    if pp.activation is not None:
        params.activation = pp.activation
    return pb.AddRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        priority=request.priority,
        arrival_time=request.arrival_time,
        pooling_params=params,
        lora_name=request.lora_name,
    )


def _logprobs(entries: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            rank=e.rank,
            top=tuple((t.token_id, t.logprob) for t in e.top_logprobs),
        )
        for e in entries
    )


def engine_output(out: pb.RequestOutput) -> EngineOutput:
    # Called for every request of every engine step: the empty repeated fields and the unset
    # finish are skipped rather than converted.
    finish = out.finish_reason
    timed = out.HasField("queued_time_s")  # only with the first token and in the last output
    ids = out.new_token_ids
    return EngineOutput(
        out.request_id,
        (ids[0],) if len(ids) == 1 else tuple(ids),  # one token: 0.2 us, where tuple() is 0.4
        _logprobs(out.logprobs) if out.logprobs else (),
        _logprobs(out.prompt_logprobs) if out.prompt_logprobs else (),
        _FINISH_REASONS.get(finish) if finish else None,
        out.stop_reason if finish and out.HasField("stop_reason") else None,
        out.num_cached_tokens,
        out.num_prompt_tokens,
        out.queued_time_s if timed else None,
        out.prefill_time_s if timed else None,
        out.decode_time_s if finish and out.HasField("decode_time_s") else None,
        # Only a final output can carry a pooled result: no cost per generated token.
        pooled_values(out.pooled) if finish and out.HasField("pooled") else None,
    )


def pooled_values(pooled: pb.PooledData) -> array[float]:
    """The packed floats as float32 values, copied from the message's wire bytes (field 1,
    packed: its tag, a varint length, then little-endian float32s): ~2 us for 4,096 values,
    where a Python float each costs ~150 us and 24 bytes."""
    raw = pooled.SerializeToString()
    values: array[float] = array("f")
    if not raw:
        return values
    length, start, shift = 0, 1, 0
    while start < len(raw) and raw[start] & 0x80:  # the length, base-128, low bits first
        length |= (raw[start] & 0x7F) << shift
        start, shift = start + 1, shift + 7
    if start >= len(raw) or raw[0] != 0x0A:  # not field 1 packed: convert value by value
        return array("f", pooled.data)
    length |= raw[start] << shift
    if start + 1 + length != len(raw) or length % 4:  # fields this client does not know
        return array("f", pooled.data)
    values.frombytes(raw[start + 1 :])
    if sys.byteorder == "big":
        values.byteswap()
    return values


def load_figures(load: pb.LoadStats) -> LoadFigures:
    return LoadFigures(
        num_running=load.num_running_requests,
        num_waiting=load.num_waiting_requests,
        kv_cache_usage=load.kv_cache_usage,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        num_preemptions=load.num_preemptions,
        # (Empty unless the engine serves LoRA adapters: no tuple built then.)
        running_lora_adapters=tuple(r) if (r := load.running_lora_adapters) else (),
        waiting_lora_adapters=tuple(w) if (w := load.waiting_lora_adapters) else (),
    )


def model_info(info: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        served_model_name=info.served_model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=tuple(info.eos_token_ids),
        bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
        max_logprobs=info.max_logprobs,
        model_source=info.model_source,
        engine_version=info.engine_version,
        enable_prefix_caching=info.enable_prefix_caching,
        kv_cache_dtype=info.kv_cache_dtype,
        # An engine that predates pooling leaves the list empty: it generates.
        supported_tasks=tuple(info.supported_tasks) or ("generate",),
        embedding_size=info.embedding_size,
        pooling_type=info.pooling_type,
        is_matryoshka=info.is_matryoshka,
        matryoshka_dimensions=tuple(info.matryoshka_dimensions),
        labels=tuple(info.labels),
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
    )


def lora_adapter(info: pb.LoraInfo) -> LoraAdapter:
    return LoraAdapter(
        name=info.lora_name,
        path=info.lora_path,
        rank=info.rank,
        pinned=info.pinned,
        on_device=info.on_device,
    )
