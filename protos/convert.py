"""The contract's messages and the contract's Python types (:mod:`protos.types`), both ways:
the one place either service turns one into the other.

The gateway sends ``request_to_pb`` and reads each step's outputs, load and errors
(``output_from_pb``, ``load_from_pb``, ``error_code_from_pb``) and the unary calls' replies; the
engine reads ``request_from_pb`` and answers with the ``..._to_pb`` side. The conversions of
what every engine step carries run once per request per step: they skip what is empty or unset
rather than convert it. Imports neither torch nor either service.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping

from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import (
    EngineErrorCode,
    EngineOutput,
    EnginePoolingParams,
    EngineRequest,
    EngineSamplingParams,
    FinishReason,
    LoadFigures,
    LoraAdapter,
    ModelInfo,
    PoolingTask,
    StructuredOutput,
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


_ERROR_CODES_TO_PB = {code: number for number, code in _ERROR_CODES.items()}
FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    **{reason: number for number, reason in _FINISH_REASONS.items()},
}


def error_code_from_pb(code: pb.ErrorCode) -> EngineErrorCode:
    """A request error's code as the contract's type (one this side does not know: INTERNAL)."""
    return _ERROR_CODES.get(code, EngineErrorCode.INTERNAL)


def error_code_to_pb(code: EngineErrorCode) -> pb.ErrorCode:
    """A request error's code on the wire; the unary calls' own codes (gRPC statuses, not
    request errors) are sent as INTERNAL."""
    return _ERROR_CODES_TO_PB.get(code, pb.ERROR_CODE_INTERNAL)


_OPTIONALS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
)


def request_to_pb(request: EngineRequest) -> pb.AddRequest:
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
    for name in _OPTIONALS:  # the proto's optional fields: unset where the engine's default
        if (value := getattr(sp, name)) is not None:
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
        constraint.reasoning_end_token_ids.extend(so.reasoning_end_token_ids)
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
    params = pb.PoolingParams(task=_POOLING_TASKS.get(pp.task, pb.POOLING_TASK_UNSPECIFIED))
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


def _logprobs_from_pb(entries: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            rank=e.rank,
            top=tuple((t.token_id, t.logprob) for t in e.top_logprobs),
        )
        for e in entries
    )


def output_from_pb(out: pb.RequestOutput) -> EngineOutput:
    # Called for every request of every engine step: the empty repeated fields and the unset
    # finish are skipped rather than converted.
    finish = out.finish_reason
    timed = out.HasField("queued_time_s")  # only with the first token and in the last output
    ids = out.new_token_ids
    return EngineOutput(
        out.request_id,
        (ids[0],) if len(ids) == 1 else tuple(ids),  # one token: 0.2 us, where tuple() is 0.4
        _logprobs_from_pb(out.logprobs) if out.logprobs else (),
        _logprobs_from_pb(out.prompt_logprobs) if out.prompt_logprobs else (),
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


def load_from_pb(load: pb.LoadStats) -> LoadFigures:
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
        num_waiting_deferred=load.num_waiting_deferred,
        spec_num_drafts=load.spec_decode_num_drafts,
        spec_num_draft_tokens=load.spec_decode_num_draft_tokens,
        spec_num_accepted_tokens=load.spec_decode_num_accepted_tokens,
        spec_accepted_per_pos=tuple(load.spec_decode_num_accepted_tokens_per_pos),
    )


def model_info_from_pb(info: pb.GetModelInfoResponse) -> ModelInfo:
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
        model_type=info.model_type,
        tensor_parallel_size=info.tensor_parallel_size or 1,
    )


def lora_from_pb(info: pb.LoraInfo) -> LoraAdapter:
    return LoraAdapter(
        name=info.lora_name,
        path=info.lora_path,
        rank=info.rank,
        pinned=info.pinned,
        on_device=info.on_device,
    )


# ---------------------------------------------------------------------- the engine's side


def request_from_pb(m: pb.AddRequest) -> EngineRequest:
    """An ``AddRequest`` as the contract's type: unset optionals stay ``None`` (the engine's
    defaults apply), a pooling request's sampling parameters are ignored. Raises ValueError
    naming the field for what no valid message can carry."""
    pooling = pooling_params_from_pb(m.pooling_params) if m.HasField("pooling_params") else None
    return EngineRequest(
        request_id=m.request_id,
        prompt_token_ids=tuple(m.prompt_token_ids),
        sampling_params=(
            _NO_SAMPLING if pooling is not None else sampling_params_from_pb(m.sampling_params)
        ),
        priority=m.priority,
        arrival_time=m.arrival_time,
        pooling_params=pooling,
        lora_name=m.lora_name,
    )


_NO_SAMPLING = EngineSamplingParams()


def sampling_params_from_pb(m: pb.SamplingParams) -> EngineSamplingParams:
    return EngineSamplingParams(
        min_tokens=m.min_tokens,
        top_k=m.top_k,
        min_p=m.min_p,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        structured_output=(
            structured_output_from_pb(m.structured_output)
            if m.HasField("structured_output")
            else None
        ),
        logit_bias=tuple(sorted(m.logit_bias.items())),  # a map: no order of its own
        allowed_token_ids=tuple(m.allowed_token_ids),
        bad_words=tuple(tuple(w.token_ids) for w in m.bad_words),
        **{name: getattr(m, name) for name in _OPTIONALS if m.HasField(name)},
    )


def structured_output_from_pb(m: pb.StructuredOutput) -> StructuredOutput:
    """Shape checks only (the engine compiles it). Raises ValueError naming the field."""
    kind = m.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output must set one of its kinds")
    end = tuple(m.reasoning_end_token_ids)
    if kind == "json_object":
        if not m.json_object:
            raise ValueError("structured_output.json_object must be true when set")
        return StructuredOutput("json_object", reasoning_end_token_ids=end)
    if kind == "choice":
        return StructuredOutput(
            "choice", choices=tuple(m.choice.choices), reasoning_end_token_ids=end
        )
    return StructuredOutput(kind, spec=getattr(m, kind), reasoning_end_token_ids=end)


_TASKS_FROM_PB = {number: task for task, number in _POOLING_TASKS.items()}


def pooling_params_from_pb(m: pb.PoolingParams) -> EnginePoolingParams:
    """POOLING_TASK_UNSPECIFIED becomes no task (the engine refuses it, naming the tasks its
    model serves); an unknown enum value raises ValueError."""
    task = None
    if m.task != pb.POOLING_TASK_UNSPECIFIED:
        task = _TASKS_FROM_PB.get(m.task)
        if task is None:
            raise ValueError(f"pooling_params.task has an unknown value {m.task}")
    return EnginePoolingParams(
        task=task,
        dimensions=m.dimensions if m.HasField("dimensions") else None,
        normalize=m.normalize if m.HasField("normalize") else None,
        activation=m.activation if m.HasField("activation") else None,
    )


def token_logprob_to_pb(
    token_id: int, logprob: float, rank: int, top: Mapping[int, float] | Iterable[tuple[int, float]]
) -> pb.TokenLogprob:
    """One token's logprob and its top alternatives ((token id, logprob) pairs or a mapping)."""
    pairs = top.items() if isinstance(top, Mapping) else top
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        rank=rank,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in pairs],
    )


def output_to_pb(o: EngineOutput) -> pb.RequestOutput:
    """The contract's output on the wire (the engine sends its own step outputs with
    ``engine_svc.rpc.convert.output_to_pb``, built of the same pieces)."""
    m = pb.RequestOutput(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        logprobs=[
            token_logprob_to_pb(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in o.logprobs
        ],
        prompt_logprobs=[
            token_logprob_to_pb(lp.token_id, lp.logprob, lp.rank, lp.top)
            for lp in o.prompt_logprobs
        ],
        finish_reason=FINISH_TO_PB[o.finish_reason],
        num_cached_tokens=o.num_cached_tokens,
        num_prompt_tokens=o.num_prompt_tokens,
    )
    if o.stop_reason is not None:
        m.stop_reason = o.stop_reason
    for name in ("queued_time_s", "prefill_time_s", "decode_time_s"):
        if (value := getattr(o, name)) is not None:
            setattr(m, name, value)
    if o.pooled is not None:
        m.pooled.MergeFromString(pooled_data_bytes(o.pooled))
    return m


def pooled_data_bytes(values: Iterable[float]) -> bytes:
    """``PooledData`` in wire format: field 1 as one packed run of little-endian float32s.

    Parsing these bytes fills ``data`` in one copy: ~2 us for 4,096 floats, against ~140 us for
    ``data.extend(values.tolist())`` (a Python float per value). ``values``: anything that
    gives float32 bytes (a numpy array, an ``array('f')``) or an iterable of floats.
    """
    if hasattr(values, "astype"):  # a numpy array (not imported here)
        raw = values.astype("<f4", copy=False).tobytes()  # type: ignore[attr-defined]
    else:
        packed = values if isinstance(values, array) and values.typecode == "f" else None
        packed = array("f", values) if packed is None or sys.byteorder == "big" else packed
        if sys.byteorder == "big":
            packed.byteswap()
        raw = packed.tobytes()
    n, length = len(raw), bytearray()
    while n > 0x7F:  # the length as a base-128 varint
        length.append((n & 0x7F) | 0x80)
        n >>= 7
    length.append(n)
    return b"\x0a" + bytes(length) + raw  # tag: field 1, wire type 2 (length-delimited)


def load_to_pb(load: LoadFigures) -> pb.LoadStats:
    stats = pb.LoadStats(
        num_running_requests=load.num_running,
        num_waiting_requests=load.num_waiting,
        kv_cache_usage=load.kv_cache_usage,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        num_preemptions=load.num_preemptions,
        num_waiting_deferred=load.num_waiting_deferred,
        spec_decode_num_drafts=load.spec_num_drafts,
        spec_decode_num_draft_tokens=load.spec_num_draft_tokens,
        spec_decode_num_accepted_tokens=load.spec_num_accepted_tokens,
    )
    if per_pos := load.spec_accepted_per_pos:  # (only with speculative decoding)
        stats.spec_decode_num_accepted_tokens_per_pos.extend(per_pos)
    if running := load.running_lora_adapters:  # (only with LoRA adapters in use)
        stats.running_lora_adapters.extend(running)
    if waiting := load.waiting_lora_adapters:
        stats.waiting_lora_adapters.extend(waiting)
    return stats


def model_info_to_pb(info: ModelInfo) -> pb.GetModelInfoResponse:
    m = pb.GetModelInfoResponse(
        served_model_name=info.served_model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
        max_logprobs=info.max_logprobs,
        model_source=info.model_source,
        engine_version=info.engine_version,
        enable_prefix_caching=info.enable_prefix_caching,
        kv_cache_dtype=info.kv_cache_dtype,
        supported_tasks=list(info.supported_tasks),
        embedding_size=info.embedding_size,
        pooling_type=info.pooling_type,
        is_matryoshka=info.is_matryoshka,
        matryoshka_dimensions=list(info.matryoshka_dimensions),
        labels=list(info.labels),
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
        model_type=info.model_type,
        tensor_parallel_size=info.tensor_parallel_size,
    )
    if info.bos_token_id is not None:
        m.bos_token_id = info.bos_token_id
    return m


def lora_to_pb(adapter: LoraAdapter) -> pb.LoraInfo:
    return pb.LoraInfo(
        lora_name=adapter.name,
        lora_path=adapter.path,
        rank=adapter.rank,
        pinned=adapter.pinned,
        on_device=adapter.on_device,
    )
