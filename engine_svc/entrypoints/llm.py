"""The offline API in the shape vLLM users know::

from engine_svc import LLM, SamplingParams
llm = LLM(model="/path/to/hf-checkpoint")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Pooling models add ``embed``, ``classify`` and ``score`` (``llm_pooling``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine_svc import envs
from engine_svc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from engine_svc.core.request import Logprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.engine_core import EngineCore
from engine_svc.entrypoints.llm_pooling import PoolingMixin
from engine_svc.lora.config import LoRAConfig
from engine_svc.lora.request import LoRARequest
from engine_svc.model_source import TRUST_REMOTE_CODE_REFUSAL, resolve_model, resolve_tokenizer
from engine_svc.spec_decode.config import SpeculativeConfig, parse_speculative_config
from protos.bad_words import bad_words_token_ids
from protos.gc_heap import freeze_startup_heap
from protos.types import FinishReason

PromptType = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | None = None
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The checkpoint's tokenizer through transformers, or None when the directory has none."""
    model_dir = Path(model_dir)
    if not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _speculative(spec: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config`` (a dict, or its JSON) as the engine's config."""
    if spec is None:
        return None
    return parse_speculative_config(spec if isinstance(spec, str) else json.dumps(spec))


def _graph_sizes(sizes: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    return (sizes,) if isinstance(sizes, int) else tuple(sizes)


class LLM(PoolingMixin):
    """Runs the engine in this process and generates (or embeds, classifies, scores) for a
    batch of prompts."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = ModelConfig.dtype,
        max_model_len: int | None = ModelConfig.max_model_len,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        block_size: int = CacheConfig.block_size,
        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
        enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
        kv_cache_memory: int | str | None = CacheConfig.kv_cache_memory,
        gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
        num_kv_blocks: int | None = CacheConfig.num_kv_blocks,
        scheduling_policy: str = SchedulerConfig.policy,
        max_logprobs: int = ModelConfig.max_logprobs,
        device: str = EngineConfig.device,
        attention_backend: str = EngineConfig.attention_backend,
        pad_decode_batches: bool | None = EngineConfig.pad_decode_batches,
        enforce_eager: bool = EngineConfig.enforce_eager,
        cuda_graph_sizes: int | Sequence[int] | None = None,
        tensor_parallel_size: int = EngineConfig.tensor_parallel_size,
        distributed_executor_backend: str | None = None,
        speculative_config: dict[str, Any] | str | None = None,
        seed: int = ModelConfig.seed,
        served_model_name: str | None = None,
        pooling_type: str | None = ModelConfig.pooling_type,
        enable_lora: bool = False,
        max_loras: int = LoRAConfig.max_loras,
        max_lora_rank: int = LoRAConfig.max_lora_rank,
        max_cpu_loras: int | None = LoRAConfig.max_cpu_loras,
        profile_dir: str | Path | None = None,
        tokenizer: str | Path | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | Path | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        """``model`` (and ``tokenizer``) is a checkpoint directory or a Hugging Face Hub repo id,
        resolved as ``python -m engine_svc --model`` resolves it (``engine_svc.model_source``:
        the Hugging Face cache, ``download_dir``, ``revision``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``);
        it raises ModelSourceError with a one-line reason."""
        if trust_remote_code:
            raise ValueError(
                TRUST_REMOTE_CODE_REFUSAL.replace("--trust-remote-code", "trust_remote_code")
            )
        repo_id = None
        if model is None:
            from engine_svc.default_model import ensure_default_model

            model = ensure_default_model()
        else:
            source = resolve_model(model, revision=revision, download_dir=download_dir)
            model, repo_id = source.path, source.repo_id
        self.model_dir = str(model)
        tokenizer_dir = self.model_dir
        if tokenizer is not None:
            tokenizer_dir = str(
                resolve_tokenizer(
                    tokenizer, revision=tokenizer_revision, download_dir=download_dir
                ).path
            )
        config = EngineConfig(
            model=ModelConfig(
                model=self.model_dir,
                dtype=dtype,
                max_model_len=max_model_len,
                served_model_name=served_model_name or repo_id,
                seed=seed,
                max_logprobs=max_logprobs,
                pooling_type=pooling_type,
                tokenizer=None if tokenizer is None else tokenizer_dir,
            ),
            cache=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_memory=None if kv_cache_memory is None else parse_size(kv_cache_memory),
                gpu_memory_utilization=gpu_memory_utilization,
                num_kv_blocks=num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=scheduling_policy,
            ),
            device=device,
            attention_backend=attention_backend,
            pad_decode_batches=pad_decode_batches,
            enforce_eager=enforce_eager,
            cuda_graph_sizes=_graph_sizes(cuda_graph_sizes),
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            speculative=_speculative(speculative_config),
            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
            profile_dir=str(profile_dir) if profile_dir is not None else envs.profile_dir(),
        )
        self.engine = EngineCore(config)
        self._lora_requests: dict[int, LoRARequest] = {}  # lora_int_id -> the first request
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self._ids = itertools.count()
        # As the server does: what start-up built stays out of the collector's way, so no full
        # collection pauses generation (protos.gc_heap). An LLM dropped later is still freed (by
        # reference counts: it holds no cycles).
        freeze_startup_heap(logging.getLogger(__name__))

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    # ------------------------------------------------------------------ utility calls (vLLM's)
    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (between two ``generate`` calls every block is free: True)."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and move the weights to host memory (level 1), or drop them
        (level 2: read again from the checkpoint by :meth:`wake_up`). ``generate`` refuses to
        run until :meth:`wake_up`."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Weights back on the device, an empty KV cache of the same size."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def start_profile(self) -> None:
        """Start the torch profiler (needs ``profile_dir`` or TANDEM_PROFILE_DIR)."""
        self.engine.start_profile()

    def stop_profile(self) -> str:
        """Stop it and write the Chrome trace into the profile directory; returns its path."""
        return self.engine.stop_profile()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string or ``{"prompt_token_ids": [...]}``. ``sampling_params`` is one
        ``SamplingParams`` for all prompts or a list with one per prompt; ``lora_request`` the
        same (None: the base model). An adapter is loaded from its ``lora_path`` the first time
        its name is used (``LLM(..., enable_lora=True)``).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        resolved: dict[int, SamplingParams] = {}  # text bad words tokenized, once per object
        params_list = [resolved.setdefault(id(p), self._with_bad_word_ids(p)) for p in params_list]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        lora_names = self._lora_names(lora_request, len(prompts))

        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, int]] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                text, token_ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                ro = RequestOutput(rid, text, token_ids, [])
                results.append(ro)
                for k in range(params.n):
                    child = (
                        params
                        if params.n == 1
                        else replace(
                            params, n=1, seed=None if params.seed is None else params.seed + k
                        )
                    )
                    cid = rid if params.n == 1 else f"{rid}-{k}"
                    ro.outputs.append(CompletionOutput(k, "", [], None))
                    children[cid] = (ro, k)
                    self.engine.add_request(
                        cid,
                        token_ids,
                        child,
                        priority=0 if priority is None else priority[i],
                        lora_name=lora_names[i],
                    )
            self._run(children, params_list, use_tqdm, len(prompts))
        except BaseException:
            self.engine.abort_requests(list(children))
            raise
        for ro, params in zip(results, params_list, strict=True):
            for co in ro.outputs:
                co.text = self._decode(co.token_ids, co.finish_reason, params.skip_special_tokens)
        return results

    def _run(
        self,
        children: dict[str, tuple[RequestOutput, int]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        num_prompts: int,
    ) -> None:
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=num_prompts, desc="Processed prompts", dynamic_ncols=True)
        remaining = {id(ro): len(ro.outputs) for ro, _ in children.values()}
        start, out_tokens = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            step = self.engine.step()
            for _, error in step.errors:  # a grammar that does not compile: as vLLM, raise
                raise error
            for o in step.outputs:
                ro, k = children[o.request_id]
                co = ro.outputs[k]
                co.token_ids.extend(o.new_token_ids)
                out_tokens += len(o.new_token_ids)
                if o.new_logprobs:
                    co.logprobs = (co.logprobs or []) + o.new_logprobs
                    co.cumulative_logprob = (co.cumulative_logprob or 0.0) + sum(
                        lp.logprob for lp in o.new_logprobs
                    )
                if o.prompt_logprobs is not None:
                    ro.prompt_logprobs = o.prompt_logprobs
                ro.num_cached_tokens = o.num_cached_tokens
                if o.finished:
                    co.finish_reason = str(o.finish_reason)
                    co.stop_reason = o.stop_reason
                    remaining[id(ro)] -= 1
                    if remaining[id(ro)] == 0 and pbar is not None:
                        pbar.update(1)
            if pbar is not None:
                elapsed = time.perf_counter() - start
                pbar.set_postfix_str(f"output: {out_tokens / max(elapsed, 1e-9):.1f} tok/s")
        if pbar is not None:
            pbar.close()

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[str | None]:
        """One adapter name (or None) per prompt, loading adapters used for the first time."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * n
        else:
            requests = list(lora_request)
            if len(requests) != n:
                raise ValueError(f"got {len(requests)} lora_requests for {n} prompts")
        for lr in dict.fromkeys(r for r in requests if r is not None):
            known = self._lora_requests.get(lr.lora_int_id)
            if known is not None and known.lora_name != lr.lora_name:
                raise ValueError(
                    f"lora_int_id {lr.lora_int_id} already names adapter {known.lora_name!r}"
                )
            if lr.lora_name not in {i.name for i in self.engine.list_loras()}:
                if not lr.lora_path:
                    raise ValueError(f"LoRA adapter {lr.lora_name!r} is not loaded: give lora_path")
                self.engine.add_lora(lr.lora_name, self.engine.read_lora(lr.lora_path))
            self._lora_requests.setdefault(lr.lora_int_id, lr)
        return [None if r is None else r.lora_name for r in requests]

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its text ``bad_words`` turned into ``bad_words_token_ids``."""
        if not params.bad_words:
            return params
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"bad_words need a tokenizer; the model at {self.model_dir} has none")
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        ids = [list(s) for s in bad_words_token_ids(encode, params.bad_words)]
        return replace(
            params, bad_words=None, bad_words_token_ids=(params.bad_words_token_ids or []) + ids
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"the model at {self.model_dir} has no tokenizer; pass "
                    "{'prompt_token_ids': [...]} instead of text"
                )
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError("a prompt must be a string or {'prompt_token_ids': [...]}")

    def _decode(
        self, token_ids: list[int], finish_reason: str | None, skip_special_tokens: bool
    ) -> str:
        """The completion's text, decoded as ``SamplingParams.skip_special_tokens`` asks.

        As in vLLM, a sequence the engine ended on a token (EOS or a stop token id: finish reason
        "stop") leaves that token out of the text; its id stays in ``token_ids``.
        """
        if self.tokenizer is None:
            return ""
        if finish_reason == str(FinishReason.STOP):
            token_ids = token_ids[:-1]
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))
