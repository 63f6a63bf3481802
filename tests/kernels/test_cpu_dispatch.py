"""CPU checks around the CUDA kernels: the new torch references equal the model's own layers,
the default path never touches CUDA or CuPy, and the wrappers reject bad inputs before launch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_svc.models.layers import RMSNorm, RotaryEmbedding
from kernels import cuda, cuda_ops, variants
from kernels import reference_norm_rope as ref
from kernels.attention_backends import select_kernels
from tests.gpu.helpers import make_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_references_equal_the_layer(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.add_(torch.randn(96, dtype=dtype) * 0.1)
    x, res = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    out, summed = norm(x, res)
    got_out, got_sum = ref.fused_add_rms_norm(x, res, norm.weight, 1e-6)
    assert torch.equal(got_out, out) and torch.equal(got_sum, summed)
    assert torch.equal(ref.rms_norm(x, norm.weight, 1e-6), norm.norm(x))
    assert torch.equal(ref.fused_add_rms_norm(x, res, norm.weight, 1e-6)[0], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_reference_equals_the_layer(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(24, 512, {"rope_theta": 10000.0})
    positions = torch.randint(0, 512, (7,))
    qkv = torch.randn(7, (4 + 2 * 2) * 24, dtype=dtype)
    q, k = qkv[:, : 4 * 24].view(7, 4, 24), qkv[:, 4 * 24 : 6 * 24].view(7, 2, 24)
    want_q, want_k = rope(positions, q, k)
    ref.rotary_embedding(positions, q, k, rope.cos, rope.sin)  # in place, through the views
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_the_cuda_backend_is_refused_on_the_cpu() -> None:
    # The choice is made once, from config: on the CPU the CUDA backend is refused by name.
    with pytest.raises(ValueError, match="CUDA device"):
        select_kernels("cuda", torch.device("cpu"), torch.float32, 64, 16, Path("/nonexistent"))
    kernels = select_kernels("torch", torch.device("cpu"), torch.float32, 64, 16, Path("/x"))
    x = torch.randn(3, 8)
    assert torch.equal(
        kernels.rms_norm(x, torch.ones(8), 1e-6), ref.rms_norm(x, torch.ones(8), 1e-6)
    )


def test_cpu_path_never_imports_cupy() -> None:
    code = (
        "import sys, torch, kernels, kernels.attention_backends, kernels.cuda_ops\n"
        "from engine_svc.models import llama\n"
        "k = kernels.attention_backends.select_kernels('torch', torch.device('cpu'), "
        "torch.float32, 64, 16, None)\n"
        "k.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


def test_missing_cupy_is_a_clear_import_error() -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed")
    with pytest.raises(ImportError, match="tandem\\[gpu\\]"):
        cuda.import_cupy()


def test_wrappers_reject_cpu_tensors_and_bad_shapes() -> None:
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    k = torch.zeros(3, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ops.write_kv_cache(k, k, kc, kc, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ops.rms_norm(k, torch.ones(64, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="multiple of 8"):
        cuda_ops.check_head_dim(20, torch.bfloat16, prefill=False)
    with pytest.raises(ValueError, match="at most 128"):
        cuda_ops.check_head_dim(256, torch.float32, prefill=True)
    cuda_ops.check_head_dim(24, torch.float16, prefill=True)
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        cuda_ops._suffix(torch.float64)


_TORCH = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@pytest.mark.parametrize(("source", "dtype"), list(variants.HEAD_DIMS), ids="-".join)
def test_head_dim_check_refuses_exactly_what_is_not_built(source: str, dtype: str) -> None:
    dims = variants.HEAD_DIMS[(source, dtype)]
    prefill = source == variants.PREFILL
    for d in (dims.multiple, 24, 64, 128, dims.max):  # the compile-tested sizes
        cuda_ops.check_head_dim(d, _TORCH[dtype], prefill=prefill)
    limit = f"multiple of {dims.multiple} and at most {dims.max}"
    for d in (dims.max + dims.multiple, 512, 0, -dims.multiple, dims.max - 1, dims.multiple + 2):
        with pytest.raises(ValueError, match=limit):
            cuda_ops.check_head_dim(d, _TORCH[dtype], prefill=prefill)


def test_decode_head_dim_512_is_refused() -> None:
    # The known case: decode accepted up to 512 bf16 halves, which never built.
    with pytest.raises(ValueError, match="decode attention .* bfloat16 .* at most 256, got 512"):
        cuda_ops.check_head_dim(512, torch.bfloat16, prefill=False)
    # fp32 head sizes that are multiples of 4 but not of 8 build (one module per dtype).
    cuda_ops.check_head_dim(20, torch.float32, prefill=False)
    cuda_ops.check_head_dim(20, torch.float32, prefill=True)


@pytest.mark.parametrize(
    ("q_lens", "dtype", "head_dim", "message"),
    [
        ([1, 1], torch.bfloat16, 512, "decode attention .* at most 256, got 512"),
        ([1, 5], torch.float16, 264, "decode attention .* at most 256, got 264"),
        ([5], torch.float32, 256, "prefill attention .* at most 128, got 256"),
        ([1, 5], torch.float32, 256, "prefill attention .* at most 128, got 256"),  # decode ok
    ],
)
def test_paged_attention_refuses_before_compiling_or_launching(
    monkeypatch: pytest.MonkeyPatch,
    q_lens: list[int],
    dtype: torch.dtype,
    head_dim: int,
    message: str,
) -> None:
    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was compiled or launched")

    monkeypatch.setattr(cuda_ops, "_on", lambda *a, **k: None)  # CPU tensors stand in for CUDA
    monkeypatch.setattr(cuda, "function", no_compile)
    monkeypatch.setattr(cuda, "launch", no_compile)
    case = make_case(q_lens, [10] * len(q_lens), 4, 2, head_dim, dtype, device="cpu")
    with pytest.raises(ValueError, match=message):
        cuda_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, 1.0)


def test_function_refuses_variants_that_are_not_built() -> None:
    # The last check before NVRTC: without CuPy, reaching the compile would be an ImportError.
    with pytest.raises(ValueError, match="at most 256, got 512"):
        cuda.function(
            variants.DECODE, "paged_decode_bf16_q1", variants.attention_defines("bf16", 512)
        )
    with pytest.raises(ValueError, match="HEAD_DIM and one WITH_<dtype>"):
        cuda.function(variants.PREFILL, "paged_prefill_f16", (("HEAD_DIM", 128),))
    with pytest.raises(ValueError, match="takes no defines"):
        cuda.function("norm_rope.cu", "rms_norm_f16", (("HEAD_DIM", 128),))
    assert variants.variant_error(variants.DECODE, variants.attention_defines("f32", 256)) is None
    assert all(variants.variant_error(s, d) is None for s, d in variants.CI_VARIANTS)
