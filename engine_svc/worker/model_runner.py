"""The model runner: turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

Per step it builds the flattened batch (decodes first, then multi-token chunks), the positions,
the slot mapping and the block tables, runs the model, computes logits only for rows that
sample (and for prompt-logprob rows), and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine_svc import envs
from engine_svc.config import EngineConfig, KVCacheLayout
from engine_svc.core.request import Logprobs, Request
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput
from engine_svc.models.llama import DecoderSpec
from engine_svc.models.loader import architecture_of, load_model, read_hf_config
from engine_svc.worker.device import resolve_device, resolve_dtype
from engine_svc.worker.sampler import SamplingMetadata, gather_logprobs, sample
from kernels.attention_backends import Kernels, select_kernels
from kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 512 * 2**20


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        self.kernels = self._select_kernels()
        self.model = load_model(
            config.model.model, self.dtype, self.device, max_model_len, self.kernels
        )
        self.spec = self.model.spec
        self.layout = self._kv_layout()
        shape = (
            self.layout.num_blocks,
            self.block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
        )
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}
        logger.info(
            "model loaded on %s (%s); KV cache: %d blocks x %d tokens",
            self.device,
            self.dtype,
            self.layout.num_blocks,
            self.block_size,
        )

    def _select_kernels(self) -> Kernels:
        """The attention backend (and norm) for this engine, chosen once here."""
        choice = self.config.attention_backend
        if choice == "auto" and self.device.type == "cuda" and envs.cuda_kernels_enabled():
            choice = "cuda"
        hf = read_hf_config(self.config.model.model)
        head_dim = DecoderSpec.from_hf_config(hf, architecture_of(hf)).head_dim
        kernels = select_kernels(
            choice, self.device, self.dtype, head_dim, self.block_size, envs.cache_dir() / "kernels"
        )
        logger.info("attention backend: %s", kernels.attention.name)
        return kernels

    def _kv_layout(self) -> KVCacheLayout:
        cache = self.config.cache
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = (
            2
            * self.spec.num_layers
            * self.block_size
            * self.spec.num_kv_heads
            * self.spec.head_dim
            * elem
        )
        if cache.num_kv_blocks is not None:
            num_blocks = cache.num_kv_blocks
        else:
            budget = cache.kv_cache_memory
            if budget is None:
                budget = self._default_kv_budget()
            num_blocks = budget // per_block
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
        for rid in so.finished_ids:
            self.generators.pop(rid, None)
        if so.is_empty:
            return ModelRunnerOutput()
        batch = sorted(so.scheduled, key=lambda s: s.num_tokens != 1)  # decodes first, stable
        input_ids, positions, meta, last_index = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        out = ModelRunnerOutput()
        sampling = [
            (i, s)
            for i, s in enumerate(batch)
            if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
        ]
        if sampling:
            rows = torch.tensor([last_index[i] for i, _ in sampling], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            reqs = [s.request for _, s in sampling]
            result = sample(logits, self._sampling_metadata(reqs, logits.shape[-1]))
            token_ids = result.token_ids.tolist()  # the one host sync of the step
            for req, token in zip(reqs, token_ids, strict=True):
                out.sampled[req.request_id] = token
            if result.top_ids is not None:
                self._collect_logprobs(reqs, result, out)
        for i, s in enumerate(batch):
            if s.request.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden, last_index[i], out)
        return out

    def _prepare(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the batch::

        request     r0      r1      r2 (chunk of 4 after 8 cached)
        tokens      [a]     [b]     [c c c c]
        positions   [17]    [40]    [8 9 10 11]
        slot        bt[r][pos // bs] * bs + pos % bs
        """
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        for s in batch:
            start = s.request.num_computed_tokens
            end = start + s.num_tokens
            tokens.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_start.append(len(tokens))
            seq_lens.append(end)
        max_blocks = max(len(s.block_ids) for s in batch)
        tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in batch]

        block_tables = torch.tensor(tables, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        q_lens = torch.tensor([s.num_tokens for s in batch], dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(len(batch)), q_lens)
        slots = block_tables[req_of_token, pos // bs] * bs + pos % bs
        num_decodes = sum(1 for s in batch if s.num_tokens == 1)
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=len(batch),
            num_decodes=num_decodes,
            num_tokens=len(tokens),
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64).to(dev, non_blocking=True),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start,
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(tokens, dtype=torch.int64).to(dev, non_blocking=True)
        last_index = [q - 1 for q in query_start[1:]]
        return input_ids, pos.to(dev, non_blocking=True), meta, last_index

    def _sampling_metadata(self, reqs: list[Request], vocab: int) -> SamplingMetadata:
        params = [r.sampling_params for r in reqs]
        dev = self.device
        all_greedy = all(p.greedy for p in params)
        md = SamplingMetadata(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=dev
            ),
            all_greedy=all_greedy,
            top_k=None,
            top_p=None,
            min_p=None,
            generators={},
        )
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                md.top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            for row, r in enumerate(reqs):
                seed = r.sampling_params.seed
                if seed is not None and not r.sampling_params.greedy:
                    gen = self.generators.get(r.request_id)
                    if gen is None:
                        gen = torch.Generator(device=dev)
                        gen.manual_seed(seed % 2**64)
                        self.generators[r.request_id] = gen
                    md.generators[row] = gen
        if any(p.has_penalties for p in params):
            self._add_penalties(md, reqs, vocab)
        banned = []
        for row, r in enumerate(reqs):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                ids = [t for t in ids if t < vocab]
                if ids:
                    banned.append((row, ids))
        md.banned = banned or None
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(wanted) if wanted else None
        return md

    def _add_penalties(self, md: SamplingMetadata, reqs: list[Request], vocab: int) -> None:
        dev = self.device
        b = len(reqs)
        params = [r.sampling_params for r in reqs]
        md.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
        md.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
        md.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
        counts = torch.zeros(b, vocab, dtype=torch.int32)
        seen = torch.zeros(b, vocab, dtype=torch.bool)
        for row, r in enumerate(reqs):
            out_ids = torch.tensor(r.output_token_ids, dtype=torch.int64)
            counts[row].scatter_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
            seen[row, torch.tensor(r.all_token_ids, dtype=torch.int64)] = True
        md.output_counts = counts.to(dev, non_blocking=True)
        md.seen_mask = seen.to(dev, non_blocking=True)

    def _collect_logprobs(self, reqs: list[Request], result, out: ModelRunnerOutput) -> None:  # type: ignore[no-untyped-def]
        lp = result.sampled_logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        top_ids = result.top_ids.tolist()
        top_lp = result.top_logprobs.tolist()
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
            targets = torch.tensor(
                req.prompt_token_ids[first_pos + 1 : first_pos + 1 + count], device=self.device
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
