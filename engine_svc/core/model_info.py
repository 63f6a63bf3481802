"""What the engine knows about its model once loaded (``ModelInfo``), and the checks a request
must pass against it: the context length, the vocabulary, the tasks served.

Each path into the engine checks a request once, here: the gRPC edge with the contract's rule
(``check_request``, ``check_pooling``: refused before it is queued), the in-process callers (the
offline ``LLM``) through ``EngineCore.add_request`` with vLLM's lenient rule (``check_generate``).
Pure and torch-free.
"""

from __future__ import annotations

import functools
from typing import Any

from engine_svc.core.errors import ContextLengthError
from engine_svc.core.pooling_params import ModelTasks, PoolingParams, PoolingType
from engine_svc.core.sampling_params import SamplingParams
from protos import types as contract


class ModelInfo(contract.ModelInfo):
    """The contract's facts about the served model (``protos.types.ModelInfo``, one definition:
    what GetModelInfo reports), plus the checks a request must pass against them. Build it with
    ``of``, which takes the pooling facts as the engine's ``ModelTasks``."""

    @classmethod
    def of(cls, tasks: ModelTasks | None = None, **facts: Any) -> ModelInfo:
        """``facts``: the contract's fields but the pooling ones, which come from ``tasks``;
        ``kv_capacity_tokens`` defaults to the blocks times their size."""
        facts.setdefault("kv_capacity_tokens", facts["num_kv_blocks"] * facts["block_size"])
        if facts.get("max_logprobs") == -1:  # --max-logprobs -1: as many as the vocabulary
            facts["max_logprobs"] = facts["vocab_size"]
        tasks = tasks or ModelTasks()
        return cls(
            supported_tasks=tasks.supported_tasks,
            embedding_size=tasks.embedding_size,
            pooling_type=tasks.pooling_type.value if tasks.pooling_type else "",
            is_matryoshka=tasks.is_matryoshka,
            matryoshka_dimensions=tasks.matryoshka_dimensions,
            labels=tasks.labels,
            **facts,
        )

    @functools.cached_property
    def tasks(self) -> ModelTasks:
        """What the model serves, and its pooling facts, as the engine checks them."""
        return ModelTasks(
            supported_tasks=self.supported_tasks,
            embedding_size=self.embedding_size,
            pooling_type=PoolingType(self.pooling_type) if self.pooling_type else None,
            is_matryoshka=self.is_matryoshka,
            matryoshka_dimensions=self.matryoshka_dimensions,
            labels=self.labels,
        )

    def check_prompt(self, prompt_token_ids: list[int], pooling: bool = False) -> None:
        """Raise ``ValueError`` naming the problem with a prompt this model cannot take.

        A pooling prompt may fill the whole context (``pooling``); a generation prompt must leave
        room for one token. Pure and thread-safe: the gRPC layer calls it to answer at once,
        before queueing.
        """
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): "
                f"{bad[:5]}"
            )
        if pooling:
            if len(prompt_token_ids) > self.max_model_len:
                raise ContextLengthError(
                    f"prompt has {len(prompt_token_ids)} tokens; the model's context length is "
                    f"{self.max_model_len}"
                )
        elif len(prompt_token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {len(prompt_token_ids)} tokens; the model's context length is "
                f"{self.max_model_len} and at least one token must be generated"
            )

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` naming a parameter this model cannot take: token ids outside the
        vocabulary, text bad words nobody tokenized. Pure and thread-safe, like ``check_prompt``."""
        params.check_vocab(self.vocab_size)
        if params.bad_words and not params.bad_words_token_ids:
            raise ValueError(
                "bad_words are text: the engine takes them as bad_words_token_ids (the offline "
                "LLM tokenizes them with the model's tokenizer)"
            )

    def check_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> PoolingParams:
        """A pooling request's checks (the task served, its parameters, the prompt); returns the
        parameters with their defaults filled in. Pure and thread-safe, like ``check_prompt``."""
        resolved = self.tasks.check(params)
        self.check_prompt(prompt_token_ids, pooling=True)
        return resolved

    def check_request(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """``check_prompt``, plus: the prompt and ``max_tokens`` must fit the context together.

        This is the contract's rule (CONTEXT_LENGTH_EXCEEDED): a served request is refused rather
        than silently cut at max_model_len. ``max_tokens`` None means "the rest of the context".
        The offline API is lenient instead, as vLLM's: it only checks the prompt, and a request
        that reaches max_model_len finishes with ``length``. A model that does not generate
        refuses it (INVALID_ARGUMENT).
        """
        self.tasks.check_generate()
        self.check_prompt(prompt_token_ids)
        n = len(prompt_token_ids)
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} "
                f"tokens; the model's context length is {self.max_model_len}"
            )

    def check_generate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The offline rule for a generation request (vLLM's ``LLM``, lenient): the model
        generates, the prompt leaves room for one token, and the parameters fit the model
        (``check_params``, at most ``max_logprobs`` logprobs). A request that reaches
        max_model_len finishes with ``length``. ``EngineCore.add_request`` applies it."""
        self.tasks.check_generate()
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs}, got {value}")
