"""The engine's command line as vLLM users type it: vLLM's spellings beside ours, help on every
flag, ``--trust-remote-code`` refused in one line, bad flags exit 2 in one line (as argparse's own
errors do), and a Hub ``--model`` served under its repo id."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from engine_svc.__main__ import UsageError, _model_dir, build_parser, main, parse_args
from engine_svc.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from engine_svc.lora.config import LoRAConfig
from engine_svc.model_source import TRUST_REMOTE_CODE_REFUSAL
from tests.hub_cache import add_to_hub_cache

REPO = Path(__file__).resolve().parents[2]


def test_every_engine_flag_has_help() -> None:
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in build_parser()._actions
        if not (action.help or "").strip()
    ]
    assert not missing, f"engine flags without help: {missing}"


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["--no-enable-prefix-caching"], "no_prefix_caching", True),
        (["--no-prefix-caching"], "no_prefix_caching", True),
        (["--no-prefix-caching", "--enable-prefix-caching"], "no_prefix_caching", False),
        ([], "no_prefix_caching", False),
        (["--kv-cache-memory-bytes", "4GiB"], "kv_cache_memory", "4GiB"),
        (["--kv-cache-memory", "512MiB"], "kv_cache_memory", "512MiB"),
        (["--num-gpu-blocks-override", "128"], "num_kv_blocks", 128),
        (["--num-kv-blocks", "64"], "num_kv_blocks", 64),
        (["--trust-remote-code"], "trust_remote_code", True),
        (["--model", "Qwen/Qwen3-0.6B", "--revision", "v2"], "revision", "v2"),
        (["--download-dir", "/data/hf"], "download_dir", "/data/hf"),
        (["--tokenizer", "Qwen/Qwen3-8B"], "tokenizer", "Qwen/Qwen3-8B"),
        (["--tokenizer-revision", "abc"], "tokenizer_revision", "abc"),
        (["--chat-template", "t.jinja"], "chat_template", "t.jinja"),
        (["--distributed-executor-backend", "mp"], "distributed_executor_backend", "mp"),
        ([], "distributed_executor_backend", None),
    ],
)
def test_vllm_spellings_and_ours(argv: list[str], dest: str, value: object) -> None:
    assert getattr(parse_args(argv), dest) == value


def test_trust_remote_code_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as info:
        main(["--trust-remote-code"])
    assert info.value.code == 2
    assert str(info.value) == f"python -m engine_svc: error: {TRUST_REMOTE_CODE_REFUSAL}"
    assert "Llama, Qwen2 and Qwen3" in TRUST_REMOTE_CODE_REFUSAL


NGRAM = '{"method": "ngram", "num_speculative_tokens": 2}'
EAGLE = '{"method": "eagle", "model": "/m/d", "num_speculative_tokens": 2}'


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory: cannot parse memory size"),
        (["--chat-template", "no/such/template.jinja"], "--chat-template 'no/such/template"),
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        # Speculation runs with the executor: what is refused is the bad flag beside it.
        (["-tp", "0", "--speculative-config", NGRAM], "--tensor-parallel-size must be at least 1"),
        (
            ["--distributed-executor-backend", "mp", "--speculative-config", EAGLE],
            "--speculative-config method 'eagle' is not supported",
        ),
        (
            ["-tp", "2", "--distributed-executor-backend", "uni"],
            "--distributed-executor-backend uni runs one rank only",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        main(argv)
    assert info.value.code == 2
    assert str(info.value).startswith(f"python -m engine_svc: error: {message}")


def test_the_process_prints_one_line_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine_svc", "--trust-remote-code"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert done.stderr == f"python -m engine_svc: error: {TRUST_REMOTE_CODE_REFUSAL}\n"


def test_a_hub_model_is_served_under_its_repo_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files: dict[str, bytes | str] = {"config.json": "{}", "model.safetensors": b"w"}
    snapshot = add_to_hub_cache(tmp_path / "hub", "tandem-test/tiny", files)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub = ["--model", "tandem-test/tiny", "--download-dir", str(tmp_path / "hub")]
    assert _model_dir(parse_args(hub)) == (str(snapshot), "tandem-test/tiny")
    named = parse_args([*hub, "--served-model-name", "mine"])
    assert _model_dir(named) == (str(snapshot), "mine")
    # A directory is served under its name, as before (EngineCore: the directory's name).
    assert _model_dir(parse_args(["--model", str(snapshot)])) == (str(snapshot), None)


def test_flag_defaults_are_the_configs_defaults() -> None:
    """A default is written once, in its config dataclass (engine_svc/config.py); the command
    line takes it from there, so the two never drift apart."""
    args = parse_args([])
    model, cache, sched = ModelConfig("m"), CacheConfig(), SchedulerConfig()
    server, lora = ServerConfig(), LoRAConfig()
    assert (args.dtype, args.seed, args.max_logprobs) == (
        model.dtype,
        model.seed,
        model.max_logprobs,
    )
    assert args.max_model_len is None  # the checkpoint's context, found at load time
    assert (args.block_size, args.gpu_memory_utilization, not args.no_prefix_caching) == (
        cache.block_size,
        cache.gpu_memory_utilization,
        cache.enable_prefix_caching,
    )
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy) == (
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        sched.policy,
    )
    engine = EngineConfig(model)
    assert (args.device, args.attention_backend) == (engine.device, engine.attention_backend)
    assert (args.host, args.port, args.max_waiting) == (
        server.host,
        server.port,
        server.max_waiting,
    )
    assert (args.shutdown_timeout, args.stall_timeout) == (
        server.shutdown_timeout_s,
        server.stall_timeout_s,
    )
    assert (args.max_loras, args.max_lora_rank) == (lora.max_loras, lora.max_lora_rank)
