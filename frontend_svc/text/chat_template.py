"""Chat templates rendered the way Hugging Face ``apply_chat_template`` does, without transformers.

A sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, the loop-controls
extension, ``raise_exception`` and ``strftime_now`` globals and a ``tojson`` filter that keeps
non-ASCII text as is.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or failed to render; the message says why."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    extra: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render ``messages`` (OpenAI-style dicts with string content) into the prompt text.

    ``tools``: the request's tool definitions (``{"type": "function", "function": {...}}``), the
    template's ``tools`` variable, None without any (as ``apply_chat_template`` passes it);
    ``extra`` (the request's ``chat_template_kwargs``) may override it, as in vLLM."""
    context: dict[str, Any] = {"tools": tools, **(extra or {})}
    context.update(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
    )
    try:
        return compile_template(template).render(**context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


def cut_after_final_message(rendered: str, final_content: str) -> str:
    """The rendered chat cut right after the final message's content, so the model continues
    that message (``continue_final_message``, as Hugging Face's ``apply_chat_template`` does it:
    the content's last occurrence, with the template's own trimming of spaces respected)."""
    stripped = final_content.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template."
        )
    if rendered[at : at + len(final_content.lstrip())] == final_content.lstrip():
        return rendered[: at + len(final_content.lstrip())]  # the template kept the spacing
    return rendered[: at + len(stripped)]  # it trimmed the spaces: so do we
