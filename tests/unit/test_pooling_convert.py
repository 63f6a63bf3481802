"""The rpc edge for pooling: PoolingParams from the proto, the pooled result packed into
RequestOutput.pooled, and GetModelInfo's pooling fields."""

from __future__ import annotations

import numpy as np
import pytest

from engine_svc.core.model_info import ModelInfo
from engine_svc.core.outputs import EngineCoreOutput
from engine_svc.core.pooling_params import ModelTasks, PoolingType
from engine_svc.rpc import convert
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.types import FinishReason, PoolingTask


def test_pooling_params_from_pb() -> None:
    p = convert.pooling_params_from_pb(pb.PoolingParams(task=pb.POOLING_TASK_EMBED))
    assert (p.task, p.dimensions, p.normalize, p.activation) == (
        PoolingTask.EMBED,
        None,
        None,
        None,
    )
    m = pb.PoolingParams(
        task=pb.POOLING_TASK_SCORE, dimensions=0, normalize=False, activation=False
    )
    p = convert.pooling_params_from_pb(m)  # set optionals keep their (zero) values
    assert (p.task, p.dimensions, p.normalize, p.activation) == (PoolingTask.SCORE, 0, False, False)
    assert convert.pooling_params_from_pb(pb.PoolingParams()).task is None
    with pytest.raises(ValueError, match="pooling_params.task has an unknown value 7"):
        convert.pooling_params_from_pb(pb.PoolingParams(task=7))  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 3, 16, 31, 32, 33, 1024, 4096, 70_000])
def test_pooled_bytes_are_protobufs_own_encoding(n: int) -> None:
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    raw = convert.pooled_data_bytes(values)
    assert raw == pb.PooledData(data=values.tolist()).SerializeToString()
    parsed = pb.PooledData.FromString(raw)
    assert np.array_equal(np.array(parsed.data, dtype=np.float32), values)


def test_pooled_output_to_pb() -> None:
    vec = np.array([0.25, -1.5, 3.0], dtype=np.float32)
    o = EngineCoreOutput("r", [], finish_reason=FinishReason.STOP, num_prompt_tokens=5, pooled=vec)
    m = convert.output_to_pb(o)
    assert list(m.pooled.data) == [0.25, -1.5, 3.0]
    assert m.finish_reason == pb.FINISH_REASON_STOP and not m.new_token_ids
    assert not convert.output_to_pb(EngineCoreOutput("g", [7])).HasField("pooled")


def _info(tasks: ModelTasks) -> ModelInfo:
    return ModelInfo("m", 128, 384, (2,), None, 16, 64, 20, True, "float32", tasks)


def test_model_info_pooling_fields() -> None:
    embed = ModelTasks(("generate", "embed"), 64, PoolingType.MEAN, True, (16, 64))
    m = convert.model_info_to_pb(_info(embed), "/m", "0.1")
    assert list(m.supported_tasks) == ["generate", "embed"]
    assert (m.embedding_size, m.pooling_type, m.is_matryoshka) == (64, "MEAN", True)
    assert list(m.matryoshka_dimensions) == [16, 64] and not m.labels
    cls = ModelTasks(("classify",), labels=("neg", "pos"))
    m = convert.model_info_to_pb(_info(cls), "/m", "0.1")
    assert list(m.supported_tasks) == ["classify"] and list(m.labels) == ["neg", "pos"]
    assert (m.embedding_size, m.pooling_type, m.is_matryoshka) == (0, "", False)
    m = convert.model_info_to_pb(_info(ModelTasks()), "/m", "0.1")
    assert list(m.supported_tasks) == ["generate"]
