"""Chat templates the tests serve, written here (no downloads)."""

from __future__ import annotations

# Qwen2.5-style tool use, reduced: tool definitions in a system block, an assistant's calls as
# hermes <tool_call> blocks (arguments written with tojson, so they must arrive as objects),
# tool results as <tool_response> blocks in a user turn.
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" and message.tool_calls %}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# Qwen3-style thinking, reduced: tools as above; an assistant message's reasoning_content shown
# in a think block; with add_generation_prompt and enable_thinking false, an empty think block
# closed in the prompt (so the model answers without thinking), as Qwen3's template does.
QWEN3_THINKING_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.reasoning_content %}
<|im_start|>assistant
<think>
{{ message.reasoning_content }}
</think>

{{ message.content }}<|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{%- endif %}"""
