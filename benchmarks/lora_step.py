"""Decode step time with LoRA adapters: 0, 1 and 4 adapters active in one batch.

    python benchmarks/lora_step.py [--shape llama-h512] [--batch 64] [--rank 16] [--steps 20]

The engine (EngineCore, the real step) serves the random-weight model of ``--shape`` with
``--batch`` requests decoding together, each request on:

    no LoRA     an engine started without --enable-lora (the baseline)
    base        an engine with --enable-lora, no request naming an adapter
    1 adapter   every request on the same adapter
    4 adapters  the batch split evenly over four adapters

Adapters are random, rank ``--rank``, on all seven linears of every layer (the most expensive
case). Each case times ``--steps`` decode steps after the prompts are in, and prints the median
milliseconds per step and its ratio to the baseline. Not a test: a figure for the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance  # noqa: E402
from throughput import SHAPES, build_model  # noqa: E402

from engine_svc.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,  # noqa: E402
)
from engine_svc.core.sampling_params import SamplingParams  # noqa: E402
from engine_svc.engine_core import EngineCore  # noqa: E402
from engine_svc.lora.adapter import TARGETS, ModelDims  # noqa: E402
from engine_svc.lora.config import LoRAConfig  # noqa: E402
from engine_svc.models.llama import DecoderSpec  # noqa: E402
from engine_svc.models.loader import architecture_of, read_hf_config  # noqa: E402


def write_adapter(out: Path, dims: ModelDims, rank: int, seed: int) -> Path:
    """A PEFT-format adapter with random weights on every target of every layer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for target, block in TARGETS.items():
            fin, fout = dims.features[target]
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def engine(model: Path, batch: int, context: int, lora: LoRAConfig | None) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model), dtype="float32", max_model_len=context),
            cache=CacheConfig(num_kv_blocks=batch * (-(-context // 16)) + 16),
            scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096),
            lora=lora,
        )
    )


def decode_ms(core: EngineCore, names: list[str | None], prompt_len: int, steps: int) -> float:
    """Median ms per decode step of len(names) requests decoding together."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(names):
        prompt = [(7 * i + j) % 500 + 10 for j in range(prompt_len)]
        core.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_name=name)
    for _ in range(3):  # the prompts, then two warm-up decode steps
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - start) * 1e3)
    core.run_until_idle()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-h512", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="cases run this many times in turn")
    args = p.parse_args()
    context = args.prompt_len + args.steps + 32
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.shape, Path(tmp) / "model", torch.float32)
        cfg = read_hf_config(model)
        dims = ModelDims.from_spec(DecoderSpec.from_hf_config(cfg, architecture_of(cfg)))
        dirs = [write_adapter(Path(tmp) / f"a{i}", dims, args.rank, i) for i in range(4)]
        plain = engine(model, args.batch, context, None)
        lora = engine(model, args.batch, context, LoRAConfig(4, args.rank))
        for i, d in enumerate(dirs):
            lora.add_lora(f"a{i}", lora.read_lora(str(d)))
        b = args.batch
        cases: dict[str, tuple[EngineCore, list[str | None]]] = {
            "no LoRA": (plain, [None] * b),
            "base": (lora, [None] * b),
            "1 adapter": (lora, ["a0"] * b),
            "4 adapters": (lora, [f"a{i * 4 // b}" for i in range(b)]),
        }
        results: dict[str, list[float]] = {name: [] for name in cases}
        order = list(cases)
        for r in range(args.rounds):  # interleaved and rotated: drift hits every case alike
            for name in order[r % len(order) :] + order[: r % len(order)]:
                core, names = cases[name]
                results[name].append(decode_ms(core, names, args.prompt_len, args.steps))
    print(provenance())
    print(
        f"decode step, {args.batch} rows, shape {args.shape}, rank {args.rank} on all 7 linears, "
        f"torch threads {torch.get_num_threads()}; median of {args.rounds} rounds x "
        f"{args.steps} steps"
    )
    base = statistics.median(results["no LoRA"])
    print(f"{'case':<12}{'ms/step':>10}{'vs no LoRA':>12}")
    for name, values in results.items():
        ms = statistics.median(values)
        print(f"{name:<12}{ms:>10.2f}{ms / base:>11.2f}x")


if __name__ == "__main__":
    main()
