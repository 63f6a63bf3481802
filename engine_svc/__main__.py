"""``python -m engine_svc``: the engine as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import NoReturn

from engine_svc import envs
from engine_svc.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    parse_size,
)
from engine_svc.lora.config import LoRAConfig, parse_lora_modules
from engine_svc.lora.errors import LoRAError
from engine_svc.model_source import (
    TRUST_REMOTE_CODE_REFUSAL,
    ModelSourceError,
    read_chat_template,
    resolve_model,
    resolve_tokenizer,
)
from engine_svc.spec_decode.config import parse_speculative_config
from protos.grpc_runtime import prefer_polling_io

VERSION = "0.1.0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every engine flag, each with its help (vLLM's spellings accepted beside ours)."""
    p = argparse.ArgumentParser(prog="python -m engine_svc", description="Tandem engine service")
    model = p.add_argument_group("model and tokenizer")
    model.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face checkpoint directory (config.json + *.safetensors), or a "
        "Hugging Face Hub repo id such as Qwen/Qwen3-0.6B, taken from the Hugging Face cache or "
        "downloaded into it (HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE apply); an existing "
        "directory always wins (default: the embedded tiny model, random weights)",
    )
    model.add_argument(
        "--revision",
        default=None,
        help="the branch, tag or commit of a Hub --model (default: main)",
    )
    model.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="the Hugging Face cache directory Hub models are looked up in and downloaded into "
        "(default: HF_HUB_CACHE, else ~/.cache/huggingface/hub)",
    )
    model.add_argument(
        "--tokenizer",
        default=None,
        help="load the tokenizer (and chat template) from this directory or Hub repo id instead "
        "of --model's; the engine serves it to the gateways",
    )
    model.add_argument(
        "--tokenizer-revision",
        default=None,
        help="the branch, tag or commit of a Hub --tokenizer (default: main)",
    )
    model.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template file, or the template itself, served to the gateways in "
        "place of the model's",
    )
    model.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="refused: Tandem runs its own model code (Llama, Qwen2, Qwen3 families) and never "
        "executes a checkpoint's code",
    )
    model.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use and /v1/models shows (default: the --model repo id, "
        "or the checkpoint directory's name)",
    )
    p.add_argument("--host", default=ServerConfig.host, help="address to serve gRPC on")
    p.add_argument(
        "--port", type=int, default=ServerConfig.port, help="gRPC port (0: any free port)"
    )
    p.add_argument(
        "--dtype",
        default=ModelConfig.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype; auto follows the checkpoint's config.json as vLLM "
        "does (float32 checkpoints run in bfloat16 on a GPU)",
    )
    p.add_argument(
        "--device",
        default=EngineConfig.device,
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (auto: CUDA when available, else the CPU)",
    )
    p.add_argument(
        "--attention-backend",
        default=EngineConfig.attention_backend,
        choices=["auto", "torch", "cpu", "cuda"],
        help="auto: the C decode kernel on the CPU (torch if no C compiler), the CUDA kernels "
        "on CUDA (torch if CuPy is missing or their start-up check fails)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=EngineConfig.tensor_parallel_size,
        metavar="N",
        help="shard the model over N processes, one device each (vLLM's flag; on the CPU the "
        "ranks share its cores); 1: one process (default %(default)s)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=("uni", "mp"),
        default=None,
        help="how the ranks run (vLLM's flag): uni, in this process (one rank); mp, rank 0 in "
        "this process and a worker process for each other rank (default: uni for one rank, mp "
        "for more)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding (vLLM\'s flag): \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}\' '
        "proposes up to 4 tokens a step from earlier occurrences of the context's last tokens; "
        '\'{"model": "/path/to/draft", "num_speculative_tokens": 4}\' has a small draft model '
        "of the same vocabulary propose them (same device and dtype, its own KV cache); "
        "outputs are the same as without it (greedy) or drawn from the same distribution",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs: every step runs the model eagerly",
    )
    p.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="decode batch sizes captured as CUDA graphs: one value is the largest (with 1, 2, "
        "4 and multiples of 8 below it), several the exact list (default: up to "
        "--max-num-seqs, at most 512)",
    )
    p.add_argument(
        "--max-cuda-graph-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="the largest decode batch captured as a CUDA graph (same as one --cuda-graph-sizes "
        "value); larger decode steps run eagerly",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the checkpoint's "
        "max_position_embeddings, shortened to what the KV cache holds)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="requests running at once (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="the token budget of one engine step; longer prompts are prefilled in chunks "
        "(default %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=CacheConfig.block_size,
        help="tokens per KV cache block, a power of two (default %(default)s)",
    )
    # vLLM spells it --no-enable-prefix-caching (and --enable-prefix-caching, the default).
    p.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        dest="no_prefix_caching",
        action="store_true",
        default=not CacheConfig.enable_prefix_caching,
        help="never reuse the KV blocks of a prompt prefix seen before",
    )
    p.add_argument(
        "--enable-prefix-caching",
        dest="no_prefix_caching",
        action="store_false",
        default=not CacheConfig.enable_prefix_caching,
        help="reuse the KV blocks of prompt prefixes seen before (the default)",
    )
    p.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        default=None,
        metavar="SIZE",
        help="KV cache budget: bytes or a size such as 512MiB or 4GiB (vLLM's "
        "--kv-cache-memory-bytes); overrides --gpu-memory-utilization",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=CacheConfig.gpu_memory_utilization,
        help="share of the GPU's memory the engine may fill, weights and KV cache together "
        "(default %(default)s); on the CPU the KV cache gets a fixed budget unless "
        "--kv-cache-memory",
    )
    p.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=int,
        default=None,
        metavar="N",
        help="exact KV block count, overriding the memory budget (vLLM's "
        "--num-gpu-blocks-override)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=ServerConfig.max_waiting,
        help="waiting-queue limit: requests beyond it are refused with RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=ModelConfig.max_logprobs,
        help="the most logprobs (and prompt logprobs) a request may ask for; -1: the whole "
        "vocabulary, which lets requests ask for -1 (vLLM's) (default %(default)s)",
    )
    p.add_argument(
        "--scheduling-policy",
        default=SchedulerConfig.policy,
        choices=["fcfs", "priority"],
        help="fcfs: in arrival order; priority: by each request's priority (lower first), "
        "then arrival",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServerConfig.shutdown_timeout_s,
        help="seconds running requests may take to finish after SIGTERM before they are "
        "aborted (default %(default)s)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=ServerConfig.stall_timeout_s,
        help="seconds the engine loop may go without finishing a step before health turns "
        "NOT_SERVING and new requests are refused (until it makes progress again)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=ModelConfig.seed,
        help="the engine's random seed, for requests without their own (default %(default)s)",
    )
    p.add_argument(
        "--pooling-type",
        default=None,
        choices=["LAST", "MEAN", "CLS"],
        help="how embeddings pool the hidden states (default: the checkpoint's "
        "sentence-transformers Pooling config, else LAST)",
    )
    p.add_argument(
        "--profile-dir",
        default=envs.profile_dir(),
        help="directory for torch profiler traces (StartProfile / StopProfile); default "
        "TANDEM_PROFILE_DIR; unset: profiling is off",
    )
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--max-loras",
        type=int,
        default=LoRAConfig.max_loras,
        help="adapters on the device at once (default %(default)s)",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=LoRAConfig.max_lora_rank,
        help="largest adapter rank accepted (default %(default)s)",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory; the least recently used idle ones beyond it are read "
        "again from disk when needed (default: no limit)",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories to serve from the start (needs --enable-lora)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA: require client certificates (mTLS)")
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="extra plaintext port serving only grpc.health.v1 (for probes that cannot do TLS)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    # Before anything imports grpc, which reads its experiments then (protos/grpc_runtime.py).
    too_late = prefer_polling_io()
    args = parse_args(argv)
    from engine_svc.rpc.tls import TlsConfig

    if args.trust_remote_code:
        usage_error(TRUST_REMOTE_CODE_REFUSAL)
    try:
        tls = TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
        lora_config = _lora_config(args)
        _cuda_graph_sizes(args)
        speculative = (
            None
            if args.speculative_config is None
            else parse_speculative_config(args.speculative_config)
        )
        if args.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}"
            )
        if args.distributed_executor_backend == "uni" and args.tensor_parallel_size > 1:
            raise ValueError("--distributed-executor-backend uni runs one rank only; use mp")
        kv_cache_memory = _kv_cache_memory(args)
        chat_template = (
            None if args.chat_template is None else read_chat_template(args.chat_template)
        )
    except ValueError as e:
        usage_error(str(e))
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if too_late:
        logging.getLogger("engine_svc").warning(too_late)
    from engine_svc.engine_core import EngineCore
    from engine_svc.executor.multiproc import exit_engine
    from engine_svc.rpc.server import EngineFailed, PortUnavailable, serve

    def build() -> EngineCore:
        """Runs on the engine loop thread, so that all torch work happens on one thread (and
        after serve() has checked the port, so a taken port is known before any download)."""
        model, served = _model_dir(args)
        tokenizer = None
        if args.tokenizer is not None:
            tokenizer = resolve_tokenizer(
                args.tokenizer, revision=args.tokenizer_revision, download_dir=args.download_dir
            ).path
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                served_model_name=served,
                seed=args.seed,
                max_logprobs=args.max_logprobs,
                pooling_type=args.pooling_type,
                tokenizer=None if tokenizer is None else str(tokenizer),
                chat_template=chat_template,
            ),
            cache=CacheConfig(
                block_size=args.block_size,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization,
                num_kv_blocks=args.num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                policy=args.scheduling_policy,
            ),
            device=args.device,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            cuda_graph_sizes=_cuda_graph_sizes(args),
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            speculative=speculative,
            lora=lora_config,
            profile_dir=args.profile_dir,
        )
        return EngineCore(config)

    try:
        server = ServerConfig(
            host=args.host,
            port=args.port,
            max_waiting=args.max_waiting,
            shutdown_timeout_s=args.shutdown_timeout,
            stall_timeout_s=args.stall_timeout,
            version=VERSION,
            tls=tls,
            health_port=args.health_port,
            freeze_gc_heap=True,
        )
    except ValueError as e:
        usage_error(str(e))
    try:
        asyncio.run(serve(build, server))
    except ModelSourceError as e:  # --model / --tokenizer not found: a usage error
        usage_error(str(e))
    except (PortUnavailable, LoRAError) as e:  # others keep their traceback: a bug, a bad model
        raise SystemExit(f"python -m engine_svc: error: {e}") from None
    except EngineFailed as e:  # reported; threads may be stuck in a collective: exit now
        exit_engine(str(e))


class UsageError(SystemExit):
    """A bad command line: exit status 2 (as argparse's own errors), after one line on stderr;
    ``str()`` is that line."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


def usage_error(message: str) -> NoReturn:
    """Print ``python -m engine_svc: error: message`` and exit 2, with no traceback."""
    line = f"python -m engine_svc: error: {message}"
    print(line, file=sys.stderr, flush=True)
    raise UsageError(line)


def _model_dir(args: argparse.Namespace) -> tuple[str, str | None]:
    """The checkpoint directory to load and the served model name: --model resolved (a
    directory, else a Hub repo id from the cache or downloaded; ModelSourceError says why not),
    or the embedded default model without --model. A Hub model is served under its repo id, as
    vLLM does, unless --served-model-name says otherwise."""
    if args.model is None:
        from engine_svc.default_model import NAME, ensure_default_model

        logging.getLogger("engine_svc").warning(
            "no --model given: serving the embedded default model (random weights, gibberish text)"
        )
        return str(ensure_default_model()), args.served_model_name or NAME
    source = resolve_model(args.model, revision=args.revision, download_dir=args.download_dir)
    served = args.served_model_name or source.repo_id  # None: the directory's name
    return str(source.path), served


def _kv_cache_memory(args: argparse.Namespace) -> int | None:
    """--kv-cache-memory in bytes (None: not given); ValueError names the flag."""
    if args.kv_cache_memory is None:
        return None
    try:
        return parse_size(args.kv_cache_memory)
    except ValueError as e:
        raise ValueError(f"--kv-cache-memory: {e}") from None


def _cuda_graph_sizes(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--cuda-graph-sizes or --max-cuda-graph-batch-size (not both); ValueError names the flag."""
    if args.cuda_graph_sizes is not None and args.max_cuda_graph_batch_size is not None:
        raise ValueError("give --cuda-graph-sizes or --max-cuda-graph-batch-size, not both")
    if args.max_cuda_graph_batch_size is not None:
        sizes: list[int] = [args.max_cuda_graph_batch_size]
    elif args.cuda_graph_sizes is not None:
        sizes = args.cuda_graph_sizes
    else:
        return None
    if any(n < 1 for n in sizes):
        raise ValueError(f"CUDA graph batch sizes must be at least 1, got {sizes}")
    return tuple(sizes)


def _lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRA flags as a config (None without --enable-lora); ValueError names the flag."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=parse_lora_modules(args.lora_modules),
    )


def exit_without_finalizing(status: int) -> NoReturn:
    """End the process once the server has stopped: flush the logs and stdio, then skip the
    interpreter's finalization, where triton's bindings (pulled in through torch by transformers
    or xgrammar) print dozens of ``nanobind: leaked ...`` lines at exit. Nothing of the engine's
    runs at finalization: the server drained, its threads ended, its files are closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
    exit_without_finalizing(0)
