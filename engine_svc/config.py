"""Engine configuration: frozen dataclasses built once, from the offline API or CLI flags. Their
defaults are the only ones: ``python -m engine_svc`` and ``LLM`` take theirs from here.

Facts found at run time live apart, never written back into these: the number of KV blocks in
``KVCacheLayout``, the served context length (the checkpoint's, or ``max_model_len``, shortened
to what the KV cache holds) in ``ModelInfo`` and the ``Scheduler``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_svc.core.sampling_params import DEFAULT_MAX_LOGPROBS
from engine_svc.lora.config import LoRAConfig
from engine_svc.spec_decode.config import SpeculativeConfig
from kernels.attention_backends import BACKENDS

if TYPE_CHECKING:  # the server imports grpc; python -m engine_svc must not before it starts
    from engine_svc.rpc.tls import TlsConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(value: int | str) -> int:
    """'512MiB', '2G', '1.5GB' or a plain byte count -> bytes (binary units throughout)."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot parse memory size {value!r} (try '512MiB' or '4GiB')")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit if unit != "B" else ""])


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    served_model_name: str | None = None
    seed: int = 0
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # How "embed" pools: LAST | MEAN | CLS. None: the checkpoint's sentence-transformers
    # Pooling module, else LAST (models/tasks.py). Given, it overrides the checkpoint.
    pooling_type: str | None = None
    # The directory of the tokenizer files the engine serves (GetTokenizer) and compiles
    # structured outputs against (--tokenizer, resolved). None: the model directory's.
    tokenizer: str | None = None
    # A Jinja chat template served in place of the model's (--chat-template, already read from
    # its file). None: the tokenizer directory's own.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: the device default
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact block count; overrides the memory budget

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. (The context length is not one: it is found at load time.)"""

    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # the token budget of one step
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # auto | cpu | cuda
    # auto | torch | cpu | cuda (kernels.attention_backends); auto: the C kernel on the CPU,
    # the CUDA kernels on CUDA (torch when CuPy or the kernels' start-up check fails).
    attention_backend: str = "auto"
    # Pad decode-only steps to batch-size buckets in static buffers (what CUDA graphs need).
    # None: on CUDA only (on the CPU padding is pure cost).
    pad_decode_batches: bool | None = None
    # Never capture CUDA graphs: every step runs the model eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # Decode batch sizes captured as CUDA graphs (vLLM's --cuda-graph-sizes): one value is the
    # largest, with 1, 2, 4, then multiples of 8 below it; several are the exact list. None:
    # up to max_num_seqs (at most 512). Decode steps are padded to the next size; larger
    # ones run eagerly.
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Multi-LoRA serving (--enable-lora and friends); None: the engine serves no adapters.
    lora: LoRAConfig | None = None
    # Where StartProfile / StopProfile write torch profiler traces; None: profiling is off.
    profile_dir: str | None = None
    # Tensor-parallel ranks (vLLM's --tensor-parallel-size): the model sharded over this many
    # processes, one device each (engine_svc.executor). 1: the in-process model runner.
    tensor_parallel_size: int = 1
    # How the ranks run (vLLM's --distributed-executor-backend): "uni", the in-process model
    # runner (one rank); "mp", the multi-process executor (rank 0 in this process, a worker
    # process for each other rank). None: "uni" for one rank, "mp" for more.
    distributed_executor_backend: str | None = None
    # Speculative decoding (vLLM's --speculative-config): n-gram or draft-model proposals
    # verified in one step (engine_svc.spec_decode). None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
                raise ValueError(f"cuda_graph_sizes must be positive integers, got {sizes!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.distributed_executor_backend not in (None, "uni", "mp"):
            raise ValueError(
                "distributed_executor_backend must be 'uni' or 'mp', got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank only; use 'mp'")
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )


@dataclass(frozen=True)
class ServerConfig:
    """How the engine serves, from the command line (``python -m engine_svc``)."""

    host: str = "127.0.0.1"
    port: int = 50051
    max_waiting: int = 1024  # requests waiting beyond it are refused (RESOURCE_EXHAUSTED)
    shutdown_timeout_s: float = 30.0
    # No finished step for this long, with the loop busy, reads as stalled (NOT_SERVING).
    stall_timeout_s: float = 60.0
    version: str = "0.0.0"
    tls: TlsConfig | None = None
    # An extra plaintext port serving only grpc.health.v1, for probes that cannot do TLS.
    health_port: int | None = None
    # Freeze the heap once the engine is built (protos.gc_heap): what a server process
    # wants; off for servers started inside a test process, whose heap is the test run's.
    freeze_gc_heap: bool = False

    def __post_init__(self) -> None:
        if self.stall_timeout_s <= 0:
            raise ValueError(f"--stall-timeout must be positive, got {self.stall_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")


@dataclass(frozen=True)
class KVCacheLayout:
    """What the model runner found it could allocate."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
