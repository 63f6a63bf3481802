"""The engine's domain objects and the contract, at the gRPC edge: a request as sent
(``protos.types``, read by ``protos.convert.request_from_pb``) to the engine's own sampling and
pooling parameters; the engine's step outputs, errors, LoRA records and model facts to the
contract's messages. The wire format itself is ``protos.convert``'s: this module only maps the
engine's types onto it.
"""

from __future__ import annotations

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from engine_svc.core.errors import ContextLengthError, DuplicateRequestError
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.loop.errors import QueueFull, Unavailable
from engine_svc.lora.errors import LoRACapacityError, LoRANotFoundError
from engine_svc.lora.registry import LoRAInfo
from protos.convert import FINISH_TO_PB, pooled_data_bytes, token_logprob_to_pb
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import (
    EngineErrorCode,
    EnginePoolingParams,
    EngineSamplingParams,
    LoraAdapter,
    StructuredOutput,
)


def sampling_params(sp: EngineSamplingParams, max_logprobs: int) -> SamplingParams:
    """The parameters as sent -> the engine's, unset ones taking their real defaults. Raises
    ValueError naming a parameter out of range (``SamplingParams`` checks them)."""
    return SamplingParams(
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        temperature=1.0 if sp.temperature is None else sp.temperature,
        top_p=1.0 if sp.top_p is None else sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.seed,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
        logprobs=sp.logprobs,
        prompt_logprobs=sp.prompt_logprobs,
        max_logprobs=max_logprobs,
        structured_output=structured_output(sp.structured_output),
        logit_bias=dict(sp.logit_bias) or None,
        allowed_token_ids=list(sp.allowed_token_ids) or None,
        bad_words_token_ids=[list(w) for w in sp.bad_words] or None,
    )


def structured_output(so: StructuredOutput | None) -> StructuredOutputParams | None:
    if so is None:
        return None
    end = so.reasoning_end_token_ids
    if so.kind == "choice":
        return StructuredOutputParams(choice=so.choices, reasoning_end_token_ids=end)
    if so.kind == "json_object":
        return StructuredOutputParams(json_object=True, reasoning_end_token_ids=end)
    if so.kind == "regex":
        return StructuredOutputParams(regex=so.spec, reasoning_end_token_ids=end)
    if so.kind == "grammar":
        return StructuredOutputParams(grammar=so.spec, reasoning_end_token_ids=end)
    if so.kind == "json_schema":
        return StructuredOutputParams(json_schema=so.spec, reasoning_end_token_ids=end)
    raise ValueError(f"structured_output has an unknown kind {so.kind!r}")


def pooling_params(pp: EnginePoolingParams) -> PoolingParams:
    """Unchecked against the model: ``ModelInfo.check_pooling`` does that."""
    return PoolingParams(
        task=pp.task, dimensions=pp.dimensions, normalize=pp.normalize, activation=pp.activation
    )


def add_output(
    outputs: RepeatedCompositeFieldContainer[pb.RequestOutput], o: EngineCoreOutput
) -> pb.RequestOutput:
    """One request's output of an engine step, added to a message's ``outputs`` (built in
    place: 1.1 us for a plain token, where building it apart and copying it in costs 2.7). Runs
    once per request per step: what is empty or unset is skipped, not converted."""
    m = outputs.add(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        num_cached_tokens=o.num_cached_tokens,
        num_prompt_tokens=o.num_prompt_tokens,
    )
    if o.new_logprobs:
        m.logprobs.extend(
            token_logprob_to_pb(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in o.new_logprobs
        )
    if o.prompt_logprobs is not None:
        # The first prompt token has no logprob; entry i is about prompt token i + 1.
        m.prompt_logprobs.extend(
            token_logprob_to_pb(lp.token_id, lp.logprob, lp.rank, lp.top)
            for lp in o.prompt_logprobs
            if lp is not None
        )
    if o.finish_reason is not None:
        m.finish_reason = FINISH_TO_PB[o.finish_reason]
        if o.stop_reason is not None:
            m.stop_reason = o.stop_reason
    if o.pooled is not None:
        m.pooled.MergeFromString(pooled_data_bytes(o.pooled))
    if o.phase_times is not None:
        m.queued_time_s = o.phase_times.queued_s
        m.prefill_time_s = o.phase_times.prefill_s
        if o.finish_reason is not None:
            m.decode_time_s = o.phase_times.decode_s
    return m


def output_to_pb(o: EngineCoreOutput) -> pb.RequestOutput:
    """One output as a message of its own (the Generate rpc's)."""
    return add_output(pb.EngineCoreOutputs().outputs, o)


def lora_adapter(info: LoRAInfo) -> LoraAdapter:
    return LoraAdapter(
        name=info.name, path=info.path, rank=info.rank, pinned=info.pinned, on_device=info.on_device
    )


def error_code(e: Exception) -> EngineErrorCode:
    """The contract's code for a request the engine refused or failed."""
    if isinstance(e, QueueFull):
        return EngineErrorCode.RESOURCE_EXHAUSTED
    if isinstance(e, Unavailable):
        return EngineErrorCode.UNAVAILABLE
    if isinstance(e, ContextLengthError):
        return EngineErrorCode.CONTEXT_LENGTH_EXCEEDED
    if isinstance(e, DuplicateRequestError):
        return EngineErrorCode.DUPLICATE_REQUEST_ID
    if isinstance(e, LoRANotFoundError):
        return EngineErrorCode.NOT_FOUND
    if isinstance(e, LoRACapacityError):  # every device slot is pinned by other adapters
        return EngineErrorCode.RESOURCE_EXHAUSTED
    if isinstance(e, ValueError):
        return EngineErrorCode.INVALID_ARGUMENT
    return EngineErrorCode.INTERNAL
