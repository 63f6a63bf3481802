"""Gateway configuration: command-line flags with defaults from ``TANDEM_*`` environment variables.

This is the only module of the gateway that reads the environment. Besides the flags' variables
it reads the two that a ``--workers`` supervisor (``frontend_svc.server.workers``) sets for its
workers: the config it parsed, and where the workers share their Prometheus figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from frontend_svc.reasoning import REASONING_PARSER_NAMES
from frontend_svc.tool_parsers import TOOL_PARSER_NAMES

ENV_PREFIX = "TANDEM_"
WORKER_CONFIG_ENV = ENV_PREFIX + "WORKER_CONFIG"  # not a flag: the config, supervisor -> workers
# prometheus_client's own name; it reads it too, when first imported, to keep figures in files.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's choices


@dataclass(frozen=True)
class BackoffConfig:
    """Exponential backoff between engine reconnection attempts.

    The cap is short on purpose: a restarted engine is back in rotation within about
    ``max_s`` of its readiness, and a refused loopback or LAN connect every half second costs
    nothing worth saving."""

    initial_s: float = 0.1
    max_s: float = 0.5
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s < self.initial_s or self.multiplier < 1:
            raise ValueError(f"invalid backoff {self}")


@dataclass(frozen=True)
class TlsClientConfig:
    """PEM paths for TLS to the engines: the CA that signed them, and our pair for mTLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None  # checked against the engine certificate instead of the host

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together (the gateway's client pair)")
        if self.ca is None and self.cert is not None:
            raise ValueError("--tls-cert needs --tls-ca (the CA that signed the engine)")

    @property
    def enabled(self) -> bool:
        return self.ca is not None


@dataclass(frozen=True)
class HttpsConfig:
    """PEM paths for serving HTTPS instead of HTTP (vLLM's ``--ssl-*`` flags, uvicorn's
    ``ssl_*`` options); without a certificate the gateway serves plain HTTP."""

    keyfile: str | None = None
    certfile: str | None = None  # may hold the key too, as with uvicorn
    ca_certs: str | None = None  # the CA that client certificates are checked against
    cert_reqs: int = 0  # ssl.CERT_NONE; 1: a client certificate is optional, 2: required

    def __post_init__(self) -> None:
        if self.certfile is None and (self.keyfile or self.ca_certs or self.cert_reqs):
            raise ValueError(
                "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"
            )
        if self.cert_reqs not in (0, 1, 2):
            raise ValueError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
        if self.cert_reqs and self.ca_certs is None:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs (the CA of the clients)")

    @property
    def enabled(self) -> bool:
        return self.certfile is not None


@dataclass(frozen=True)
class RoutingConfig:
    """How a request picks one of several engines (see ``frontend_svc.engine.router``)."""

    resolve_interval_s: float = 10.0  # how often dns:/// engine names are looked up again
    affinity_min_tokens: int = 64  # shared prompt prefix that makes affinity worth it; 0: off
    affinity_max_imbalance: int = 8  # extra requests the affine engine may carry over the least

    def __post_init__(self) -> None:
        if self.resolve_interval_s <= 0:
            raise ValueError("--engine-resolve-interval must be > 0")
        if self.affinity_min_tokens < 0 or self.affinity_max_imbalance < 0:
            raise ValueError("prefix-affinity settings must be >= 0")


@dataclass(frozen=True)
class LimitsConfig:
    """What one HTTP request may cost the gateway (enforced by ``frontend_svc.server.limits``).

    4 MiB of body holds a whole 128k-token context however it is spelled (text, escaped CJK,
    token ids: at most ~1.2 MB) three times over, and json.loads of the worst-shaped body that
    size (lists of small numbers) still takes only ~0.13 s; 1M-token contexts need a raise.
    """

    max_body_bytes: int = 4 * 2**20  # larger request bodies are answered 413
    max_header_bytes: int = 32 * 2**10  # larger request heads are answered 431
    tokenizer_threads: int = 4  # worker threads that tokenize and render big prompts

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_header_bytes, self.tokenizer_threads) < 1:
            raise ValueError(
                "--max-body-bytes, --max-header-bytes, --tokenizer-threads must be > 0"
            )


@dataclass(frozen=True)
class FrontendConfig:
    """Everything the gateway needs to start; built once at startup."""

    engine_address: str = "127.0.0.1:50051"  # HOST:PORT, a comma list, or dns:///NAME:PORT
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the name the engine reports
    backoff: BackoffConfig = BackoffConfig()
    retry_after_s: int = 1  # Retry-After sent with 429 responses
    engine_rpc_timeout_s: float = 10.0  # for the unary rpcs made while connecting
    log_level: str = "info"
    uvicorn_log_level: str | None = None  # None: log_level
    https: HttpsConfig = HttpsConfig()
    tls: TlsClientConfig = TlsClientConfig()
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    workers: int = 1  # gateway processes sharing the port, each with its own engine streams
    # Engine messages in flight unread on each engine stream; the engine merges the steps that
    # come while it is full (the contract's FlowControl). 0: no window. One: the gateway reports
    # each message after the requests it woke have had their turn, and a gateway that falls
    # behind gets every step made meanwhile in the next message, not a queue of them. A second
    # message in flight only pays where the report's round trip is longer than an engine step
    # (benchmarks/results/gateway_relay_cpu.md: 1 against 2, 3, 4, 16 and none).
    engine_window: int = 1
    tool_call_parser: str | None = None  # how model output becomes tool calls (tool_parsers)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, the parser reads
    reasoning_parser: str | None = None  # how chat output splits into reasoning and content
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" unless asked not to
    enable_force_include_usage: bool = False  # the usage chunk ends every stream
    # usage.prompt_tokens_details (cached tokens) in answers; off: null, as vLLM
    enable_prompt_tokens_details: bool = False
    enable_server_load_tracking: bool = False  # GET /load: the requests being served (vLLM's)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's)
    root_path: str = ""  # served under this path prefix too (behind a path-routing proxy)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: those paths are 404
    enable_runtime_lora_updating: bool = False
    # /reset_prefix_cache, /sleep, /wake_up, /is_sleeping, /start_profile, /stop_profile (vLLM's
    # dev-mode routes); off: those paths are 404
    enable_utility_endpoints: bool = False
    # POST /v1/responses with store true: the responses kept for GET /v1/responses/{id} and
    # previous_response_id (frontend_svc.responses_store), the oldest dropped past either bound
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("--workers must be >= 1")
        if not 0 <= self.engine_window <= 65536:
            raise ValueError("--engine-window must be between 0 and 65536")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r} is not one of "
                f"{', '.join(TOOL_PARSER_NAMES)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser not in (None, *REASONING_PARSER_NAMES):
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                f"{', '.join(REASONING_PARSER_NAMES)}"
            )
        if self.responses_store_max_entries < 0 or self.responses_store_max_bytes < 0:
            raise ValueError(
                "--responses-store-max-entries and --responses-store-max-bytes must be >= 0"
            )
        if self.root_path and not (
            self.root_path.startswith("/") and not self.root_path.endswith("/")
        ):
            raise ValueError(
                f"--root-path {self.root_path!r} must start with '/' and not end with one "
                "(e.g. /llm)"
            )
        if self.uvicorn_log_level not in (None, *UVICORN_LOG_LEVELS):
            raise ValueError(
                f"--uvicorn-log-level {self.uvicorn_log_level!r} is not one of "
                f"{', '.join(UVICORN_LOG_LEVELS)}"
            )


def _env(environ: Mapping[str, str], name: str, default: str | None) -> str | None:
    value = environ.get(ENV_PREFIX + name)
    return value if value not in (None, "") else default


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    value = _env(environ, name, "") or ""
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_PREFIX}{name}={value!r}: expected true or false")


def _env_name(flag: str) -> str:
    """``--max-body-bytes`` -> ``MAX_BODY_BYTES`` (read as ``TANDEM_MAX_BODY_BYTES``)."""
    return flag.removeprefix("--").replace("-", "_").upper()


def _option(
    p: argparse.ArgumentParser,
    env: Mapping[str, str],
    flag: str,
    default: object,
    help: str,
    aliases: Sequence[str] = (),
    **kwargs: Any,
) -> None:
    """``flag`` (also spelled as each of ``aliases``: vLLM's names), defaulting to
    ``TANDEM_<FLAG>`` when that is set, else to ``default``. The variable's text goes through
    the flag's ``type`` as if given on the command line (so a bad value is a usage error naming
    the flag)."""
    name = _env_name(flag)
    p.add_argument(
        flag,
        *aliases,
        dest=name.lower(),
        default=_env(env, name, None) or default,
        help=f"{help} (env {ENV_PREFIX}{name})",
        **kwargs,
    )


def _flag(p: argparse.ArgumentParser, env: Mapping[str, str], flag: str, help: str) -> None:
    """An on/off ``flag``, on by default when ``TANDEM_<FLAG>`` is true (1/true/yes/on)."""
    name = _env_name(flag)
    try:
        default = _env_flag(env, name)
    except ValueError as e:
        p.error(str(e))
    p.add_argument(
        flag, action="store_true", default=default, help=f"{help} (env {ENV_PREFIX}{name}=true)"
    )


def build_arg_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags of ``python -m frontend_svc``; each default comes from ``TANDEM_<FLAG>`` if set."""
    env = os.environ if environ is None else environ
    d = FrontendConfig()
    p = argparse.ArgumentParser(
        prog="python -m frontend_svc",
        description="Tandem gateway: OpenAI-compatible HTTP API in front of a Tandem engine.",
    )
    _option(
        p,
        env,
        "--engine",
        d.engine_address,
        "engine gRPC address HOST:PORT, several separated by commas, or dns:///NAME:PORT "
        "(every address NAME resolves to, looked up again periodically)",
    )
    _option(p, env, "--host", d.host, "address the HTTP API listens on (0.0.0.0: every one)")
    _option(p, env, "--port", d.port, "port the HTTP API listens on", type=int)
    _option(
        p,
        env,
        "--ssl-certfile",
        None,
        "serve HTTPS with this PEM certificate (chain); it may hold the key too",
    )
    _option(p, env, "--ssl-keyfile", None, "PEM private key of --ssl-certfile")
    _option(
        p, env, "--ssl-ca-certs", None, "PEM CA that HTTPS client certificates are checked against"
    )
    _option(
        p,
        env,
        "--ssl-cert-reqs",
        d.https.cert_reqs,
        "whether HTTPS clients must present a certificate signed by --ssl-ca-certs: 0 no, "
        "1 optional, 2 required (Python's ssl.CERT_*)",
        type=int,
        choices=(0, 1, 2),
    )
    _option(p, env, "--api-key", None, "require 'Authorization: Bearer KEY'")
    _option(
        p, env, "--served-model-name", None, "model name exposed by the API; default: the engine's"
    )
    _option(
        p,
        env,
        "--reconnect-max-s",
        d.backoff.max_s,
        "longest wait between engine reconnection attempts",
        type=float,
    )
    _option(
        p,
        env,
        "--retry-after-s",
        d.retry_after_s,
        "Retry-After seconds sent with 429 responses",
        type=int,
    )
    _option(
        p,
        env,
        "--engine-resolve-interval",
        d.routing.resolve_interval_s,
        "seconds between DNS lookups of dns:/// engines",
        type=float,
    )
    _option(
        p,
        env,
        "--prefix-affinity-min-tokens",
        d.routing.affinity_min_tokens,
        "send a request to the engine that saw its prompt prefix when at least this many "
        "tokens match; 0 turns affinity off",
        type=int,
    )
    _option(
        p,
        env,
        "--prefix-affinity-max-imbalance",
        d.routing.affinity_max_imbalance,
        "prefix affinity yields to the least-loaded engine once the affine one carries this "
        "many more requests",
        type=int,
    )
    _option(
        p,
        env,
        "--tls-ca",
        None,
        "PEM CA of the engines: TLS on the gRPC link to them (HTTPS for clients: --ssl-*)",
    )
    _option(p, env, "--tls-cert", None, "PEM client certificate for mTLS to the engines")
    _option(p, env, "--tls-key", None, "PEM key of --tls-cert")
    _option(
        p,
        env,
        "--tls-server-name",
        None,
        "name to verify in the engine certificate (default: the host of --engine)",
    )
    _option(
        p,
        env,
        "--max-body-bytes",
        d.limits.max_body_bytes,
        "largest request body; bigger ones get 413",
        type=int,
    )
    _option(
        p,
        env,
        "--max-header-bytes",
        d.limits.max_header_bytes,
        "largest request head (all headers); bigger ones get 431",
        type=int,
    )
    _option(
        p,
        env,
        "--tokenizer-threads",
        d.limits.tokenizer_threads,
        "threads that tokenize big prompts off the event loop",
        type=int,
    )
    _option(
        p,
        env,
        "--workers",
        d.workers,
        "gateway processes serving the one port, each with its own engine streams; with "
        "more than one, a supervisor restarts any that dies (vLLM: --api-server-count)",
        aliases=("--api-server-count", "-asc"),
        type=int,
    )
    _option(
        p,
        env,
        "--engine-window",
        d.engine_window,
        "engine messages each engine stream may have in flight unread; the engine merges the "
        "steps that come while it is full into one message (0: no window)",
        type=int,
    )
    _option(
        p,
        env,
        "--tool-call-parser",
        None,
        "format of the model's tool calls, read back into tool_calls for tool_choice 'auto' "
        "(hermes: Qwen2.5/Qwen3/Hermes; llama3_json: Llama 3.x JSON; pythonic: Llama 3.2/4 "
        "Python-style lists)",
        choices=TOOL_PARSER_NAMES,
    )
    _flag(
        p,
        env,
        "--enable-auto-tool-choice",
        "allow tool_choice 'auto' (the default when a request has tools); needs "
        "--tool-call-parser, as in vLLM",
    )
    _option(
        p,
        env,
        "--reasoning-parser",
        None,
        "format of the model's reasoning, returned apart from the content in chat answers "
        "(message.reasoning and reasoning_content; qwen3: Qwen3, off with enable_thinking "
        "false; deepseek_r1: DeepSeek-R1 and its distills, QwQ)",
        choices=REASONING_PARSER_NAMES,
    )
    _flag(
        p,
        env,
        "--return-tokens-as-token-ids",
        "write logprob tokens as 'token_id:N' unless a request says otherwise "
        "(return_tokens_as_token_ids)",
    )
    _flag(
        p,
        env,
        "--enable-force-include-usage",
        "end every stream with a usage chunk, as if it asked for stream_options.include_usage",
    )
    _flag(
        p,
        env,
        "--enable-prompt-tokens-details",
        "report usage.prompt_tokens_details.cached_tokens (the prompt tokens served from the "
        "prefix cache) when some were; off: null, as vLLM",
    )
    _flag(
        p,
        env,
        "--enable-server-load-tracking",
        "serve GET /load: the generation and pooling requests this process is serving now",
    )
    _flag(
        p,
        env,
        "--enable-tokenizer-info-endpoint",
        "serve GET /tokenizer_info: the tokenizer's configuration and chat template",
    )
    _option(
        p,
        env,
        "--root-path",
        d.root_path,
        "the path prefix a path-routing proxy serves this gateway under (ASGI root_path): "
        "routes answer with and without it, and /docs finds /openapi.json under it",
    )
    _flag(
        p,
        env,
        "--enable-runtime-lora-updating",
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (every engine loads or "
        "unloads; use with --api-key)",
    )
    _flag(
        p,
        env,
        "--enable-utility-endpoints",
        "serve /reset_prefix_cache, /sleep, /wake_up, /is_sleeping, /start_profile and "
        "/stop_profile (on every engine; use with --api-key)",
    )
    _option(
        p,
        env,
        "--responses-store-max-entries",
        d.responses_store_max_entries,
        "responses (POST /v1/responses with store true) kept in memory for GET and "
        "previous_response_id, the oldest dropped first; 0 keeps none",
        type=int,
    )
    _option(
        p,
        env,
        "--responses-store-max-bytes",
        d.responses_store_max_bytes,
        "most bytes of JSON the kept responses may hold together, the oldest dropped first",
        type=int,
    )
    _option(
        p,
        env,
        "--log-level",
        d.log_level,
        "level of the gateway's logs: debug, info, warning, error (uvicorn's too unless "
        "--uvicorn-log-level)",
    )
    _option(
        p,
        env,
        "--uvicorn-log-level",
        None,
        "level of uvicorn's own logs (server start, access log); default: --log-level",
        choices=UVICORN_LOG_LEVELS,
    )
    return p


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> FrontendConfig:
    """Parse flags (falling back to the environment) into a :class:`FrontendConfig`."""
    parser = build_arg_parser(environ)
    args = parser.parse_args(argv)
    initial = min(BackoffConfig().initial_s, args.reconnect_max_s)
    try:
        tls = TlsClientConfig(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        https = HttpsConfig(
            args.ssl_keyfile or None,
            args.ssl_certfile or None,
            args.ssl_ca_certs or None,
            args.ssl_cert_reqs,
        )
        routing = RoutingConfig(
            args.engine_resolve_interval,
            args.prefix_affinity_min_tokens,
            args.prefix_affinity_max_imbalance,
        )
        limits = LimitsConfig(args.max_body_bytes, args.max_header_bytes, args.tokenizer_threads)
        return FrontendConfig(
            engine_address=args.engine,
            host=args.host,
            port=args.port,
            api_key=args.api_key or None,
            served_model_name=args.served_model_name or None,
            backoff=BackoffConfig(initial_s=initial, max_s=args.reconnect_max_s),
            retry_after_s=args.retry_after_s,
            log_level=args.log_level,
            uvicorn_log_level=args.uvicorn_log_level or None,
            https=https,
            tls=tls,
            routing=routing,
            limits=limits,
            workers=args.workers,
            engine_window=args.engine_window,
            tool_call_parser=args.tool_call_parser or None,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser or None,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            enable_force_include_usage=args.enable_force_include_usage,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            enable_server_load_tracking=args.enable_server_load_tracking,
            enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            root_path=args.root_path,
            enable_runtime_lora_updating=args.enable_runtime_lora_updating,
            enable_utility_endpoints=args.enable_utility_endpoints,
            responses_store_max_entries=args.responses_store_max_entries,
            responses_store_max_bytes=args.responses_store_max_bytes,
        )
    except ValueError as e:
        parser.error(str(e))


def config_to_json(config: FrontendConfig) -> str:
    """The config as JSON, for :func:`config_from_json` in another process."""
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> FrontendConfig:
    """The config :func:`config_to_json` wrote."""
    fields = json.loads(text)
    return FrontendConfig(
        **{
            **fields,
            "backoff": BackoffConfig(**fields["backoff"]),
            "https": HttpsConfig(**fields["https"]),
            "tls": TlsClientConfig(**fields["tls"]),
            "routing": RoutingConfig(**fields["routing"]),
            "limits": LimitsConfig(**fields["limits"]),
        }
    )


def handed_down_config(environ: Mapping[str, str] | None = None) -> FrontendConfig:
    """In a worker process: the config its supervisor parsed and handed down."""
    env = os.environ if environ is None else environ
    return config_from_json(env[WORKER_CONFIG_ENV])


def shared_metrics_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """Where this worker and its siblings keep their Prometheus figures (set by their
    supervisor); None when the process serves alone."""
    env = os.environ if environ is None else environ
    return env.get(METRICS_DIR_ENV) or None
