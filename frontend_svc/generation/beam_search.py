"""Beam search (``use_beam_search``), run by the gateway as vLLM's front end runs it.

The engine only ever takes one step: each live beam is an engine request for one token with the
``2 * width`` most likely next tokens as logprobs (its prompt is the beam so far, so the prefix
cache serves all but the last token). Every (beam, token) pair is a candidate scored by its
cumulative logprob; a candidate ending in EOS is set aside as finished, the ``width`` best of the
others go on. After ``max_tokens`` steps (or when no beam is left) the ``width`` best of the
finished and live beams, by vLLM's score ``cumulative logprob / (prompt + output length) **
length_penalty``, are the choices, best first.

Keeping the top ``width`` of each beam's top ``2 * width`` tokens is the same as keeping the
top ``width`` of every (beam, token) pair: a pair among the best ``width`` overall is among its
own beam's best ``width``. So without EOS this is transformers' beam search too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from frontend_svc.errors import invalid_parameter
from frontend_svc.generation.run import ChoiceResult
from frontend_svc.generation.token_constraints import PreparedPrompt
from frontend_svc.protocol import SamplingOptions
from frontend_svc.text.tokenizer import Tokenizer
from protos.types import EngineOutput, EngineRequest, EngineSamplingParams

# A beam's next step: (token id, logprob) of the most likely tokens after the prompt followed by
# the beam's tokens.
Step = Callable[[tuple[int, ...]], Awaitable[list[tuple[int, float]]]]


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated so far (an EOS that ended it is not among them)
    cum_logprob: float
    finish_reason: str = "length"
    stop_reason: int | None = None


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: the length counts the prompt, not an ending EOS."""
    return beam.cum_logprob / ((prompt_len + len(beam.tokens)) ** length_penalty)


async def search(
    step: Step,
    prompt_len: int,
    width: int,
    max_tokens: int,
    eos_ids: Collection[int],
    length_penalty: float = 1.0,
) -> list[Beam]:
    """The ``width`` best beams, best first. ``step(tokens)`` awaits the most likely next
    tokens after the prompt followed by ``tokens`` (at least ``2 * width`` of them); ``eos_ids``
    end a beam (empty: ``ignore_eos``)."""

    def key(b: Beam) -> float:
        return score(b, prompt_len, length_penalty)

    live, finished = [Beam((), 0.0)], []
    for _ in range(max_tokens):
        tops = await asyncio.gather(*(step(b.tokens) for b in live))
        candidates = []
        for beam, top in zip(live, tops, strict=True):
            for token, logprob in top:
                cum = beam.cum_logprob + logprob
                if token in eos_ids:
                    finished.append(Beam(beam.tokens, cum, "stop", token))
                else:
                    candidates.append(Beam((*beam.tokens, token), cum))
        live = sorted(candidates, key=key, reverse=True)[:width]
        if not live:
            break
    return sorted(finished + live, key=key, reverse=True)[:width]


async def beam_search(
    engines_generate: Callable[[EngineRequest], AsyncIterator[EngineOutput]],
    tokenizer: Tokenizer,
    eos_ids: Sequence[int],
    max_logprobs: int,
    request_id: str,
    prompts: Sequence[PreparedPrompt],
    options: SamplingOptions,
    lora_name: str = "",
) -> list[ChoiceResult]:
    """The choices of a ``use_beam_search`` call: ``options.n`` beams per prompt (choice index
    = prompt index * n + rank), each decoded whole. 400 when the width needs more logprobs per
    step than the engine gives (``--max-logprobs``)."""
    width = options.n
    if 2 * width > max_logprobs:
        raise invalid_parameter(
            f"Beam search with n={width} needs the {2 * width} most likely tokens per step; "
            f"this server returns at most {max_logprobs} (--max-logprobs): use n <= "
            f"{max_logprobs // 2}.",
            "n",
        )
    params = EngineSamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width)
    ends = () if options.engine.ignore_eos else tuple(eos_ids)
    results: list[ChoiceResult] = []
    steps = 0
    for p_idx, prompt in enumerate(prompts):

        async def step(
            tokens: tuple[int, ...], prompt: PreparedPrompt = prompt
        ) -> list[tuple[int, float]]:
            nonlocal steps
            steps += 1
            request = EngineRequest(
                f"{request_id}-b{steps}",  # every step of every beam: an id of its own
                (*prompt.token_ids, *tokens),
                params,
                lora_name=lora_name,
            )
            return await _top_tokens(engines_generate(request))

        beams = await search(
            step,
            len(prompt.token_ids),
            width,
            prompt.max_tokens,
            ends,
            options.length_penalty,
        )
        for rank, beam in enumerate(beams):
            results.append(
                ChoiceResult(
                    index=p_idx * width + rank,
                    prompt_index=p_idx,
                    text=tokenizer.decode(
                        list(beam.tokens), skip_special_tokens=options.skip_special_tokens
                    ),
                    token_ids=list(beam.tokens),
                    finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason,
                    num_prompt_tokens=len(prompt.token_ids),
                )
            )
    return results


async def _top_tokens(outputs: AsyncIterator[EngineOutput]) -> list[tuple[int, float]]:
    """The one step's chosen token and its alternatives, (token id, logprob), each once."""
    top: dict[int, float] = {}
    async with contextlib.aclosing(outputs):  # type: ignore[type-var]
        async for out in outputs:
            for lp in out.logprobs:
                top.setdefault(lp.token_id, lp.logprob)
                for token, logprob in lp.top:
                    top.setdefault(token, logprob)
    return list(top.items())


def check_beam_search(options: SamplingOptions, stream: bool, logprobs: bool) -> None:
    """400 naming the field for what beam search does not do (vLLM's beam search ignores
    them; here they are refused rather than silently dropped)."""
    if stream:
        raise invalid_parameter(
            "'use_beam_search' does not stream: set 'stream' to false.", "stream"
        )
    if logprobs:
        raise invalid_parameter("'use_beam_search' returns no logprobs.", "logprobs")
    if options.engine.structured_output is not None:
        raise invalid_parameter(
            "'use_beam_search' takes no structured-output constraint.",
            options.structured_output_param or "response_format",
        )
    if options.stop:
        raise invalid_parameter("'use_beam_search' ends beams at EOS only, not at 'stop'.", "stop")
