"""Speculative decoding (issue 34): proposals checked by the target model in one step.

``ngram``: prompt-lookup proposals (no model). ``rejection``: accepting or rejecting proposed
tokens against the target model's distribution, exactly (greedy: the longest matching prefix;
sampled: rejection sampling, which leaves the target's distribution unchanged).
"""
