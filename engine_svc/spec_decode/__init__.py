"""Speculative decoding (issue 34): proposals checked by the target model in one step.

``config``: vLLM's speculative config, parsed. ``ngram``: prompt-lookup proposals (no model).
``draft_model``: a small model's proposals, its KV cache over the target's blocks.
``rejection``: accepting or rejecting proposed tokens against the target model's distribution,
exactly (greedy: the longest matching prefix; sampled: rejection sampling, which leaves the
target's distribution unchanged).
"""
