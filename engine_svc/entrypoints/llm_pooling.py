"""The offline pooling API of ``LLM`` in vLLM's shapes::

    llm.embed(["a", "b"])                      -> [EmbeddingRequestOutput] (.outputs.embedding)
    llm.classify(["a"])                        -> [ClassificationRequestOutput] (.outputs.probs)
    llm.score("query", ["doc 1", "doc 2"])     -> [ScoringRequestOutput] (.outputs.score)
    llm.embed(["a", "b"], lora_request=[LoRARequest("sql", 1, "/adapters/sql"), None])

Prompts are text (tokenized with the model's tokenizer) or ``{"prompt_token_ids": [...]}``.
``lora_request`` works as in ``generate``: one ``LoRARequest`` for every prompt or one per prompt
(``embed``, ``classify``; None: the base model), one for the whole call in ``score``; an adapter
is loaded from its ``lora_path`` the first time its name is used (``LLM(..., enable_lora=True)``).
``score`` pairs 1:1, 1:N or N:N. A cross-encoder (a model serving "score": a one-label sequence
classifier) reads each pair as one prompt, tokenized as a pair (``tokenizer(text_1, text_2)``);
an embedding model scores the cosine similarity of the two embeddings (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.lora.request import LoRARequest
from protos.types import PoolingTask

PromptType = str | dict[str, Any]
_O = TypeVar("_O")


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (raw logits when activation is False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]


@dataclass
class _Pooled:
    request_id: str
    prompt_token_ids: list[int]
    data: npt.NDArray[np.float32] | None = None
    num_cached_tokens: int = 0


class PoolingMixin:
    """``embed``, ``classify`` and ``score`` for ``LLM`` (which provides the attributes)."""

    engine: EngineCore
    tokenizer: Any | None
    _ids: Iterator[int]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        raise NotImplementedError  # LLM's

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[str | None]:
        raise NotImplementedError  # LLM's

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (``dimensions``: Matryoshka cut;
        ``normalize``: L2, default True; or ``pooling_params`` for all or per prompt).
        ``lora_request``: one adapter for all prompts or one per prompt (None: the base
        model), as in ``generate``."""
        default = PoolingParams(PoolingTask.EMBED, dimensions=dimensions, normalize=normalize)
        pooled = self._pool(prompts, pooling_params, default, use_tqdm, lora_request)
        return [_out(p, EmbeddingOutput(_floats(p))) for p in pooled]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        activation: bool | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt (softmax; sigmoid with one label; raw logits with
        ``activation=False``), in the order of the model's labels. ``lora_request``: one
        adapter for all prompts or one per prompt (None: the base model); an adapter changes
        the decoder layers, the classifier head stays the base model's."""
        default = PoolingParams(PoolingTask.CLASSIFY, activation=activation)
        pooled = self._pool(prompts, pooling_params, default, use_tqdm, lora_request)
        return [_out(p, ClassificationOutput(_floats(p))) for p in pooled]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        *,
        activation: bool | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (text_1, text_2) pair: 1:1, 1:N (one text_1 against every text_2)
        or N:N (pairwise). Cross-encoder or embedding cosine, see the module docstring.
        ``lora_request``: one adapter for the whole call (every pair, both sides), or None."""
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(
                "score takes one lora_request for the whole call (a LoRARequest or None), "
                f"not {type(lora_request).__name__}"
            )
        first, second = _as_list(text_1), _as_list(text_2)
        if not first or not second:
            raise ValueError("score needs at least one text_1 and one text_2")
        if len(first) > 1 and len(first) != len(second):
            raise ValueError(
                f"score pairs text_1 and text_2 1:1, 1:N or N:N; got {len(first)} text_1 and "
                f"{len(second)} text_2"
            )
        tasks = self.engine.info.tasks
        if tasks.serves(PoolingTask.SCORE):
            pairs_1 = first * len(second) if len(first) == 1 else first
            return self._cross_encode(pairs_1, second, activation, use_tqdm, lora_request)
        if not tasks.serves(PoolingTask.EMBED):
            raise ValueError(
                "score needs a cross-encoder (task score) or an embedding model (task embed); "
                f"this model serves: {', '.join(tasks.supported_tasks)}"
            )
        if activation is not None:
            raise ValueError("activation applies to cross-encoders; this is an embedding model")
        embedded = self.embed([*first, *second], use_tqdm=use_tqdm, lora_request=lora_request)
        left, right = embedded[: len(first)], embedded[len(first) :]
        if len(left) == 1:
            left = left * len(right)
        outs: list[ScoringRequestOutput] = []
        for a, b in zip(left, right, strict=True):
            u = np.asarray(a.outputs.embedding, np.float64)
            v = np.asarray(b.outputs.embedding, np.float64)
            norms = float(np.linalg.norm(u) * np.linalg.norm(v))
            cos = float(u @ v) / max(norms, 1e-12)
            outs.append(
                PoolingRequestOutput(
                    f"{a.request_id}_{b.request_id}",
                    ScoringOutput(cos),
                    a.prompt_token_ids + b.prompt_token_ids,
                )
            )
        return outs

    # ------------------------------------------------------------------ internals
    def _cross_encode(
        self,
        first: list[PromptType],
        second: list[PromptType],
        activation: bool | None,
        use_tqdm: bool,
        lora_request: LoRARequest | None,
    ) -> list[ScoringRequestOutput]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("score with a cross-encoder needs the model's tokenizer")
        if not all(isinstance(t, str) for t in [*first, *second]):
            raise ValueError("score with a cross-encoder takes texts (it tokenizes each pair)")
        prompts: list[PromptType] = [
            {"prompt_token_ids": list(tokenizer(a, text_pair=b)["input_ids"])}
            for a, b in zip(first, second, strict=True)
        ]
        default = PoolingParams(PoolingTask.SCORE, activation=activation)
        pooled = self._pool(prompts, None, default, use_tqdm, lora_request)
        return [_out(p, ScoringOutput(float(_floats(p)[0]))) for p in pooled]

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        default: PoolingParams,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[_Pooled]:
        """Run one pooling request per prompt (with its adapter, if any) to the end; results
        in input order."""
        items = _as_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [_with_task(pooling_params or default, default.task)] * len(items)
        else:
            params = [_with_task(p, default.task) for p in pooling_params]
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} pooling_params for {len(items)} prompts")
        lora_names = self._lora_names(lora_request, len(items))
        pooled: dict[str, _Pooled] = {}
        unused = SamplingParams(max_tokens=1)
        try:
            for prompt, p, lora_name in zip(items, params, lora_names, strict=True):
                _, token_ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                pooled[rid] = _Pooled(rid, token_ids)
                self.engine.add_request(
                    rid, token_ids, unused, pooling_params=p, lora_name=lora_name
                )
            self._run_pooling(pooled, use_tqdm)
        except BaseException:
            self.engine.abort_requests(list(pooled))
            raise
        return list(pooled.values())

    def _run_pooling(self, pooled: dict[str, _Pooled], use_tqdm: bool) -> None:
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(pooled), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            step = self.engine.step()
            for _, error in step.errors:
                raise error
            for o in step.outputs:
                entry = pooled[o.request_id]
                entry.data = o.pooled
                entry.num_cached_tokens = o.num_cached_tokens
                if pbar is not None:
                    pbar.update(1)
        if pbar is not None:
            pbar.close()


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    return list(prompts)


def _with_task(params: PoolingParams, task: PoolingTask | None) -> PoolingParams:
    if params.task is None:
        return replace(params, task=task)
    if params.task is not task:
        raise ValueError(f"pooling_params.task is {params.task}, but this call computes {task}")
    return params


def _floats(p: _Pooled) -> list[float]:
    assert p.data is not None, f"request {p.request_id} finished without a pooled result"
    values: list[float] = p.data.tolist()
    return values


def _out(p: _Pooled, outputs: _O) -> PoolingRequestOutput[_O]:
    return PoolingRequestOutput(
        p.request_id, outputs, p.prompt_token_ids, num_cached_tokens=p.num_cached_tokens
    )
