"""Reading PEFT adapter directories: the weights as PEFT saved them with their scaling folded in,
and every unservable directory refused with an error naming the file (and key)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_svc.lora.adapter import ModelDims, load_adapter
from engine_svc.lora.errors import LoRAInvalidError, LoRAPathNotFoundError
from engine_svc.models.llama import DecoderSpec
from engine_svc.models.loader import architecture_of, read_hf_config
from engine_svc.rpc.lora_rpcs import lora_status
from tests.lora_peft import ALL_TARGETS, make_adapter

PREFIX = "base_model.model.model.layers"
Q0 = f"{PREFIX}.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def base(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def dims(base: Path) -> ModelDims:
    cfg = read_hf_config(base)
    return ModelDims.from_spec(DecoderSpec.from_hf_config(cfg, architecture_of(cfg)))


@pytest.fixture(scope="module")
def qv_adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "qv"
    return make_adapter(base, out, r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1)


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, **changes: object) -> Path:
    cfg_file = directory / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))
    return directory


def edit_weights(directory: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    st = directory / "adapter_model.safetensors"
    tensors = load_file(str(st))
    edit(tensors)
    save_file(tensors, str(st))
    return directory


# ------------------------------------------------------------------ what is read


def test_weights_as_saved_with_their_scaling(qv_adapter: Path, dims: ModelDims) -> None:
    adapter = load_adapter(qv_adapter, dims, max_rank=16)
    raw = load_file(str(qv_adapter / "adapter_model.safetensors"))
    assert adapter.rank == 4 and adapter.targets == ("q_proj", "v_proj")
    assert sorted(adapter.modules) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    for (layer, target), m in adapter.modules.items():
        key = f"{PREFIX}.{layer}.self_attn.{target}"
        torch.testing.assert_close(m.a, raw[f"{key}.lora_A.weight"], rtol=0, atol=0)
        torch.testing.assert_close(m.b, raw[f"{key}.lora_B.weight"], rtol=0, atol=0)
        assert m.scaling == 8 / 4
    q = adapter.modules[(0, "q_proj")]
    assert tuple(q.a.shape) == (4, 64) and tuple(q.b.shape) == (96, 4)
    assert adapter.nbytes == sum(4 * (64 + 96) * 4 + 4 * (64 + 48) * 4 for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files(
    qv_adapter: Path, dims: ModelDims, tmp_path: Path, dtype: torch.dtype
) -> None:
    d = edit_weights(
        copy(qv_adapter, tmp_path), lambda t: t.update({k: v.to(dtype) for k, v in t.items()})
    )
    adapter = load_adapter(d, dims, max_rank=16)
    assert all(m.a.dtype == m.b.dtype == dtype for m in adapter.modules.values())
    bad = edit_weights(d, lambda t: t[f"{Q0}.lora_B.weight"].view(-1).__setitem__(3, float("inf")))
    check_refused(bad, dims, f"'{Q0}.lora_B.weight'", "NaN or infinite")


def test_rslora_rank_and_alpha_patterns(base: Path, dims: ModelDims, tmp_path: Path) -> None:
    d = make_adapter(
        base,
        tmp_path / "patterns",
        r=8,
        alpha=16,
        targets="all-linear",
        seed=2,
        use_rslora=True,
        rank_pattern={"down_proj": 2, "layers.1.self_attn.k_proj": 4},
        alpha_pattern={"o_proj": 3},
    )
    adapter = load_adapter(d, dims, max_rank=8)
    raw = load_file(str(d / "adapter_model.safetensors"))
    assert adapter.targets == tuple(ALL_TARGETS)
    assert len(adapter.modules) == 2 * 7
    expected_rank = {(1, "k_proj"): 4, (0, "down_proj"): 2, (1, "down_proj"): 2}
    for (layer, target), m in adapter.modules.items():
        rank = expected_rank.get((layer, target), 8)
        alpha = 3 if target == "o_proj" else 16
        block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        b = raw[f"{PREFIX}.{layer}.{block}.{target}.lora_B.weight"]
        assert m.rank == rank, (layer, target)
        torch.testing.assert_close(m.b, b, rtol=0, atol=0)
        assert m.scaling == pytest.approx(alpha / math.sqrt(rank)), (layer, target)


def test_target_modules_as_a_regular_expression(
    base: Path, dims: ModelDims, tmp_path: Path
) -> None:
    d = make_adapter(
        base, tmp_path / "regex", r=2, alpha=2, targets=r".*\.mlp\.(gate|up)_proj", seed=3
    )
    adapter = load_adapter(d, dims, max_rank=16)
    assert adapter.targets == ("gate_proj", "up_proj")


def test_bin_weights_read_with_weights_only(
    qv_adapter: Path, dims: ModelDims, tmp_path: Path
) -> None:
    d = copy(qv_adapter, tmp_path)
    tensors = load_file(str(d / "adapter_model.safetensors"))
    (d / "adapter_model.safetensors").unlink()
    torch.save(tensors, d / "adapter_model.bin")
    from_bin = load_adapter(d, dims, max_rank=16)
    from_st = load_adapter(qv_adapter, dims, max_rank=16)
    assert from_bin.modules.keys() == from_st.modules.keys()
    for key, m in from_st.modules.items():
        torch.testing.assert_close(from_bin.modules[key].b, m.b, rtol=0, atol=0)
        assert from_bin.modules[key].scaling == m.scaling


class _Payload:
    """Any pickled object that is not plain tensors: weights_only=True refuses to build it."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("this must never run",))


def test_bin_with_arbitrary_objects_is_refused(
    qv_adapter: Path, dims: ModelDims, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = copy(qv_adapter, tmp_path)
    (d / "adapter_model.safetensors").unlink()
    torch.save({"x": _Payload()}, d / "adapter_model.bin")
    with pytest.raises(LoRAInvalidError, match=r"adapter_model\.bin: cannot be read"):
        load_adapter(d, dims, max_rank=16)
    assert "must never run" not in capsys.readouterr().out


# ------------------------------------------------------------------ what is refused


def check_refused(directory: Path, dims: ModelDims, *fragments: str, max_rank: int = 16) -> None:
    with pytest.raises(LoRAInvalidError) as info:
        load_adapter(directory, dims, max_rank=max_rank)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_not_a_directory(dims: ModelDims, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    check_refused(tmp_path / "file", dims, str(tmp_path / "file"), "not a directory")


def test_a_path_that_does_not_exist_is_not_found(dims: ModelDims, tmp_path: Path) -> None:
    """NOT_FOUND on the wire (vLLM answers such a load 404), not INVALID_ARGUMENT."""
    with pytest.raises(LoRAPathNotFoundError, match="no such adapter directory") as info:
        load_adapter(tmp_path / "nowhere", dims, max_rank=16)
    assert lora_status(info.value) is grpc.StatusCode.NOT_FOUND


def test_missing_config(qv_adapter: Path, dims: ModelDims, tmp_path: Path) -> None:
    d = copy(qv_adapter, tmp_path)
    (d / "adapter_config.json").unlink()
    check_refused(d, dims, str(d / "adapter_config.json"), "missing")


def test_config_not_json(qv_adapter: Path, dims: ModelDims, tmp_path: Path) -> None:
    d = copy(qv_adapter, tmp_path)
    (d / "adapter_config.json").write_text("{r: 4")
    check_refused(d, dims, str(d / "adapter_config.json"), "not valid JSON")


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"r": 32}, ["r = 32 exceeds --max-lora-rank 16"]),
        ({"r": 0}, ["r must be a positive integer"]),
        ({"lora_alpha": "big"}, ["lora_alpha must be a number"]),
        ({"bias": "all"}, ["bias is 'all'"]),
        ({"lora_bias": True}, ["lora_bias"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save", "lm_head"]),
        ({"use_dora": True}, ["use_dora", "DoRA"]),
        ({"fan_in_fan_out": True}, ["fan_in_fan_out"]),
        ({"peft_type": "IA3"}, ["peft_type", "IA3"]),
        ({"target_modules": ["q_proj", "lm_head"]}, ["target_modules", "'lm_head'"]),
        ({"target_modules": ["embed_tokens"]}, ["target_modules", "'embed_tokens'"]),
        ({"target_modules": 7}, ["target_modules must be a list"]),
        ({"rank_pattern": {"q_proj": 64}}, ["rank_pattern", "'q_proj'", "64"]),
        ({"alpha_pattern": []}, ["alpha_pattern must be an object"]),
        ({"trainable_token_indices": [1, 2]}, ["trainable_token_indices"]),
    ],
)
def test_unservable_config(
    qv_adapter: Path,
    dims: ModelDims,
    tmp_path: Path,
    changes: dict[str, object],
    fragments: list[str],
) -> None:
    d = edit_config(copy(qv_adapter, tmp_path), **changes)
    check_refused(d, dims, str(d / "adapter_config.json"), *fragments)


def test_missing_weights(qv_adapter: Path, dims: ModelDims, tmp_path: Path) -> None:
    d = copy(qv_adapter, tmp_path)
    (d / "adapter_model.safetensors").unlink()
    check_refused(d, dims, str(d / "adapter_model.safetensors"), "missing", "adapter_model.bin")


def test_corrupt_safetensors(qv_adapter: Path, dims: ModelDims, tmp_path: Path) -> None:
    d = copy(qv_adapter, tmp_path)
    (d / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    check_refused(d, dims, str(d / "adapter_model.safetensors"), "cannot be read")


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (
            lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}),
            ["'base_model.model.lm_head.lora_A.weight'", "output head"],
        ),
        (
            lambda t: t.update(
                {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 384)}
            ),
            ["lora_embedding_A", "embedding adapters"],
        ),
        (
            lambda t: t.update({f"{Q0}.lora_A.bias": torch.zeros(4)}),
            [f"'{Q0}.lora_A.bias'"],
        ),
        (
            lambda t: t.update({f"{PREFIX}.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 64)}),
            [f"'{PREFIX}.0.mlp.q_proj.lora_A.weight'", "mlp.q_proj"],
        ),
        (
            lambda t: t.update({f"{PREFIX}.5.self_attn.o_proj.lora_A.weight": torch.zeros(4, 96)}),
            [f"'{PREFIX}.5.self_attn.o_proj.lora_A.weight'", "layer 5", "has 2"],
        ),
        (
            lambda t: t.pop(f"{Q0}.lora_B.weight"),
            [f"'{Q0}.lora_A.weight'", "no lora_B partner"],
        ),
        (
            lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(90, 4)}),
            [f"'{Q0}.lora_B.weight'", "(90, 4)", "[96, 4]"],
        ),
        (
            lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 65)}),
            [f"'{Q0}.lora_A.weight'", "(4, 65)", "[rank, 64]"],
        ),
        (
            lambda t: t.update({f"{Q0}.lora_A.weight": torch.full((4, 64), float("nan"))}),
            [f"'{Q0}.lora_A.weight'", "NaN"],
        ),
        (
            lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 64, dtype=torch.int32)}),
            [f"'{Q0}.lora_A.weight'", "floating-point", "torch.int32"],
        ),
        (lambda t: t.clear() or t.update({"other": torch.zeros(1)}), ["'other'", "expected"]),
    ],
)
def test_unservable_weights(
    qv_adapter: Path, dims: ModelDims, tmp_path: Path, edit, fragments: list[str]
) -> None:  # type: ignore[no-untyped-def]
    d = edit_weights(copy(qv_adapter, tmp_path), edit)
    check_refused(d, dims, str(d / "adapter_model.safetensors"), *fragments)


def test_rank_above_max_in_the_weights(base: Path, dims: ModelDims, tmp_path: Path) -> None:
    # the config's r fits but a module's actual rank does not
    d = make_adapter(base, tmp_path / "a", r=4, alpha=4, targets=["q_proj"], seed=4)
    d = edit_weights(
        d,
        lambda t: t.update(
            {f"{Q0}.lora_A.weight": torch.zeros(8, 64), f"{Q0}.lora_B.weight": torch.zeros(96, 8)}
        ),
    )
    check_refused(d, dims, f"'{Q0}.lora_A.weight'", "rank 8", max_rank=4)
    # and within the limit the config must agree with the tensors
    check_refused(d, dims, f"'{Q0}.lora_A.weight'", "rank 8", "says 4", max_rank=16)


def test_adapter_for_another_model_shape(qv_adapter: Path, tmp_path: Path) -> None:
    other = ModelDims.of(2, 128, 160, 4, 2, 32)  # hidden 128: every A is the wrong width
    check_refused(qv_adapter, other, "adapter_model.safetensors", "lora_A.weight", "[rank, 128]")
