"""``python -m engine_svc``: the engine as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging

from engine_svc import envs
from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, parse_size
from engine_svc.core.scheduler import SchedulerConfig
from engine_svc.lora.config import LoRAConfig, parse_lora_modules
from engine_svc.lora.errors import LoRAError
from protos.grpc_runtime import prefer_polling_io

VERSION = "0.1.0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine_svc", description="Tandem engine service")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded tiny model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "cuda"],
        help="auto: the C decode kernel on the CPU (torch if no C compiler), the CUDA kernels "
        "on CUDA (torch if CuPy is missing or their start-up check fails)",
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
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting-queue limit")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="seconds the engine loop may go without finishing a step before health turns "
        "NOT_SERVING and new requests are refused (until it makes progress again)",
    )
    p.add_argument("--seed", type=int, default=0)
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
        "--max-loras", type=int, default=1, help="adapters on the device at once (default 1)"
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)"
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    # Before anything imports grpc, which reads its experiments then (protos/grpc_runtime.py).
    too_late = prefer_polling_io()
    args = parse_args(argv)
    from engine_svc.rpc.tls import TlsConfig

    try:
        tls = TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
        lora_config = _lora_config(args)
        _cuda_graph_sizes(args)
    except ValueError as e:
        raise SystemExit(f"python -m engine_svc: error: {e}") from None
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if too_late:
        logging.getLogger("engine_svc").warning(too_late)
    from engine_svc.core.engine_core import EngineCore
    from engine_svc.rpc.server import PortUnavailable, ServerConfig, serve

    def build() -> EngineCore:
        """Runs on the engine loop thread, so that all torch work happens on one thread."""
        model = args.model
        if model is None:
            from engine_svc.default_model import NAME, ensure_default_model

            model = str(ensure_default_model())
            served = args.served_model_name or NAME
            logging.getLogger("engine_svc").warning(
                "no --model given: serving the embedded default model "
                "(random weights, gibberish text)"
            )
        else:
            served = args.served_model_name
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                served_model_name=served,
                seed=args.seed,
                max_logprobs=args.max_logprobs,
                pooling_type=args.pooling_type,
            ),
            cache=CacheConfig(
                block_size=args.block_size,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_memory=None
                if args.kv_cache_memory is None
                else parse_size(args.kv_cache_memory),
                gpu_memory_utilization=args.gpu_memory_utilization,
                num_kv_blocks=args.num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len or args.max_num_batched_tokens,
                policy=args.scheduling_policy,
            ),
            device=args.device,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            cuda_graph_sizes=_cuda_graph_sizes(args),
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
        raise SystemExit(f"python -m engine_svc: error: {e}") from None
    try:
        asyncio.run(serve(build, server))
    except (PortUnavailable, LoRAError) as e:  # others keep their traceback: a bug, a bad model
        raise SystemExit(f"python -m engine_svc: error: {e}") from None


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


if __name__ == "__main__":
    main()
