"""Loading a checkpoint: built on the meta device, materialised in the serving dtype, every
parameter from the checkpoint (cast once), rotary tables float32; and the ``--dtype auto`` rule."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine_svc.models.layers import RotaryEmbedding, _rope_inv_freq
from engine_svc.models.loader import checkpoint_dtype, iter_safetensors, load_model
from engine_svc.worker.device import resolve_dtype

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
CUDA = torch.device("cuda")
FUSED = {  # our fused parameter fragment -> the checkpoint fragments concatenated into it
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as safetensors itself reads it (not through our reader)."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name.removeprefix("model.")] = f.get_tensor(name)
    return out


def _expected(param_name: str, ckpt: dict[str, torch.Tensor]) -> torch.Tensor:
    for fused, parts in FUSED.items():
        if fused in param_name:
            return torch.cat([ckpt[param_name.replace(fused, p)] for p in parts])
    return ckpt[param_name]


def _recast(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy of checkpoint ``src`` with its tensors stored in ``dtype`` (config.json says so)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(path).items()}, path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("stored", "serving"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("name", ["llama", "llama3_tied", "qwen2", "qwen3"])
def test_parameters_are_the_checkpoint_cast_once(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    name: str,
    stored: torch.dtype,
    serving: torch.dtype,
) -> None:
    model_dir = tiny_models[name]
    if stored != torch.float32:
        model_dir = _recast(model_dir, tmp_path / name, stored)
    ckpt = _checkpoint(model_dir)
    model = load_model(model_dir, serving, CPU, 64)
    for pname, param in model.named_parameters():
        assert param.dtype == serving and param.device == CPU, pname
        expected = _expected(pname, ckpt)
        assert expected.dtype == stored
        assert torch.equal(param, expected.to(serving)), pname  # bit-exact: one cast
    if model.spec.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("name", ["llama", "llama3_tied", "qwen3"])
def test_rotary_tables_are_float32_and_unchanged(tiny_models: dict[str, Path], name: str) -> None:
    model = load_model(tiny_models[name], torch.bfloat16, CPU, 300)
    rotary = model.rotary_emb
    # The tables as the model built them before it was built on the meta device.
    inv_freq = _rope_inv_freq(model.spec.head_dim, model.spec.rope)
    freqs = torch.outer(torch.arange(300, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    assert rotary.cos.dtype == rotary.sin.dtype == torch.float32
    assert rotary.cos.shape == (300, model.spec.head_dim)
    assert torch.equal(rotary.cos, emb.cos()) and torch.equal(rotary.sin, emb.sin())
    reached = [
        m for _, m in model.named_modules(remove_duplicate=False) if isinstance(m, RotaryEmbedding)
    ]
    assert len(reached) == model.spec.num_layers + 1 and all(m is rotary for m in reached)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize(
    "dropped",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",  # one shard of a fused parameter
        "model.norm.weight",
        "model.embed_tokens.weight",  # tied: lm_head has no tensor of its own either
    ],
)
def test_a_missing_checkpoint_tensor_is_an_error(
    tiny_models: dict[str, Path], tmp_path: Path, dropped: str
) -> None:
    model_dir = shutil.copytree(tiny_models["llama3_tied"], tmp_path / "ckpt")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors[dropped]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="missing tensors"):
        load_model(model_dir, torch.bfloat16, CPU, 64)


def test_sharded_checkpoint_reads_every_tensor(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    tensors = load_file(tiny_models["qwen3"] / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    read = dict(iter_safetensors(tmp_path))
    assert read.keys() == tensors.keys()
    assert all(torch.equal(read[n], tensors[n]) for n in names)


# -- --dtype auto ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recorded", "device", "expected"),
    [
        ("bfloat16", CUDA, torch.bfloat16),
        ("bfloat16", CPU, torch.bfloat16),
        ("float16", CUDA, torch.float16),
        ("float16", CPU, torch.bfloat16),  # no CPU fp16 decode kernel
        ("float32", CUDA, torch.bfloat16),  # downcast on GPU, like vLLM
        ("float32", CPU, torch.float32),
        ("torch.bfloat16", CPU, torch.bfloat16),  # some old configs spell it this way
        (None, CUDA, torch.bfloat16),
        (None, CPU, torch.float32),
    ],
)
def test_dtype_auto_follows_the_checkpoint(
    recorded: str | None, device: torch.device, expected: torch.dtype
) -> None:
    assert resolve_dtype("auto", device, recorded) == expected


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_an_explicit_dtype_wins(name: str, device: torch.device) -> None:
    assert resolve_dtype(name, device, "bfloat16") == getattr(torch, name)


def test_dtype_auto_refuses_an_unknown_checkpoint_dtype() -> None:
    with pytest.raises(ValueError, match="pass --dtype explicitly"):
        resolve_dtype("auto", CPU, "float64")


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_checkpoint_dtype_reads_either_key(tmp_path: Path, key: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({key: "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert checkpoint_dtype(tmp_path) is None


def test_tiny_checkpoints_stay_float32_under_auto(tiny_models: dict[str, Path]) -> None:
    # transformers saves random-init models in float32 and says so: auto keeps them float32 on CPU.
    for model_dir in tiny_models.values():
        assert resolve_dtype("auto", CPU, checkpoint_dtype(model_dir)) == torch.float32


# -- peak memory -------------------------------------------------------------------------------

# ~95M parameters: 190 MB in bfloat16. Built in float32 first it would need 380 MB more.
_SHAPE = dict(vocab=32000, hidden=768, intermediate=2048, layers=10)

# VmHWM, not getrusage's ru_maxrss: a spawned child's ru_maxrss starts at its parent's RSS.
# Peak anonymous memory (RssAnon, sampled every 0.5 ms while loading): the mapped checkpoint
# file is page cache, not what an fp32 build first would cost.
_MEASURE = """
import sys, threading, time, torch
from engine_svc.models.loader import load_model
def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
before, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)
sampler = threading.Thread(target=sample)
sampler.start()
model = load_model(sys.argv[1], torch.bfloat16, torch.device("cpu"), 128)
done.set()
sampler.join()
print(max(peak[0], anon()) - before, sum(p.nbytes for p in model.parameters()))
"""


def _write_bf16_checkpoint(out: Path) -> None:
    v, h, i, n = (_SHAPE[k] for k in ("vocab", "hidden", "intermediate", "layers"))
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (h, h)
        shapes[f"{p}mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    save_file(
        {k: torch.full(s, 0.02, dtype=torch.bfloat16) for k, s in shapes.items()},
        out / "model.safetensors",
    )
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": v,
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": n,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_loading_never_builds_a_float32_copy(tmp_path: Path) -> None:
    _write_bf16_checkpoint(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    grown, weights = map(int, out.stdout.split())
    assert weights > 180e6
    # One copy of the bf16 weights plus one checkpoint tensor; an fp32 build first is >= 2x.
    assert grown < 1.3 * weights, f"loading grew memory by {grown / weights:.2f}x the weights"
