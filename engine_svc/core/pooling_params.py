"""Pooling parameters (embed / classify / score requests) and the model facts they are checked
against. Plain Python, no torch: the gRPC layer validates with it before queueing.

A pooling request runs its prompt through the model like a prefill, samples nothing, and ends
after its last prompt chunk with one pooled result:

    embed     hidden states pooled (``pooling_type``: LAST, MEAN or CLS), cut to ``dimensions``
              (Matryoshka), L2-normalized unless ``normalize`` is False
    classify  the classifier head on the last token's state, softmax over the labels (sigmoid
              for one label) unless ``activation`` is False
    score     classify with one label: the cross-encoder's relevance of the prompt's pair
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from protos.types import PoolingTask


class PoolingType(enum.Enum):
    """How the hidden states of a prompt become one vector (vLLM's names)."""

    LAST = "LAST"  # the last prompt token's state
    MEAN = "MEAN"  # the mean over every prompt token
    CLS = "CLS"  # the first prompt token's state

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip."""
        return self is not PoolingType.LAST


GENERATE = "generate"  # the task name of a model with a language-model head


@dataclass(frozen=True)
class PoolingParams:
    """What a pooling request computes (vLLM's ``PoolingParams``, fields as in the contract).

    ``task`` is required. ``dimensions`` and ``normalize`` apply to embed only, ``activation`` to
    classify and score only; a parameter set for another task is an error (as vLLM). Unset
    (None) ``normalize`` / ``activation`` mean True. ``pooling_type`` is not the client's: the
    engine fills it in when it accepts the request (``ModelTasks.check``).
    """

    task: PoolingTask | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    pooling_type: PoolingType | None = None

    def __post_init__(self) -> None:
        if isinstance(self.task, str):
            try:
                object.__setattr__(self, "task", PoolingTask(self.task))
            except ValueError:
                raise ValueError(
                    f"pooling_params.task must be one of embed, classify, score; got {self.task!r}"
                ) from None
        if self.task is not None and not isinstance(self.task, PoolingTask):
            raise ValueError(f"pooling_params.task must be a PoolingTask, got {self.task!r}")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
        ):
            raise ValueError(
                f"pooling_params.dimensions must be an integer, got {self.dimensions!r}"
            )
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"pooling_params.{name} must be a boolean, got {value!r}")

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether the request must compute every prompt position (MEAN, CLS)."""
        return self.pooling_type is not None and self.pooling_type.needs_every_position


@dataclass(frozen=True)
class ModelTasks:
    """What the served model does, and how its pooling is configured (GetModelInfo's fields).

    ``supported_tasks`` in vLLM's names ("generate", "embed", "classify", "score").
    ``embedding_size`` is the hidden size when "embed" is served (0 otherwise); ``labels`` are
    the classifier's labels in output order when "classify" is served (empty otherwise).
    """

    supported_tasks: tuple[str, ...] = (GENERATE,)
    embedding_size: int = 0
    pooling_type: PoolingType | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()

    @property
    def generates(self) -> bool:
        return GENERATE in self.supported_tasks

    def serves(self, task: PoolingTask) -> bool:
        return task.value in self.supported_tasks

    def _served(self) -> str:
        return ", ".join(self.supported_tasks)

    def check_generate(self) -> None:
        """Raise ``ValueError`` when a generation request reaches a model that cannot generate."""
        if not self.generates:
            raise ValueError(
                f"this model does not generate text (it serves: {self._served()}); "
                "a request for it needs pooling_params"
            )

    def check(self, params: PoolingParams) -> PoolingParams:
        """Validate ``params`` against this model; return them with defaults filled in (and the
        pooling type the request uses). Raises ``ValueError`` naming the parameter."""
        task = params.task
        if task is None:
            raise ValueError(
                f"pooling_params.task must be set; this model serves: {self._served()}"
            )
        if not self.serves(task):
            raise ValueError(
                f"pooling_params.task {task.value!r} is not served by this model; "
                f"it serves: {self._served()}"
            )
        if task is PoolingTask.EMBED:
            if params.activation is not None:
                raise ValueError("pooling_params.activation applies to classify and score only")
            if params.dimensions is not None:
                self._check_dimensions(params.dimensions)
            assert self.pooling_type is not None  # "embed" is served only with a pooling type
            return replace(
                params,
                normalize=True if params.normalize is None else params.normalize,
                pooling_type=self.pooling_type,
            )
        for name in ("dimensions", "normalize"):
            if getattr(params, name) is not None:
                raise ValueError(f"pooling_params.{name} applies to embed only")
        activation = True if params.activation is None else params.activation
        # A sequence classifier reads the last token (transformers' *ForSequenceClassification).
        return replace(params, activation=activation, pooling_type=PoolingType.LAST)

    def _check_dimensions(self, dimensions: int) -> None:
        if not self.is_matryoshka:
            raise ValueError(
                "pooling_params.dimensions is not supported: this model does not declare "
                "Matryoshka embeddings (changing the output dimensions would give poor results)"
            )
        if not 1 <= dimensions <= self.embedding_size:
            raise ValueError(
                f"pooling_params.dimensions must be in [1, {self.embedding_size}], got {dimensions}"
            )
        mds = self.matryoshka_dimensions
        if mds and dimensions not in mds:
            raise ValueError(
                f"pooling_params.dimensions must be one of the model's Matryoshka dimensions "
                f"{list(mds)}, got {dimensions}"
            )
