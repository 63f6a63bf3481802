"""EngineCore: owns the scheduler, the KV cache manager and the model runner; ``step()`` is the
whole engine: schedule -> execute -> update.

It sits above the layers it orchestrates: ``core/`` (scheduler, KV cache, requests: CPU
bookkeeping) and ``worker/`` (model runner, sampler) with ``models/``, ``lora/`` and
``structured_output/``. ``loop/`` runs it in its own thread for the gRPC server; the offline
``LLM`` drives it directly."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import numpy as np

from engine_svc import envs
from engine_svc.config import EngineConfig
from engine_svc.core.errors import EngineAsleepError
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.model_info import ModelInfo
from engine_svc.core.outputs import EngineCoreOutput, EngineCoreOutputs
from engine_svc.core.pooling_params import PoolingParams
from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from engine_svc.executor import make_model_runner
from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.errors import LoRADisabledError, LoRANotFoundError
from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.registry import LoRAInfo
from engine_svc.models.loader import read_hf_config
from engine_svc.models.tasks import checkpoint_kind, model_tasks
from engine_svc.profiler import EngineProfiler
from engine_svc.spec_decode.config import DraftModelConfig, NgramConfig
from engine_svc.spec_decode.draft_model import DraftModel
from engine_svc.spec_decode.ngram import NgramProposer
from engine_svc.spec_decode.verify import eligible
from engine_svc.structured_output.manager import StructuredOutputManager
from engine_svc.worker.model_runner import ModelRunner, ModelRunnerOutput
from engine_svc.worker.sleep_mode import check_sleep_level
from protos.types import FinishReason

logger = logging.getLogger(__name__)

# With nothing to run but requests waiting for their grammar, step() sleeps until a compilation
# ends, at most this long (new requests then wait at most this long to be taken in).
_GRAMMAR_WAIT_S = 0.01


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        hf = read_hf_config(config.model.model)
        max_len = int(hf.get("max_position_embeddings", 2048))
        if config.model.max_model_len is not None:
            if config.model.max_model_len > max_len:
                raise ValueError(
                    f"max_model_len {config.model.max_model_len} exceeds the model's "
                    f"max_position_embeddings {max_len}"
                )
            max_len = config.model.max_model_len
        # The in-process runner, or the tensor-parallel executor with the same surface.
        self.runner = make_model_runner(config, max_len)
        layout = self.runner.layout
        if layout.num_tokens < max_len:
            # A request longer than the whole cache could never finish: it would preempt itself
            # forever. Serve a shorter context instead, and say so.
            logger.warning(
                "KV cache holds %d tokens < max_model_len %d: serving max_model_len=%d",
                layout.num_tokens,
                max_len,
                layout.num_tokens,
            )
            max_len = layout.num_tokens
        self.kv = KVCacheManager(
            layout.num_blocks, layout.block_size, config.cache.enable_prefix_caching
        )
        spec = config.speculative
        # A draft model writes its proposals' KV in slots past a request's last token.
        lookahead = spec.num_speculative_tokens if isinstance(spec, DraftModelConfig) else 0
        self.scheduler = Scheduler(config.scheduler, self.kv, max_len, self.runner.lora, lookahead)
        lora = config.lora
        self.info = ModelInfo.of(
            served_model_name=config.model.served_model_name or Path(config.model.model).name,
            max_model_len=max_len,
            vocab_size=self.runner.spec.vocab_size,
            eos_token_ids=_eos_ids(config.model.model, hf),
            bos_token_id=hf.get("bos_token_id"),
            block_size=layout.block_size,
            num_kv_blocks=layout.num_blocks,
            max_logprobs=config.model.max_logprobs,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            kv_cache_dtype=str(self.runner.dtype).removeprefix("torch."),
            tasks=model_tasks(
                checkpoint_kind(config.model.model, hf),
                hf,
                config.model.model,
                config.model.pooling_type,
            ),
            max_loras=lora.max_loras if lora else 0,
            max_lora_rank=lora.max_lora_rank if lora else 0,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        for name, path in lora.modules if lora else ():  # --lora-modules: a bad one stops here
            self.add_lora(name, self.read_lora(path))
        self.structured = StructuredOutputManager(
            config.model.tokenizer or config.model.model,
            self.info.vocab_size,
            self.info.eos_token_ids,
        )
        self.profiler = EngineProfiler(config.profile_dir, self.runner.device)
        # Speculative decoding: proposals for the next step, made after each update on rank 0
        # (the in-process runner, or the executor's rank 0: the step message takes them to the
        # workers): n-gram, or rank 0's draft model (which caught up with the step inside it).
        self.proposer: NgramProposer | DraftModel | None = None
        self._rank0 = self.runner if isinstance(self.runner, ModelRunner) else self.runner.rank0
        if spec is not None:
            if isinstance(spec, NgramConfig):
                self.proposer = NgramProposer(spec, max_len, envs.cache_dir() / "kernels")
            else:
                self.proposer = self._rank0.draft

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_name: str | None = None,
        *,
        checked: bool = False,
    ) -> Request:
        """Check and queue a request. Raises ``ValueError`` naming the problem
        (``ContextLengthError`` for the context, ``LoRANotFoundError`` for an unknown
        ``lora_name``).

        With ``pooling_params`` it is a pooling request: ``params`` are ignored. ``lora_name``:
        the adapter to run it with (None or empty: the base model), held until it finishes.
        EngineAsleepError while the engine sleeps.

        The check is the engine's one check of what reaches it in process (the offline ``LLM``):
        vLLM's lenient rule, ``ModelInfo.check_generate`` / ``check_pooling``. ``checked``: the
        caller has checked the request against ``info`` already and it is not checked again --
        the gRPC edge checks every request with the contract's rule before queueing it
        (``ModelInfo.check_request``), and ``EngineLoop`` passes True; its pooling parameters
        then come with their defaults filled in."""
        if self.is_sleeping:
            raise EngineAsleepError("the engine is asleep; wake it up first")
        lora_id = self._acquire_lora(lora_name)
        try:
            return self._add_request(
                request_id,
                prompt_token_ids,
                params,
                arrival_time,
                priority,
                pooling_params,
                lora_id,
                lora_name,
                checked,
            )
        except BaseException:
            if lora_id and self.runner.lora is not None:
                self.runner.lora.release(lora_id)  # it never entered the scheduler
            raise

    def _add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
        priority: int,
        pooling_params: PoolingParams | None,
        lora_id: int,
        lora_name: str | None,
        checked: bool,
    ) -> Request:
        info = self.info
        if pooling_params is not None:
            if not checked:
                pooling_params = info.check_pooling(prompt_token_ids, pooling_params)
            request = Request(
                request_id,
                prompt_token_ids,
                SamplingParams(max_tokens=1),  # unused: a pooling request samples nothing
                arrival_time=arrival_time,
                priority=priority,
                pooling_params=pooling_params,
                lora_id=lora_id,
                lora_name=lora_name,
            )
            self.scheduler.add_request(request)
            return request
        if not checked:
            info.check_generate(prompt_token_ids, params)
        remaining = info.max_model_len - len(prompt_token_ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(remaining, 1))
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            info.eos_token_ids,
            arrival_time,
            priority,
            lora_id=lora_id,
            lora_name=lora_name,
        )
        if params.structured_output is not None:
            request.grammar = self.structured.grammar_for(params.structured_output)
        self.scheduler.add_request(request)
        return request

    # ------------------------------------------------------------------ LoRA adapters
    def _acquire_lora(self, name: str | None) -> int:
        if not name:
            return 0
        if self.runner.lora is None:
            raise LoRANotFoundError(
                f"no LoRA adapter named {name!r}: this engine serves none (--enable-lora)"
            )
        return self.runner.lora.acquire(name)

    @property
    def lora(self) -> LoRAManager:
        """The adapters; LoRADisabledError when the engine serves none."""
        if self.runner.lora is None:
            raise LoRADisabledError(
                "this engine serves no LoRA adapters (start it with --enable-lora)"
            )
        return self.runner.lora

    def read_lora(self, path: str) -> LoRAAdapter:
        """Read and check an adapter directory; touches no engine state, so any thread may call
        it (the gRPC layer reads off the engine loop). LoRAInvalidError names the file."""
        return self.lora.read(path)

    def add_lora(self, name: str, adapter: LoRAAdapter, pin: bool = False) -> LoRAInfo:
        """Serve ``adapter`` (from :meth:`read_lora`) as ``name``."""
        return self.lora.add(name, adapter, pin, self._running_loras())

    def remove_lora(self, name: str) -> None:
        """Stop serving ``name``: new requests naming it are refused at once; the ones already
        taken in finish with it (the contract's RemoveLora). LoRANotFoundError if unknown."""
        self._named_lora(name).remove(name)

    def pin_lora(self, name: str) -> None:
        """Keep ``name`` on the device (LoRANotFoundError if unknown, LoRACapacityError if
        every slot is pinned or the pin would strand waiting requests)."""
        self._named_lora(name).pin(name, self._running_loras())

    def list_loras(self) -> list[LoRAInfo]:
        """The adapters served, in load order (none when LoRA is off)."""
        return [] if self.runner.lora is None else self.runner.lora.infos()

    def _named_lora(self, name: str) -> LoRAManager:
        if self.runner.lora is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r}: this engine serves none")
        return self.runner.lora

    def _running_loras(self) -> set[int]:
        return {r.lora_id for r in self.scheduler.running if r.lora_id}

    # ------------------------------------------------------------------ utility calls
    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry of a block not in use; False when blocks in use kept
        theirs (vLLM's reset_prefix_cache)."""
        return self.kv.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.sleep_level != 0

    def sleep(self, level: int = 1) -> None:
        """Sleep mode: level 1 frees the KV cache and moves the weights to host memory; level 2
        drops the weights too (read again from the checkpoint on wake up). The prefix cache is
        reset (its KV goes with the cache). Only an idle engine sleeps (RuntimeError otherwise:
        ``EngineLoop`` lets the running requests finish first); a no-op when asleep."""
        check_sleep_level(level)
        if self.is_sleeping:
            return
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep with requests in flight; let them finish first")
        reset = self.kv.reset_prefix_cache()
        assert reset, "no request runs, yet KV blocks are in use"
        self.runner.sleep(level)

    def wake_up(self) -> None:
        """Weights back on the device, an empty KV cache of the same size; a no-op when awake."""
        self.runner.wake_up()

    def start_profile(self) -> None:
        """Start the torch profiler (ProfilerError: no profile directory, or one runs)."""
        self.profiler.start()

    def stop_profile(self) -> str:
        """Stop it and write the trace; returns its path (ProfilerError: none runs)."""
        return self.profiler.stop()

    # ------------------------------------------------------------------ requests out
    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests; returns the final (ABORT) output of each one the engine held."""
        now = time.monotonic()
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=FinishReason.ABORT,
                num_cached_tokens=max(r.num_cached_tokens, 0),
                num_prompt_tokens=r.num_prompt_tokens,
                phase_times=r.phase_times(now),
            )
            for r in self.scheduler.abort_requests(request_ids)
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop body
    def step(self) -> EngineCoreOutputs:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty and self.scheduler.num_waiting_for_grammar():
            self.structured.wait_for_any(_GRAMMAR_WAIT_S)  # rather than spin until it is ready
        result = self.runner.execute(scheduled)
        self._keep_prompt_logprobs(result)
        touched = self.scheduler.update_from_output(scheduled, result.sampled, result.spec_accepted)
        if self.proposer is not None:
            self._propose(touched)
        now = time.monotonic()
        output_of = self._output_of
        outputs = [output_of(r, result, now) for r in touched]
        stats = self.scheduler.take_stats()  # this step's counters, then a new interval
        return EngineCoreOutputs(outputs, stats, self.scheduler.take_errors())

    def _propose(self, touched: list[Request]) -> None:
        """Proposals for the next step of the requests that got tokens and go on: the draft
        model's (``spec_decode.draft_model``), or n-gram ones read from the persistent batch's
        token array (``spec_decode.ngram``): rank 0's, whose tokens are the step's."""
        assert self.proposer is not None
        ready = [r for r in touched if not r.is_finished and eligible(r)]
        if not ready:
            return
        runner = self._rank0
        batch = runner.input_batch
        if isinstance(self.proposer, DraftModel):
            drafted = self.proposer.propose(ready, batch, runner.generators)
            for request, tokens in zip(ready, drafted, strict=True):
                if tokens:
                    request.spec_token_ids = tokens
            return
        rows = np.fromiter((batch.row_of[r.request_id] for r in ready), np.int64, len(ready))
        proposals, counts = self.proposer.propose(batch.token_ids, rows, batch.num_tokens[rows])
        for request, proposal, count in zip(ready, proposals, counts.tolist(), strict=True):
            if count:
                request.spec_token_ids = proposal[:count].tolist()

    def _keep_prompt_logprobs(self, result: ModelRunnerOutput) -> None:
        # Chunks of a long prompt arrive over several steps; they are sent with the first token.
        for rid, entries in result.prompt_logprobs.items():
            request = self.scheduler.requests.get(rid)
            if request is not None:
                request.prompt_logprobs.extend(entries)

    def _output_of(
        self, request: Request, result: ModelRunnerOutput, now: float
    ) -> EngineCoreOutput:
        rid = request.request_id
        if request.pooling_params is not None:  # finished: its pooled result, no token
            return EngineCoreOutput(
                request_id=rid,
                new_token_ids=[],
                finish_reason=request.finish_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                num_prompt_tokens=request.num_prompt_tokens,
                first=True,
                phase_times=request.phase_times(now),
                pooled=result.pooled[rid],
            )
        logprobs = result.logprobs
        if result.spec_accepted and rid in result.spec_accepted:
            # Accepted proposals, then the sampled token (cut where the request stopped).
            n = request.num_step_tokens
            new_tokens = request.output_token_ids[-n:]
            new_logprobs = result.spec_logprobs.get(rid, [])[:n]
        else:
            new_tokens = [result.sampled[rid]]
            new_logprobs = [logprobs[rid]] if logprobs and rid in logprobs else []
        out = EngineCoreOutput(
            request_id=rid,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        first = len(request.output_token_ids) == 1
        if first:
            out.first = True
            request.first_token_ts = now
        if first or out.finished:
            out.phase_times = request.phase_times(now)
        if first and request.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = request.prompt_logprobs
        return out

    def run_until_idle(self, deadline_s: float = float("inf")) -> list[EngineCoreOutputs]:
        """Step until no request is left (offline use and tests)."""
        end = time.monotonic() + deadline_s
        steps = []
        while self.has_unfinished_requests() and time.monotonic() < end:
            steps.append(self.step())
        return steps


def _eos_ids(model_dir: str, hf: dict) -> tuple[int, ...]:  # type: ignore[type-arg]
    """EOS ids from generation_config.json (which may list several), else config.json."""
    value = hf.get("eos_token_id")
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        value = json.loads(gen_path.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


__all__ = ["EngineCore"]
