"""Prompts to token ids: chat templates rendered, text tokenized, off the event loop when big.

``tokenizers``' ``Tokenizer.encode`` holds the GIL for the whole call (measured: with a 3 MB
prompt in a worker thread, the main thread ran for 6 ms of the 3.8 s call), so a worker thread
alone does not keep the event loop free. ``encode_batch_fast`` releases the GIL (main thread
stalls <= ~30 ms on a loaded 2-core box), skips the character offsets we never use (2x faster)
and frees its result in ~1 ms instead of ~150 ms. What still holds the GIL is turning the ids
into a Python list (~10-35 ns per token) and, later, freeing it: a prompt on its way to the engine
is cut at the context length (``max_length``), so a huge one never becomes millions of ints (that
stalled the loop ~90 ms for a 3 MB prompt of 2M tokens).

Inputs under ``OFFLOAD_MIN_CHARS`` stay on the loop: a round trip through the pool costs ~90 us,
as much as encoding ~300 characters with the test tokenizer; 1024 characters encode in ~0.3 ms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from frontend_svc.errors import invalid_parameter
from frontend_svc.text.chat_template import ChatTemplateError, cut_after_final_message, render_chat
from frontend_svc.text.tokenizer import EncodedPrompt, Tokenizer
from protos.native_memory import trim_heap

T = TypeVar("T")

OFFLOAD_MIN_CHARS = 1024
MESSAGE_COST_CHARS = 16  # a chat message counts as this many characters towards the threshold
TOOL_COST_CHARS = 256  # so does a tool definition (written out as JSON by the template)


class PromptEncoder:
    """Encodes prompts; big ones in a bounded pool of threads (``--tokenizer-threads``).

    ``max_length`` (the context length, for prompts that are going to the engine) bounds how
    many ids of a huge prompt become Python objects; ``EncodedPrompt.num_tokens`` is exact.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def encode(
        self,
        tokenizer: Tokenizer,
        texts: Sequence[str],
        add_special_tokens: bool,
        max_length: int | None = None,
    ) -> list[EncodedPrompt]:
        """Token ids of each text (one worker call for the whole batch when it is big)."""
        if sum(map(len, texts)) < OFFLOAD_MIN_CHARS:
            ids = [tokenizer.encode(text, add_special_tokens) for text in texts]
            return [EncodedPrompt(i, len(i)) for i in ids]
        return await self.run(
            encode_releasing_gil, tokenizer, list(texts), add_special_tokens, max_length
        )

    async def encode_chat(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
        max_length: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> EncodedPrompt:
        """Render the chat template and tokenize (by default the template writes BOS itself).
        ``tools``: the template's tool definitions; ``continue_final_message``: the prompt ends
        inside the last message, which the model goes on writing."""

        def render() -> str:
            return render_chat_prompt(
                tokenizer,
                messages,
                add_generation_prompt,
                template_kwargs,
                tools,
                continue_final_message,
            )

        # Rendering costs per message as well as per character (~1 us a message).
        cost = sum(len(m["content"]) for m in messages) + MESSAGE_COST_CHARS * len(messages)
        cost += TOOL_COST_CHARS * (len(tools or ()) + sum("tool_calls" in m for m in messages))
        if cost < OFFLOAD_MIN_CHARS:
            return (await self.encode(tokenizer, [render()], add_special_tokens, max_length))[0]
        return await self.run(
            lambda: encode_releasing_gil(tokenizer, [render()], add_special_tokens, max_length)[0]
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run other CPU-heavy work of a request in the pool (parsing a big body, building a
        big response), away from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def encode_releasing_gil(
    tokenizer: Tokenizer,
    texts: list[str],
    add_special_tokens: bool,
    max_length: int | None = None,
) -> list[EncodedPrompt]:
    """The same ids as ``Tokenizer.encode``, computed without holding the GIL."""
    encoded = tokenizer.encode_batch_releasing_gil(texts, add_special_tokens, max_length)
    if sum(map(len, texts)) >= TRIM_MIN_CHARS:
        trim_heap()
    return encoded


# Tokenizing a 3 MB prompt takes ~300 MB of native memory (a Rust string per token); freed, it
# stays in the worker thread's malloc arena, so each of the pool's threads kept its own few
# hundred MB after one big prompt (measured: 57 -> 513 MB RSS after four 3 MB prompts).
TRIM_MIN_CHARS = 256 * 1024


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text the chat template makes of ``messages`` (and ``tools``), cut after the
    last message's content with ``continue_final_message``; template failures are 400s."""
    if not tokenizer.chat_template:
        raise invalid_parameter("The model has no chat template; use /v1/completions.", "messages")
    try:
        rendered = render_chat(
            tokenizer.chat_template,
            list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.special.bos_token,
            eos_token=tokenizer.special.eos_token,
            extra=template_kwargs,
            tools=tools,
        )
        if continue_final_message:
            return cut_after_final_message(rendered, str(messages[-1]["content"]))
        return rendered
    except ChatTemplateError as e:
        raise invalid_parameter(str(e), "messages") from e
    except RecursionError as e:  # a template walking a deeply nested message field
        raise invalid_parameter("The messages are nested too deeply.", "messages") from e
