"""The one adapter between protobuf messages and engine domain objects (engine side)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from engine_svc.core.errors import ContextLengthError, DuplicateRequestError
from engine_svc.core.model_info import ModelInfo
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.request import Logprobs
from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.loop.clients import LoadFigures
from engine_svc.loop.errors import QueueFull, Unavailable
from engine_svc.lora.errors import LoRACapacityError, LoRANotFoundError
from engine_svc.lora.registry import LoRAInfo
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import FinishReason, PoolingTask

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_params_from_pb(m: pb.SamplingParams, max_logprobs: int) -> SamplingParams:
    """Proto -> SamplingParams; unset optionals take their real defaults. Raises ValueError."""
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        min_tokens=m.min_tokens,
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=list(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        max_logprobs=max_logprobs,
        structured_output=(
            structured_output_from_pb(m.structured_output)
            if m.HasField("structured_output")
            else None
        ),
        logit_bias=dict(m.logit_bias) or None,
        allowed_token_ids=list(m.allowed_token_ids) or None,
        bad_words_token_ids=[list(w.token_ids) for w in m.bad_words] or None,
    )


_TASKS = {
    pb.POOLING_TASK_EMBED: PoolingTask.EMBED,
    pb.POOLING_TASK_CLASSIFY: PoolingTask.CLASSIFY,
    pb.POOLING_TASK_SCORE: PoolingTask.SCORE,
}


def pooling_params_from_pb(m: pb.PoolingParams) -> PoolingParams:
    """Proto -> PoolingParams (unchecked against the model: ``ModelInfo.check_pooling``).
    POOLING_TASK_UNSPECIFIED becomes no task; an unknown enum value raises ValueError."""
    task = None
    if m.task != pb.POOLING_TASK_UNSPECIFIED:
        task = _TASKS.get(m.task)
        if task is None:
            raise ValueError(f"pooling_params.task has an unknown value {m.task}")
    return PoolingParams(
        task=task,
        dimensions=m.dimensions if m.HasField("dimensions") else None,
        normalize=m.normalize if m.HasField("normalize") else None,
        activation=m.activation if m.HasField("activation") else None,
    )


def structured_output_from_pb(m: pb.StructuredOutput) -> StructuredOutputParams:
    """Proto -> StructuredOutputParams (shape checks only). Raises ValueError naming the field."""
    kind = m.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output must set one of its kinds")
    if kind == "json_object" and not m.json_object:
        raise ValueError("structured_output.json_object must be true when set")
    if kind == "choice":
        return StructuredOutputParams(choice=tuple(m.choice.choices))
    return StructuredOutputParams(**{kind: getattr(m, kind)})


def _logprob_pb(lp: Logprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],
    )


def output_to_pb(o: EngineCoreOutput) -> pb.RequestOutput:
    m = pb.RequestOutput(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        logprobs=[_logprob_pb(lp) for lp in o.new_logprobs],
        finish_reason=_FINISH[o.finish_reason],
        num_cached_tokens=o.num_cached_tokens,
        num_prompt_tokens=o.num_prompt_tokens,
    )
    if o.stop_reason is not None:
        m.stop_reason = o.stop_reason
    if o.prompt_logprobs is not None:
        # The first prompt token has no logprob; entry i is about prompt token i + 1.
        m.prompt_logprobs.extend(_logprob_pb(lp) for lp in o.prompt_logprobs if lp is not None)
    if o.pooled is not None:
        m.pooled.MergeFromString(pooled_data_bytes(o.pooled))
    if o.phase_times is not None:
        m.queued_time_s = o.phase_times.queued_s
        m.prefill_time_s = o.phase_times.prefill_s
        if o.finish_reason is not None:
            m.decode_time_s = o.phase_times.decode_s
    return m


def pooled_data_bytes(values: npt.NDArray[np.float32]) -> bytes:
    """``PooledData`` in wire format: field 1 as one packed run of little-endian float32s.

    Parsing these bytes fills ``data`` in one copy: ~2 us for 4,096 floats, against ~140 us for
    ``data.extend(values.tolist())`` (a Python float per value).
    """
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    n, length = len(raw), bytearray()
    while n > 0x7F:  # the length as a base-128 varint
        length.append((n & 0x7F) | 0x80)
        n >>= 7
    length.append(n)
    return b"\x0a" + bytes(length) + raw  # tag: field 1, wire type 2 (length-delimited)


def lora_info_to_pb(info: LoRAInfo) -> pb.LoraInfo:
    return pb.LoraInfo(
        lora_name=info.name,
        lora_path=info.path,
        rank=info.rank,
        pinned=info.pinned,
        on_device=info.on_device,
    )


def load_to_pb(load: LoadFigures) -> pb.LoadStats:
    stats = pb.LoadStats(
        num_running_requests=load.num_running,
        num_waiting_requests=load.num_waiting,
        kv_cache_usage=load.kv_cache_usage,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        num_preemptions=load.num_preemptions,
    )
    if running := load.running_lora_adapters:  # (only with LoRA adapters in use)
        stats.running_lora_adapters.extend(running)
    if waiting := load.waiting_lora_adapters:
        stats.waiting_lora_adapters.extend(waiting)
    return stats


def model_info_to_pb(info: ModelInfo, model_source: str, version: str) -> pb.GetModelInfoResponse:
    m = pb.GetModelInfoResponse(
        served_model_name=info.name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.num_kv_blocks * info.block_size,
        max_logprobs=info.max_logprobs,
        model_source=model_source,
        engine_version=version,
        enable_prefix_caching=info.enable_prefix_caching,
        kv_cache_dtype=info.kv_cache_dtype,
        supported_tasks=list(info.tasks.supported_tasks),
        embedding_size=info.tasks.embedding_size,
        pooling_type=info.tasks.pooling_type.value if info.tasks.pooling_type else "",
        is_matryoshka=info.tasks.is_matryoshka,
        matryoshka_dimensions=list(info.tasks.matryoshka_dimensions),
        labels=list(info.tasks.labels),
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
    )
    if info.bos_token_id is not None:
        m.bos_token_id = info.bos_token_id
    return m


def error_code(e: Exception) -> int:
    if isinstance(e, QueueFull):
        return int(pb.ERROR_CODE_RESOURCE_EXHAUSTED)
    if isinstance(e, Unavailable):
        return int(pb.ERROR_CODE_UNAVAILABLE)
    if isinstance(e, ContextLengthError):
        return int(pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED)
    if isinstance(e, DuplicateRequestError):
        return int(pb.ERROR_CODE_DUPLICATE_REQUEST_ID)
    if isinstance(e, LoRANotFoundError):
        return int(pb.ERROR_CODE_NOT_FOUND)
    if isinstance(e, LoRACapacityError):  # every device slot is pinned by other adapters
        return int(pb.ERROR_CODE_RESOURCE_EXHAUSTED)
    if isinstance(e, ValueError):
        return int(pb.ERROR_CODE_INVALID_ARGUMENT)
    return int(pb.ERROR_CODE_INTERNAL)
