"""Offline generation demo: ``python -m engine_svc.entrypoints.offline_demo [--model PATH]``."""

from __future__ import annotations

import argparse
import logging

from engine_svc import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", default=None, help="HF checkpoint dir (default: embedded tiny model)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument(
        "--seed", type=int, default=None, help="per-request seed (default: unseeded)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = LLM(args.model)
    prompts = [
        "Hello, my name is",
        "The engine schedules every request",
        "Tandem serves large language models",
        "The quick brown fox",
    ]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        print(f"\n{out.prompt!r} -> {completion.text!r}")
        print(f"  {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")


if __name__ == "__main__":
    main()
