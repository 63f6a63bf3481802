"""Offline throughput: Tandem's LLM against transformers' generate() with static batching.

Same random-weight model, same requests (random input and output lengths, ignore_eos), one run:

    python benchmarks/throughput.py                       # CPU defaults, a few minutes
    python benchmarks/throughput.py --num-requests 256 --input-len 100 1024 --output-len 100 1024 \
        --shape qwen3-0.6b --device cuda                   # GPU (issue 4)

Prints a table (output tok/s for each, the ratio, peak memory) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # ~25M parameters: fits a 2-core CPU run in minutes.
    "llama-25m": dict(
        arch="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    # The shape issue 10 measures with: ~25M parameters, hidden 512, 6 layers, 8/4 heads.
    "llama-h512": dict(
        arch="LlamaForCausalLM",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "qwen3-0.6b": dict(
        arch="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen2.5-0.5b": dict(
        arch="Qwen2ForCausalLM",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
}


def build_model(shape: str, out_dir: Path, dtype: torch.dtype) -> Path:
    import transformers

    cfg = dict(SHAPES[shape])
    arch = cfg.pop("arch")
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_requests(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))],
            rng.randint(*output_len),
        )
        for _ in range(n)
    ]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_tandem(
    model_dir: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, float]:
    from engine_svc import LLM, SamplingParams

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    _sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(o for _, o in reqs), "ignore_eos requests must produce max_tokens"
    result = {
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / elapsed,
    }
    del llm
    gc.collect()
    return result


@torch.inference_mode()
def run_transformers(
    model_dir: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, float]:
    """Static batching: fixed batches in arrival order, left-padded, each generating its longest
    output; only the requested tokens of each request count toward throughput."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    pad = 0

    def run_batch(batch: list[tuple[list[int], int]]) -> None:
        longest = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        new = max(o for _, o in batch)
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )

    run_batch(reqs[:2])  # warm-up
    _sync(args.device)
    start = time.perf_counter()
    for i in range(0, len(reqs), args.hf_batch_size):
        run_batch(reqs[i : i + args.hf_batch_size])
    _sync(args.device)
    elapsed = time.perf_counter() - start
    out_tokens = sum(o for _, o in reqs)
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-25m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--hf-batch-size", type=int, default=64, help="default: same as --max-num-seqs")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp) / args.shape, torch.float32)
        vocab = SHAPES[args.shape]["vocab_size"]
        reqs = make_requests(
            args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab, args.seed
        )
        rss0 = peak_rss_mib()
        tandem = run_tandem(model_dir, reqs, args)
        print(f"tandem: {tandem}", flush=True)
        rss_tandem = peak_rss_mib()
        hf = None if args.skip_hf else run_transformers(model_dir, reqs, args)
        rss_hf = peak_rss_mib()

    rows = [("tandem LLM", tandem)] + ([("transformers generate", hf)] if hf else [])
    print()
    print(
        f"shape={args.shape} requests={args.num_requests} input={args.input_len} "
        f"output={args.output_len} "
        f"device={args.device} threads={torch.get_num_threads()} hf_batch={args.hf_batch_size}"
    )
    print(f"{'system':<24}{'elapsed s':>12}{'out tokens':>12}{'out tok/s':>12}")
    for name, r in rows:
        print(
            f"{name:<24}{r['elapsed_s']:>12.2f}{r['output_tokens']:>12}{r['output_tok_s']:>12.1f}"
        )
    if hf:
        print(f"ratio tandem / transformers: {tandem['output_tok_s'] / hf['output_tok_s']:.2f}x")
    print(
        f"peak RSS MiB: start {rss0:.0f}, after tandem {rss_tandem:.0f}, "
        f"after transformers {rss_hf:.0f}"
    )
    if args.device == "cuda":
        print(f"peak CUDA memory GiB: {torch.cuda.max_memory_allocated() / 2**30:.2f}")
    if args.out:
        record = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "args": {
                k: (list(v) if isinstance(v, tuple) else v)
                for k, v in vars(args).items()
                if k != "out"
            },
            "tandem": tandem,
            "transformers": hf,
            "ratio": tandem["output_tok_s"] / hf["output_tok_s"] if hf else None,
            "peak_rss_mib": {"tandem": rss_tandem, "transformers": rss_hf},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
