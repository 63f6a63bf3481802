"""protos.convert: each contract type survives the wire both ways, so the gateway reads exactly
what the engine meant and the engine reads exactly what the gateway sent."""

from __future__ import annotations

from array import array

import pytest

from protos import convert
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

EVERY_FIELD = EngineSamplingParams(
    max_tokens=7,
    min_tokens=2,
    temperature=0.0,  # set to zero: must not read back as unset
    top_p=0.5,
    top_k=4,
    min_p=0.125,  # float32 on the wire: values it holds exactly
    seed=0,
    stop_token_ids=(5, 6),
    ignore_eos=True,
    presence_penalty=0.25,
    frequency_penalty=-0.5,
    repetition_penalty=1.5,
    logprobs=0,
    prompt_logprobs=3,
    structured_output=StructuredOutput("regex", spec="a+"),
    logit_bias=((3, -100.0), (9, 2.5)),
    allowed_token_ids=(1, 2, 3),
    bad_words=((4, 5), (6,)),
)


@pytest.mark.parametrize(
    "params",
    [
        EngineSamplingParams(),
        EVERY_FIELD,
        EngineSamplingParams(structured_output=StructuredOutput("json_object")),
        EngineSamplingParams(structured_output=StructuredOutput("choice", choices=("y", "n"))),
        EngineSamplingParams(structured_output=StructuredOutput("json_schema", spec="{}")),
        EngineSamplingParams(structured_output=StructuredOutput("grammar", spec='root ::= "a"')),
        # Constrained after the reasoning: the end tag's ids travel with every kind.
        EngineSamplingParams(
            structured_output=StructuredOutput(
                "json_schema", spec="{}", reasoning_end_token_ids=(151668,)
            )
        ),
        EngineSamplingParams(
            structured_output=StructuredOutput(
                "choice", choices=("y",), reasoning_end_token_ids=(7, 8, 9)
            )
        ),
        EngineSamplingParams(
            structured_output=StructuredOutput("json_object", reasoning_end_token_ids=(0,))
        ),
    ],
)
def test_a_generation_request_round_trips(params: EngineSamplingParams) -> None:
    sent = EngineRequest("r-1", (1, 2, 3), params, priority=-2, arrival_time=12.5, lora_name="x")
    wire = pb.AddRequest.FromString(convert.request_to_pb(sent).SerializeToString())
    assert convert.request_from_pb(wire) == sent


@pytest.mark.parametrize(
    "pooling",
    [
        EnginePoolingParams(PoolingTask.EMBED, dimensions=16, normalize=False),
        EnginePoolingParams(PoolingTask.CLASSIFY, activation=True),
        EnginePoolingParams(PoolingTask.SCORE),
        EnginePoolingParams(None),  # unset: the engine refuses it, naming what it serves
    ],
)
def test_a_pooling_request_round_trips_without_sampling(pooling: EnginePoolingParams) -> None:
    sent = EngineRequest("p", (4,), EVERY_FIELD, pooling_params=pooling)
    got = convert.request_from_pb(convert.request_to_pb(sent))
    assert got.pooling_params == pooling
    assert got.sampling_params == EngineSamplingParams()  # ignored, as the contract says


def test_malformed_messages_name_the_field() -> None:
    with pytest.raises(ValueError, match="structured_output must set one of its kinds"):
        convert.request_from_pb(
            pb.AddRequest(
                sampling_params=pb.SamplingParams(structured_output=pb.StructuredOutput())
            )
        )
    so = pb.StructuredOutput(json_object=False)
    with pytest.raises(ValueError, match="json_object must be true"):
        convert.request_from_pb(
            pb.AddRequest(sampling_params=pb.SamplingParams(structured_output=so))
        )
    bad_task = pb.PoolingParams(task=9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling_params.task has an unknown value 9"):
        convert.request_from_pb(pb.AddRequest(pooling_params=bad_task))


def test_an_output_round_trips() -> None:
    top = ((8, -0.125), (9, -2.0))
    sent = EngineOutput(
        "r",
        (8, 9),
        logprobs=(TokenLogprob(8, -0.125, 1, top), TokenLogprob(9, -2.0, 2, top)),
        prompt_logprobs=(TokenLogprob(2, -3.0, 5),),
        finish_reason=FinishReason.STOP,
        stop_reason=9,
        num_cached_tokens=16,
        num_prompt_tokens=20,
        queued_time_s=0.5,
        prefill_time_s=0.25,
        decode_time_s=1.0,
        pooled=array("f", [0.5, -1.25]),
    )
    got = convert.output_from_pb(
        pb.RequestOutput.FromString(convert.output_to_pb(sent).SerializeToString())
    )
    assert got == sent
    running = EngineOutput("r", (3,))
    assert convert.output_from_pb(convert.output_to_pb(running)) == running


def test_load_model_info_adapters_and_error_codes_round_trip() -> None:
    load = LoadFigures(3, 1, 0.5, 10, 4, 2, ("a",), ("b", "c"), num_waiting_deferred=1)
    assert convert.load_from_pb(convert.load_to_pb(load)) == load
    spec = LoadFigures(spec_num_drafts=7, spec_num_draft_tokens=28, spec_num_accepted_tokens=9,
                       spec_accepted_per_pos=(5, 3, 1, 0))  # fmt: skip
    assert convert.load_from_pb(convert.load_to_pb(spec)) == spec
    info = ModelInfo(
        served_model_name="m",
        max_model_len=4096,
        vocab_size=1000,
        eos_token_ids=(2, 3),
        bos_token_id=0,  # zero: set, not unset
        block_size=16,
        num_kv_blocks=100,
        kv_capacity_tokens=1600,
        max_logprobs=20,
        model_source="/models/m",
        engine_version="1.2",
        supported_tasks=("generate", "embed"),
        embedding_size=64,
        pooling_type="MEAN",
        is_matryoshka=True,
        matryoshka_dimensions=(16, 64),
        labels=(),
        max_loras=4,
        max_lora_rank=16,
        model_type="kimi_k2",
        tensor_parallel_size=4,
    )
    assert convert.model_info_from_pb(convert.model_info_to_pb(info)) == info
    older = convert.model_info_to_pb(info)
    older.ClearField("tensor_parallel_size")  # an engine from before the field: one rank
    assert convert.model_info_from_pb(older).tensor_parallel_size == 1
    adapter = LoraAdapter("x", "/a/x", rank=8, pinned=True, on_device=True)
    assert convert.lora_from_pb(convert.lora_to_pb(adapter)) == adapter
    request_errors = [
        c for c in EngineErrorCode if convert.error_code_to_pb(c) != pb.ERROR_CODE_INTERNAL
    ]
    assert len(request_errors) >= 6
    for code in request_errors:
        assert convert.error_code_from_pb(convert.error_code_to_pb(code)) is code
