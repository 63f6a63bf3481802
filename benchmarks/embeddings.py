"""Embedding throughput: Tandem's ``LLM.embed`` against a transformers batch encode, same model,
same inputs, one run.

The model is a random-weight Qwen3 embedding model (``Qwen3ForCausalLM`` plus the
sentence-transformers files of Qwen3-Embedding: last-token pooling, then L2 normalization).
``--shape qwen3-embedding-0.6b`` is Qwen3-Embedding-0.6B's config; the default
``qwen3-embedding-0.6b-cpu`` scales it so a run takes minutes on 2 CPU cores: hidden 1024 -> 512,
28 -> 6 layers, 16/8 heads -> 4/2 (head_dim 128 and the 2:1 GQA ratio kept), intermediate
3072 -> 1536 (3x hidden kept); vocabulary (151,669), tied embeddings, rope theta, qk-norm and
RMSNorm eps as the real model.

The peer is what sentence-transformers' ``encode`` does (it cannot be installed here): inputs
sorted by length (longest first), batches of ``--hf-batch-size`` right-padded with an attention
mask, transformers' ``AutoModel`` forward (sdpa attention), the last non-padding token's hidden
state, L2-normalized. Tandem runs the same token ids through ``LLM.embed`` (its scheduler packs
prompts into 2048-token steps, chunking long ones; no padding). Random prompts: the prefix cache
finds nothing. Each system first embeds ``--warmup-inputs`` other inputs of the same length
distribution, untimed: on this VM the first pass over fresh memory is several times slower than
the next (first-touch page faults), for both systems alike. Both results are compared: the two
vector sets must agree to float32 rounding.

    python benchmarks/embeddings.py --out benchmarks/results/embeddings_cpu.json   # ~minutes
    python benchmarks/embeddings.py --shape qwen3-embedding-0.6b --device cuda      # GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flops import body_linears  # noqa: E402
from provenance import provenance  # noqa: E402

_QWEN3_EMBEDDING_0_6B: dict[str, Any] = dict(
    vocab_size=151669,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-embedding-0.6b": _QWEN3_EMBEDDING_0_6B,
    "qwen3-embedding-0.6b-cpu": _QWEN3_EMBEDDING_0_6B
    | dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def build_model(shape: str, out_dir: Path) -> Path:
    """A random-weight Qwen3 embedding checkpoint with Qwen3-Embedding's sentence-transformers
    files (modules.json, 1_Pooling with pooling_mode_lasttoken, 2_Normalize)."""
    import transformers

    config = transformers.Qwen3Config(**SHAPES[shape])
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": config.hidden_size, "pooling_mode_lasttoken": True}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return out_dir


def make_inputs(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_tandem(
    model_dir: Path, inputs: list[list[int]], warm: list[list[int]], args: argparse.Namespace
) -> tuple[float, np.ndarray]:
    from engine_svc import LLM

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(args.input_len[1], args.max_num_batched_tokens),
    )
    assert llm.engine.info.tasks.pooling_type is not None
    assert llm.engine.info.tasks.pooling_type.value == "LAST"  # read from 1_Pooling

    def embed(batch: list[list[int]], use_tqdm: bool) -> np.ndarray:
        outs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=use_tqdm)
        return np.array([o.outputs.embedding for o in outs], dtype=np.float32)

    embed(warm, use_tqdm=False)
    _sync(args.device)
    start = time.perf_counter()
    vectors = embed(inputs, use_tqdm=args.progress)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    return elapsed, vectors


@torch.inference_mode()
def run_hf(
    model_dir: Path, inputs: list[list[int]], warm: list[list[int]], args: argparse.Namespace
) -> tuple[float, np.ndarray, int]:
    """sentence-transformers' encode, by hand: sorted by length, padded batches, last token,
    normalize. Returns (seconds, vectors in input order, tokens computed incl. padding)."""
    from transformers import AutoModel

    dtype = torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype)
    model: Any = AutoModel.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model = model.to(args.device).eval()

    def encode(batch_inputs: list[list[int]]) -> tuple[np.ndarray, int]:
        order = sorted(range(len(batch_inputs)), key=lambda i: -len(batch_inputs[i]))
        out = np.empty((len(batch_inputs), model.config.hidden_size), dtype=np.float32)
        padded = 0
        for start in range(0, len(order), args.hf_batch_size):
            rows = order[start : start + args.hf_batch_size]
            longest = max(len(batch_inputs[i]) for i in rows)
            ids = torch.zeros(len(rows), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, : len(batch_inputs[i])] = torch.tensor(batch_inputs[i])
                mask[r, : len(batch_inputs[i])] = 1
            padded += ids.numel()
            ids, mask = ids.to(args.device), mask.to(args.device)
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = mask.sum(dim=1) - 1  # right padding: the last real token
            pooled = states[torch.arange(len(rows), device=args.device), last]
            vecs = F.normalize(pooled.float(), dim=-1).cpu().numpy()
            out[rows] = vecs
        return out, padded

    encode(warm)
    _sync(args.device)
    begin = time.perf_counter()
    vectors, padded = encode(inputs)
    _sync(args.device)
    return time.perf_counter() - begin, vectors, padded


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-embedding-0.6b-cpu")
    ap.add_argument("--num-inputs", type=int, default=1000)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 512))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=32, help="sentence-transformers' default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup-inputs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true", help="Tandem's progress bar")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()

    cfg = SHAPES[args.shape]
    inputs = make_inputs(args.num_inputs, tuple(args.input_len), cfg["vocab_size"], args.seed)
    warm = make_inputs(args.warmup_inputs, tuple(args.input_len), cfg["vocab_size"], args.seed + 1)
    tokens = sum(len(p) for p in inputs)
    body_params = sum(lin.params for lin in body_linears(cfg))
    systems: dict[str, dict[str, float]] = {}

    def record(name: str, elapsed: float, computed: int) -> None:
        gc.collect()
        systems[name] = {
            "elapsed_s": elapsed,
            "embeddings_per_s": len(inputs) / elapsed,
            "input_tokens_per_s": tokens / elapsed,
            "tokens_computed": computed,
            "model_gflop_per_s": 2 * body_params * tokens / elapsed / 1e9,
            "peak_rss_mib": peak_rss_mib(),
        }
        print(f"{name}: {systems[name]}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp) / args.shape)
        elapsed, tandem_vecs = run_tandem(model_dir, inputs, warm, args)
        record("tandem LLM.embed", elapsed, tokens)
        elapsed, hf_vecs, padded = run_hf(model_dir, inputs, warm, args)
        record(f"transformers encode b{args.hf_batch_size}", elapsed, padded)

    diff = float(np.abs(tandem_vecs - hf_vecs).max())
    cosine = float((tandem_vecs * hf_vecs).sum(axis=1).min())
    names = list(systems)
    ratio = systems[names[0]]["embeddings_per_s"] / systems[names[1]]["embeddings_per_s"]
    print()
    print(
        f"shape={args.shape} inputs={len(inputs)} lengths={list(args.input_len)} "
        f"tokens={tokens} device={args.device} dtype={args.dtype} "
        f"threads={torch.get_num_threads()} body params={body_params / 1e6:.2f}M"
    )
    print(f"{'system':<28}{'elapsed s':>10}{'emb/s':>9}{'tok/s':>10}{'computed':>10}{'GFLOP/s':>9}")
    for name, r in systems.items():
        print(
            f"{name:<28}{r['elapsed_s']:>10.2f}{r['embeddings_per_s']:>9.2f}"
            f"{r['input_tokens_per_s']:>10.0f}{r['tokens_computed']:>10}"
            f"{r['model_gflop_per_s']:>9.1f}"
        )
    print(f"ratio tandem / transformers: {ratio:.2f}x")
    print(f"vectors: max |tandem - transformers| = {diff:.2e}, min cosine = {cosine:.6f}")
    if args.out:
        import transformers

        record_json = {
            **provenance(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "threads": torch.get_num_threads(),
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            "shape": cfg,
            "body_params": body_params,
            "input_tokens": tokens,
            "systems": systems,
            "tandem_ratio": ratio,
            "agreement": {"max_abs_diff": diff, "min_cosine": cosine},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record_json, indent=2, default=str))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
