"""The model runner: turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

Per step it updates its persistent batch (``input_batch``: one row per running request), builds
the flattened inputs from it into static buffers (``step_inputs``: decodes first, then
multi-token chunks; decode-only steps padded to the CUDA graph sizes), runs the model (a decode-
only step by replaying its size's CUDA graph, ``cuda_graphs``), computes logits only for rows
that sample (and for prompt-logprob rows), masks the rows that have a structured-output grammar
(``structured_output.bitmask``), and samples (``sampling_inputs``, ``sampler``).

Host and device: every host array goes to the device by a non-blocking copy from pinned memory
(``step_inputs.StepBuffers``, ``uploads``); the one time a step waits for the GPU is when it
reads the sampled token ids. Features that need more say so where they do it (logprobs,
prompt logprobs, grammars, LoRA).
Pooling rows never sample: ``pooler`` turns their hidden states into embeddings or label scores
in the step that computes their last prompt token. With LoRA adapters (``lora``), the step's
adapters are put in device slots before the forward and its tokens grouped by slot
(``LoRAMapping``), which the model's adapted linears use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from engine_svc import envs
from engine_svc.config import EngineConfig, KVCacheLayout
from engine_svc.core.request import Logprobs, Request
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput
from engine_svc.distributed import SINGLE, TPGroup, min_over_ranks  # TP (issue 33)
from engine_svc.lora.adapter import ModelDims
from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.ops import LoRAMapping
from engine_svc.models.llama import DecoderSpec
from engine_svc.models.loader import (
    architecture_of,
    checkpoint_dtype,
    load_model,
    read_hf_config,
)
from engine_svc.spec_decode.config import DraftModelConfig
from engine_svc.spec_decode.draft_model import DraftModel
from engine_svc.spec_decode.verify import verify_step
from engine_svc.structured_output.bitmask import GrammarBitmask
from engine_svc.worker import cuda_graphs
from engine_svc.worker.cuda_graphs import DecodeGraphs
from engine_svc.worker.device import resolve_device, resolve_dtype
from engine_svc.worker.input_batch import InputBatch
from engine_svc.worker.pooler import Pooler
from engine_svc.worker.sampler import SamplerOutput, gather_logprobs, sample
from engine_svc.worker.sampling_inputs import sampling_metadata
from engine_svc.worker.sleep_mode import SleepingWeights, check_sleep_level, put_to_sleep
from engine_svc.worker.step_inputs import StepBuffers, StepInputs, build_step, graph_sizes
from engine_svc.worker.uploads import upload
from kernels.attention_backends import DecodeShape, Kernels, select_kernels
from kernels.attention_metadata import AttentionMetadata
from protos.native_memory import trim_heap

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 512 * 2**20
_WHERE = {1: "kept in host memory", 2: "dropped (read again from the checkpoint on wake up)"}


def decode_rows(config: EngineConfig) -> int:
    """Rows a decode-only step may have: one per request, or with speculative decoding one per
    token of a verification step (each request's last token and its k proposals, attended as
    decode rows: ``step_inputs``), which the decode kernels, buffers and graphs are sized for."""
    n = config.scheduler.max_num_seqs
    spec = config.speculative
    return n if spec is None else n * (1 + spec.num_speculative_tokens)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    # Pooling requests whose last prompt chunk ran in this step: their result.
    pooled: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)
    # Requests that verified proposals: the accepted ones, emitted before their sampled token,
    # and (when asked for) the logprobs of every token emitted.
    spec_accepted: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int, tp: TPGroup = SINGLE) -> None:
        self.config = config
        self.tp = tp  # TP (issue 33): the rank whose shard of the model this runner holds
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(
            config.model.dtype, self.device, checkpoint_dtype(config.model.model)
        )
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # the kernels launch on the current device
        torch.manual_seed(config.model.seed)
        self.kernels = self._select_kernels()
        self.model = load_model(
            config.model.model, self.dtype, self.device, max_model_len, self.kernels, tp
        )  # TP (issue 33): tp
        self.spec = self.model.spec
        self.pooler = Pooler(self.model)
        # LoRA slots are allocated before the KV cache, which takes what memory is left.
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            dims = ModelDims.from_spec(self.spec)
            plan = self.model.plan  # TP (issue 33): each rank's slots hold its slice
            self.lora = LoRAManager(config.lora, dims, self.dtype, self.device, plan)
            self.model.attach_lora(self.lora.weights)
        # A draft model proposer (spec_decode.draft_model): loaded before the KV cache is
        # sized, its per-block KV counted with the target's. Rank 0 proposes: a tensor-
        # parallel worker verifies the proposals its step message brings, and holds no draft.
        self.draft: DraftModel | None = None
        if isinstance(config.speculative, DraftModelConfig) and tp.is_first:
            self.draft = DraftModel(
                config.speculative, self.spec, self.dtype, self.device, max_model_len,
                self.block_size, config.attention_backend, config.scheduler.max_num_seqs,
                envs.cache_dir() / "kernels",
            )  # fmt: skip
        self.layout = self._kv_layout()
        self.kv_caches = self._allocate_kv_caches()
        self._asleep: SleepingWeights | None = None  # sleep mode: what went off the device
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, by request id
        sched = config.scheduler
        max_blocks = -(-max_model_len // self.block_size)
        self.input_batch = InputBatch(
            sched.max_num_seqs, max_model_len, max_blocks, self.spec.vocab_size, self.device
        )
        self.grammar_bitmask = GrammarBitmask(sched.max_num_seqs, self.spec.vocab_size, self.device)
        # Decode steps padded to the CUDA graph sizes in static buffers: what the graphs replay.
        # On by default on CUDA; on the CPU padding only costs, so it is off (tests turn it on).
        pad = config.pad_decode_batches
        self.pad_decodes = self.device.type == "cuda" if pad is None else pad
        rows = decode_rows(config)
        self.buckets = graph_sizes(rows, config.cuda_graph_sizes)
        self.buffers = StepBuffers(
            max(sched.max_num_batched_tokens, rows), rows, max_blocks, self.device
        )
        logger.info(
            "model loaded on %s (%s); KV cache: %d blocks x %d tokens",
            self.device,
            self.dtype,
            self.layout.num_blocks,
            self.block_size,
        )
        self.graphs: DecodeGraphs | None = self._capture_graphs()

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (key, value) pair of zeroed ``[num_blocks, block_size, kv_heads, head_dim]``
        tensors per layer (and the draft model's own, over the same block ids)."""
        if self.draft is not None:
            self.draft.allocate_kv(self.layout.num_blocks)
        shape = (
            self.layout.num_blocks,
            self.block_size,
            self.model.plan.num_kv_heads,  # TP (issue 33): this rank's KV heads
            self.spec.head_dim,
        )
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    # ------------------------------------------------------------------ sleep mode
    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level it sleeps at."""
        return 0 if self._asleep is None else self._asleep.level

    def kv_cache_nbytes(self) -> int:
        """Bytes the KV cache tensors hold now (0 while asleep)."""
        draft = 0 if self.draft is None else self.draft.nbytes()
        return draft + sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv)

    def sleep(self, level: int) -> None:
        """Free the KV cache and take the weights off the device (``sleep_mode``). The caller
        makes sure no request is in the persistent batch. A no-op when already asleep. When it
        fails, the runner is left awake: weights put back, a new (zeroed) KV cache."""
        check_sleep_level(level)
        if self._asleep is not None:
            return
        self.graphs = None  # they point at the KV cache and the weights: captured again on wake
        self.kv_caches = []  # the only references: the storage goes now
        if self.draft is not None:  # (its weights stay: a draft is small)
            self.draft.free_kv()
        extra = [] if self.lora is None else self.lora.weights.tensors()
        try:
            self._asleep = put_to_sleep(
                level, self.model, extra, self.device, self.config.model.model
            )
        except BaseException:
            self.kv_caches = self._allocate_kv_caches()
            self.graphs = self._capture_graphs()  # over the new cache
            raise
        trim_heap()  # the KV cache's host memory back to the system, wherever it was allocated
        logger.info("asleep (level %d): KV cache freed, weights %s", level, _WHERE[level])

    def wake_up(self) -> None:
        """Weights back on the device and a new, zeroed KV cache of the same number of blocks.
        A no-op when awake."""
        if self._asleep is None:
            return
        # Asleep until both are done: a wake up that fails (no device memory) can be retried.
        self._asleep.wake_up(self.model, self.config.model.model)
        self.kv_caches = self._allocate_kv_caches()
        self._asleep = None
        logger.info(
            "awake: weights on %s, KV cache of %d blocks", self.device, self.layout.num_blocks
        )
        self.graphs = self._capture_graphs()

    def _select_kernels(self) -> Kernels:
        """The attention backend (and norm) for this engine, chosen once here."""
        hf = read_hf_config(self.config.model.model)
        spec = DecoderSpec.from_hf_config(hf, architecture_of(hf))
        plan = spec.shard_plan(self.tp)  # TP (issue 33): this rank's heads
        shape = DecodeShape(
            plan.num_heads,
            plan.num_kv_heads,
            self.max_model_len,
            decode_rows(self.config),
        )
        kernels = select_kernels(
            self.config.attention_backend,
            self.device,
            self.dtype,
            spec.head_dim,
            self.block_size,
            envs.cache_dir() / "kernels",
            shape,
        )
        logger.info("attention backend: %s", kernels.attention.name)
        return kernels

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of the decode forward for every padded batch size, checked against the
        eager forward; None (serving eagerly, and saying why) when they are off or fail."""
        if self.config.enforce_eager or not self.pad_decodes:
            return None
        capture = cuda_graphs.capture_backend(self.device)
        if capture is None:
            return None
        if not self.buckets:
            logger.warning(
                "CUDA graphs off: no --cuda-graph-sizes value is at most max_num_seqs (%d)",
                self.config.scheduler.max_num_seqs,
            )
            return None
        if not self.kernels.attention.graph_safe:
            logger.warning(
                "CUDA graphs off: the %s attention backend cannot be captured; serving eagerly",
                self.kernels.attention.name,
            )
            return None

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return self.model(ids, pos, self.kv_caches, meta, None)

        try:
            with torch.inference_mode():
                return cuda_graphs.capture_checked(
                    self.buckets,
                    forward,
                    self.buffers,
                    capture,
                    self.kv_caches,
                    self.max_model_len,
                    self.spec.vocab_size,
                )
        except Exception as e:  # noqa: BLE001 -- a capture error or a mismatch: serve eagerly
            logger.warning("CUDA graphs off (%s: %s); serving eagerly", type(e).__name__, e)
            if self.device.type == "cuda":
                try:
                    torch.cuda.empty_cache()  # the failed graphs' pool
                except RuntimeError as cleanup:
                    logger.warning("after the failed capture, empty_cache failed: %s", cleanup)
            return None

    def _kv_layout(self) -> KVCacheLayout:
        cache = self.config.cache
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = (
            2
            * self.spec.num_layers
            * self.block_size
            * self.model.plan.num_kv_heads  # TP (issue 33): this rank's KV heads
            * self.spec.head_dim
            * elem
        )
        if self.draft is not None:  # both caches per block id
            per_block += self.draft.bytes_per_block
        if cache.num_kv_blocks is not None:
            num_blocks = cache.num_kv_blocks
        else:
            budget = cache.kv_cache_memory
            if budget is None:
                budget = self._default_kv_budget()
            num_blocks = budget // per_block
        num_blocks = min_over_ranks(num_blocks, self.tp, self.device)  # TP (issue 33)
        if num_blocks < 1:
            raise ValueError(f"KV cache budget too small: one block needs {per_block} bytes")
        return KVCacheLayout(num_blocks, self.block_size, per_block)

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return _CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free
        return max(int(total * self.config.cache.gpu_memory_utilization) - used_by_others, 0)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self._asleep is not None:
            raise RuntimeError("the model runner is asleep; wake_up() first")
        self._update_batch(so)
        if so.is_empty:
            return ModelRunnerOutput()
        spec = [s for s in so.scheduled if s.spec_token_ids] if self.config.speculative else []
        for s in spec:  # the proposals are this step's input after the request's known tokens
            row = self.input_batch.row_of[s.request.request_id]
            n = int(self.input_batch.num_tokens[row])
            self.input_batch.token_ids[row, n : n + len(s.spec_token_ids)] = s.spec_token_ids
        step = build_step(
            so.scheduled,
            self.input_batch,
            self.buffers,
            self.block_size,
            self.buckets if self.pad_decodes else None,
            verifies=bool(spec),  # a verification step is attended (and replayed) as decodes
        )
        lora = self._lora_mapping(step.token_lora)
        pooling = self.input_batch.is_pooling[step.rows]
        hidden = self._forward(step, lora, bool(pooling.any()))

        out = ModelRunnerOutput()
        reaching_end = np.fromiter(
            (
                s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
                for s in step.batch
            ),
            bool,
            len(step.batch),
        )
        if pooling.any():
            out.pooled = self.pooler.pool(step, hidden, np.flatnonzero(pooling))
        sampling = np.flatnonzero(reaching_end & ~pooling)
        if spec:
            verifying = np.fromiter((bool(step.batch[i].spec_token_ids) for i in sampling), bool)
            verify_step(
                step, sampling[verifying], hidden, self.input_batch, self.model.compute_logits,
                self.grammar_bitmask, self.generators, out.sampled, out.spec_accepted,
                out.spec_logprobs, None if self.draft is None else self.draft.probs,
            )  # fmt: skip
            sampling = sampling[~verifying]
        if sampling.size:
            reqs = [step.batch[i].request for i in sampling]
            rows = step.rows[sampling]
            last = step.last_index[sampling]
            if last[-1] == sampling.size - 1:  # rows 0..n-1 (a decode step): no gather
                selected = hidden[: sampling.size]
            else:
                selected = hidden.index_select(0, upload(last, self.device))
            logits = self.model.compute_logits(selected)
            constrained = np.flatnonzero(self.input_batch.has_grammar[rows])
            if constrained.size:  # forbidden tokens -> -inf, before any sampling parameter
                grammars = [g for i in constrained if (g := reqs[i].grammar) is not None]
                self.grammar_bitmask.apply(logits, constrained.tolist(), grammars)
            md = sampling_metadata(self.input_batch, rows, reqs, self.generators, logits.shape[-1])
            result = sample(logits, md)
            logprobs = _logprobs_to_host(result)  # copies queued before the sync: they ride on it
            token_ids = result.token_ids.tolist()  # the one host sync of the step
            self.input_batch.append_sampled(rows.tolist(), token_ids, result.token_ids)
            out.sampled.update(zip((r.request_id for r in reqs), token_ids, strict=True))
            if logprobs is not None:
                self._collect_logprobs(reqs, logprobs, out)
        for i, s in enumerate(step.batch):
            if s.request.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden, int(step.last_index[i]), out)
        if self.draft is not None:  # its KV over what this step committed (it proposes later)
            self.draft.catch_up(step.batch, step.rows, self.input_batch, out.sampled)
        return out

    def _forward(self, step: StepInputs, lora: LoRAMapping | None, pooling: bool) -> torch.Tensor:
        """Hidden states of the step's tokens: a decode-only step of a captured size without
        LoRA or pooling rows replays its CUDA graph, any other runs the model eagerly."""
        graphs, meta = self.graphs, step.meta
        if (
            graphs is not None
            and step.decode_only
            and lora is None
            and not pooling
            and meta.num_reqs in graphs
        ):
            return graphs.replay(meta.num_reqs)
        return self.model(step.input_ids, step.positions, self.kv_caches, meta, lora)

    def _lora_mapping(self, token_lora: np.ndarray | None) -> LoRAMapping | None:
        """Put the step's adapters on the device (moving least recently used ones out) and
        group its tokens by slot; None when no token uses an adapter."""
        if token_lora is None or self.lora is None:
            return None
        ids, inverse = np.unique(token_lora, return_inverse=True)
        slot_of = self.lora.prepare(int(i) for i in ids if i)
        slots = np.array([slot_of.get(int(i), -1) for i in ids], dtype=np.int64)
        return LoRAMapping.build(slots[inverse], self.device)

    def _update_batch(self, so: SchedulerOutput) -> None:
        """Bring the persistent batch up to this step: drop finished and preempted requests,
        give admitted ones a row, append the blocks running ones got."""
        batch = self.input_batch
        for rid in so.finished_ids:
            batch.remove(rid)
            self.generators.pop(rid, None)
            if self.draft is not None:
                self.draft.drop(rid)
            self.pooler.drop(rid)  # aborted mid-prompt: its partial MEAN / CLS state
        for rid in so.preempted_ids:
            batch.remove(rid)  # its generator stays: a seeded request resumes its stream
            if self.draft is not None:
                self.draft.drop(rid)
            self.pooler.drop(rid)  # a pooling request recomputes its prompt from the start
        for s in so.scheduled:
            if s.admitted:
                batch.add(s.request, s.block_ids)
            elif s.block_ids:
                batch.append_blocks(batch.row_of[s.request.request_id], s.block_ids)

    def _collect_logprobs(
        self, reqs: list[Request], host: list[torch.Tensor], out: ModelRunnerOutput
    ) -> None:
        """``host``: the sampled tokens' logprobs, ranks, top ids and top logprobs, on the host
        (``_logprobs_to_host``, read after the step's sync)."""
        lp, ranks, top_ids, top_lp = (t.tolist() for t in host)
        for row, r in enumerate(reqs):
            n = r.sampling_params.logprobs
            if n is None:
                continue
            token = out.sampled[r.request_id]
            top = dict(zip(top_ids[row][:n], top_lp[row][:n], strict=True))
            out.logprobs[r.request_id] = Logprobs(token, lp[row], ranks[row], top)

    def _prompt_logprobs(
        self, s: ScheduledRequest, hidden: torch.Tensor, last: int, out: ModelRunnerOutput
    ) -> None:
        """Logprobs of the prompt tokens this step's chunk predicts, for those not known yet.

        ``req.prompt_logprobs[i]`` is about prompt token i (entry 0 is None). A request preempted
        during its prefill computes its chunks again; the entries it already has are not
        produced twice::

            chunk positions      start ............ start + num_tokens
            predicts tokens      start + 1 ........ (capped at the last prompt token)
            known entries        [0, known)  -> only positions >= known - 1 are new
        """
        req = s.request
        start = req.num_computed_tokens
        known = len(req.prompt_logprobs)
        first_pos = max(start, known - 1)
        end_pos = min(start + s.num_tokens, req.num_prompt_tokens - 1)  # exclusive
        entries: list[Logprobs | None] = [None] if known == 0 and start == 0 else []
        count = end_pos - first_pos
        if count > 0:
            first_row = last - s.num_tokens + 1 + (first_pos - start)
            logits = self.model.compute_logits(hidden[first_row : first_row + count]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = upload(
                req.prompt_token_ids[first_pos + 1 : first_pos + 1 + count], self.device
            )
            n = req.sampling_params.prompt_logprobs or 0
            chosen, ranks, top_ids, top_lp = gather_logprobs(logprobs, targets, n)
            for tok, c, rk, ids, lps in zip(
                targets.tolist(),
                chosen.tolist(),
                ranks.tolist(),
                top_ids.tolist(),
                top_lp.tolist(),
                strict=True,
            ):
                entries.append(Logprobs(tok, c, rk, dict(zip(ids, lps, strict=True))))
        if entries:
            out.prompt_logprobs[req.request_id] = entries


def _logprobs_to_host(result: SamplerOutput) -> list[torch.Tensor] | None:
    """The sampler's logprob tensors copied to host memory without waiting (pinned, non-blocking;
    on the CPU, themselves): queued before the step reads its token ids, whose sync they then
    share, instead of one sync per tensor. None when no row asked for logprobs."""
    if result.top_ids is None:
        return None
    tensors = (result.sampled_logprobs, result.sampled_ranks, result.top_ids, result.top_logprobs)
    return [t.to("cpu", non_blocking=True) for t in tensors if t is not None]
