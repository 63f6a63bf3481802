"""Speculative decoding (n-gram proposals, a draft model) against none, in one run: output
tokens/s, the proposals' acceptance, and the tokens each verification step emits.

    python benchmarks/spec_decode.py [--shape llama-h512] [--batch 1 16] [--k 4] [--rounds 2]
    python benchmarks/spec_decode.py --device cuda --dtype bfloat16 --shape qwen3-0.6b \\
        --batch 1 16 64          # the GPU phase of scripts/gpu_session.sh
    python benchmarks/spec_decode.py --systems none draft --append \\
        --out benchmarks/results/spec_decode_cpu.json   # a run added beside the file's rows

The draft model (``--systems draft``) is made from the target on the fly: its first
``--draft-layers`` layers (default a quarter, at least one) with the target's embeddings, final
norm and head (``tests/parity/draft_checkpoint.py``).

The workload is edit-style: each prompt is a few random spans, each repeated several times (a
document and its revision), and generation is greedy with ``--max-tokens`` new tokens (EOS
ignored). A random-weight model does not copy its prompt the way a trained one copies a document
it edits, so acceptance here is what the model's own repetition gives: the figure to compare is
the ratio to no speculation on the same prompts in the same run, and the acceptance beside it.
Both engines are the real ``EngineCore`` stepped to the end; their greedy outputs are checked
equal (speculation must not change them). Systems alternate within each round (the machine
drifts); the median round is reported.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance  # noqa: E402
from step_anatomy import cached_model  # noqa: E402
from throughput import SHAPES  # noqa: E402

from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_svc.core.sampling_params import SamplingParams  # noqa: E402
from engine_svc.engine_core import EngineCore  # noqa: E402
from engine_svc.spec_decode.config import DraftModelConfig, NgramConfig  # noqa: E402
from tests.parity.draft_checkpoint import layer_prefix_draft  # noqa: E402


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        doc: list[int] = []
        for _ in range(4):
            span = [rng.randrange(10, vocab) for _ in range(rng.randint(12, 24))]
            doc += span * rng.randint(2, 3)
        out.append(doc)
    return out


def run(core: EngineCore, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(batch))]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    for rid, p in zip(ids, batch, strict=True):
        core.add_request(rid, p, params)
    steps = drafts = proposed = accepted = 0
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    while core.has_unfinished_requests():
        out = core.step()
        steps += 1
        for o in out.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
        s = out.stats
        drafts += s.spec_num_drafts
        proposed += s.spec_num_draft_tokens
        accepted += s.spec_num_accepted_tokens
    elapsed = time.perf_counter() - start
    produced = sum(len(t) for t in tokens.values())
    return dict(
        elapsed_s=elapsed, output_tokens=produced, output_tok_s=produced / elapsed, steps=steps,
        drafts=drafts, proposed=proposed, accepted=accepted,
        acceptance=accepted / proposed if proposed else None,
        tokens_per_verify=(accepted + drafts) / drafts if drafts else None,
        outputs=[tokens[r] for r in ids],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-h512")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--systems", nargs="+", choices=["none", "ngram", "draft"], default=["none", "ngram"]
    )
    ap.add_argument("--draft-layers", type=int, default=None, help="default: a quarter")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--append", action="store_true",
        help="add this run to --out's \"runs\" list, keeping what the file holds",
    )  # fmt: skip
    args = ap.parse_args()
    if "none" not in args.systems:
        ap.error("--systems needs none (the baseline)")
    dtype = getattr(torch, args.dtype)
    model = cached_model(args.shape, dtype)
    vocab = SHAPES[args.shape]["vocab_size"]
    layers = SHAPES[args.shape]["num_hidden_layers"]
    args.draft_layers = args.draft_layers or max(1, layers // 4)
    systems: dict[str, NgramConfig | DraftModelConfig | None] = {"none": None}
    if "ngram" in args.systems:
        systems[f"ngram k={args.k}"] = NgramConfig(args.k, 1, 4)
    if "draft" in args.systems:
        draft = model.parent / f"{model.name}-first{args.draft_layers}"
        if not (draft / "model.safetensors").is_file():
            layer_prefix_draft(model, draft, args.draft_layers)
        name = f"draft {args.draft_layers}/{layers}L k={args.k}"
        systems[name] = DraftModelConfig(str(draft), args.k)
    engines = {}
    for name, sp in systems.items():
        engines[name] = EngineCore(
            EngineConfig(
                model=ModelConfig(str(model), dtype=args.dtype, max_model_len=1024),
                cache=CacheConfig(num_kv_blocks=max(args.batch) * 40 + 16),
                scheduler=SchedulerConfig(max_num_seqs=max(args.batch)),
                device=args.device,
                speculative=sp,
            )
        )
    rows = []
    print(f"{'batch':>5} {'system':>20} {'tok/s':>9} {'steps':>6} {'accept':>7} {'tok/verify':>10} "
          f"{'x none':>7}")  # fmt: skip
    for b in args.batch:
        batch = prompts(b, vocab, seed=b)
        for core in engines.values():  # warm-up
            run(core, batch[:1], 8)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, core in engines.items():
                rounds[name].append(run(core, batch, args.max_tokens))
        outs = [r["outputs"] for runs in rounds.values() for r in runs]
        assert all(o == outs[0] for o in outs), "speculation changed the greedy output"
        # the same median as each row's (the upper middle of an even count): none is 1.00x
        base = sorted(r["output_tok_s"] for r in rounds["none"])[len(rounds["none"]) // 2]
        for name, runs in rounds.items():
            med = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
            med = {k: v for k, v in med.items() if k != "outputs"}
            ratios = [
                r["output_tok_s"] / n["output_tok_s"]
                for r, n in zip(runs, rounds["none"], strict=True)
            ]
            row = dict(batch=b, system=name, **med, ratio_by_round=ratios)
            rows.append(row)
            acc = "-" if med["acceptance"] is None else f"{med['acceptance']:.0%}"
            tpv = "-" if med["tokens_per_verify"] is None else f"{med['tokens_per_verify']:.2f}"
            print(f"{b:>5} {name:>20} {med['output_tok_s']:9.1f} {med['steps']:>6} {acc:>7} "
                  f"{tpv:>10} {med['output_tok_s'] / base:6.2f}x")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = dict(**provenance(), args=vars(args) | {"out": str(args.out)}, rows=rows)
        if args.append and args.out.is_file():
            kept = json.loads(args.out.read_text())
            kept.setdefault("runs", []).append(result)
            result = kept
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
