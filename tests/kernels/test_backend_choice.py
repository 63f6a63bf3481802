"""``--attention-backend auto`` on a GPU takes the CUDA kernels, protected: anything that stops
them (no CuPy, a compile error, a kernel that disagrees with its torch reference in the start-up
check) is logged and the torch references serve instead; asked for by name, it is an error. The
start-up check itself (``kernels.self_check``) runs here on the references, and catches a kernel
that is off."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kernels import attention_backends, reference, reference_norm_rope, self_check
from kernels.attention_backends import Kernels, TorchAttention, select_kernels

CUDA = torch.device("cuda")


def _references() -> Kernels:
    return Kernels(
        TorchAttention(),
        reference_norm_rope.rms_norm,
        reference_norm_rope.fused_add_rms_norm,
        reference.silu_and_mul,
        reference_norm_rope.qk_norm_rope_kv,
    )


@pytest.mark.parametrize(
    "error",
    [
        ImportError("Tandem's CUDA kernels need CuPy"),
        RuntimeError("NVRTC_ERROR_COMPILATION"),
        self_check.KernelCheckFailed("paged_attention disagrees with its reference"),
    ],
)
def test_auto_falls_back_to_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    def fail(*args: object) -> Kernels:
        raise error

    monkeypatch.setattr(attention_backends, "cuda_kernels", fail)
    with caplog.at_level(logging.WARNING, logger="kernels.attention_backends"):
        kernels = select_kernels("auto", CUDA, torch.bfloat16, 128, 16, Path("/x"))
    assert kernels.attention.name == "torch" and kernels.qk_norm_rope_kv is None
    assert f"CUDA kernels unavailable ({error})" in caplog.text
    with pytest.raises(type(error)):
        select_kernels("cuda", CUDA, torch.bfloat16, 128, 16, Path("/x"))


def test_auto_without_cupy_or_a_gpu_serves_the_references(caplog: pytest.LogCaptureFixture) -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed: this is the machine without it")
    with caplog.at_level(logging.WARNING, logger="kernels.attention_backends"):
        kernels = select_kernels("auto", CUDA, torch.bfloat16, 128, 16, Path("/x"))
    assert kernels.attention.name == "torch"
    assert "CUDA kernels unavailable" in caplog.text and "CuPy" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [24, 64])
def test_the_startup_check_passes_the_references(dtype: torch.dtype, head_dim: int) -> None:
    self_check.check(_references(), torch.device("cpu"), dtype, head_dim, 16)


def _off_by(factor: float, fn):  # type: ignore[no-untyped-def]
    def wrong(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o * factor for o in out)
        return out * factor

    return wrong


@pytest.mark.parametrize(
    ("field", "name"),
    [
        ("rms_norm", "rms_norm"),
        ("fused_add_rms_norm", "fused_add_rms_norm"),
        ("silu_and_mul", "silu_and_mul"),
        ("qk_norm_rope_kv", "qk_norm_rope_kv (q)"),
    ],
)
def test_the_startup_check_names_a_kernel_that_is_off(field: str, name: str) -> None:
    refs = _references()
    broken = Kernels(**{**refs.__dict__, field: _off_by(1.05, getattr(refs, field))})
    with pytest.raises(
        self_check.KernelCheckFailed, match=name.replace("(", r"\(").replace(")", r"\)")
    ):
        self_check.check(broken, torch.device("cpu"), torch.float32, 64, 16)


def test_the_startup_check_catches_attention_that_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    class Off(TorchAttention):
        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = super().forward(*args, **kwargs)
            out[0] += 0.1  # only the decode row: a wrong split-K merge, say
            return out

    refs = _references()
    broken = Kernels(**{**refs.__dict__, "attention": Off()})
    with pytest.raises(self_check.KernelCheckFailed, match="paged_attention"):
        self_check.check(broken, torch.device("cpu"), torch.float32, 64, 16)
