"""The Qwen3.5 chat template, for GGUFs deltaspec writes itself (`deltaspec synth`, the tiny test
models): a model a user makes here should chat like the real checkpoints do.

Written for deltaspec from the published template's behaviour (ChatML turns; a `# Tools` system
block listing each tool as JSON with the XML `<tool_call><function=...><parameter=...>` calling
convention; `<think>` blocks kept only for assistant turns after the last real user query; tool
results grouped into one user turn of `<tool_response>` blocks; a generation prompt that opens
`<think>`, or closes an empty one when `enable_thinking` is false; vision placeholders). Its
output is checked character for character against the Qwen3.5-4B template of the pinned llama.cpp
tree (tests/test_chat_template_synth.py).
"""

from __future__ import annotations

# The system text that introduces tools (the model was trained on exactly this wording).
_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>")
_TOOLS_INSTRUCTIONS = (
    "\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
    "</parameter>\\n<parameter=example_parameter_2>\\nThis is the value for the second parameter\\n"
    "that can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\\n- Required parameters MUST be specified\\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\\n- If there is no function call available, answer the question like normal with "
    "your current knowledge and do not tell the user about function calls\\n</IMPORTANT>")

QWEN35_CHAT_TEMPLATE = r"""{#- Qwen3.5 chat format (ChatML with thinking and XML tool calls), written for deltaspec. -#}
{%- set counts = namespace(images=0, videos=0) -%}
{%- macro text_of(content, count_media, in_system=false) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if 'image' in part or 'image_url' in part or part.type == 'image' -%}
{%- if in_system %}{{ raise_exception('System message cannot contain images.') }}{% endif -%}
{%- if count_media %}{% set counts.images = counts.images + 1 %}{% endif -%}
{%- if add_vision_id %}{{ 'Picture ' ~ counts.images ~ ': ' }}{% endif -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif 'video' in part or part.type == 'video' -%}
{%- if in_system %}{{ raise_exception('System message cannot contain videos.') }}{% endif -%}
{%- if count_media %}{% set counts.videos = counts.videos + 1 %}{% endif -%}
{%- if add_vision_id %}{{ 'Video ' ~ counts.videos ~ ': ' }}{% endif -%}
<|vision_start|><|video_pad|><|vision_end|>
{%- elif 'text' in part -%}
{{- part.text -}}
{%- else -%}
{{- raise_exception('Unexpected item type in content.') -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is none or content is undefined -%}
{%- else -%}
{{- raise_exception('Unexpected content type.') -}}
{%- endif -%}
{%- endmacro -%}
{%- if not messages %}{{ raise_exception('No messages provided.') }}{% endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- set system_text = text_of(messages[0].content, false, true)|trim if has_system else '' -%}
{%- if tools and tools is iterable and tools is not mapping -%}
<|im_start|>system
{{ '__PREAMBLE__' }}
{%- for tool in tools %}{{ '\n' ~ (tool|tojson) }}{% endfor -%}
{{ '\n</tools>' ~ '__INSTRUCTIONS__' }}
{%- if system_text %}{{ '\n\n' ~ system_text }}{% endif -%}
<|im_end|>{{ '\n' }}
{%- elif has_system -%}
<|im_start|>system{{ '\n' ~ system_text }}<|im_end|>{{ '\n' }}
{%- endif -%}
{#- The last user message that is a real query, not a turn of tool results: reasoning of the
    assistant turns after it is shown to the model, reasoning of earlier turns is dropped. -#}
{%- set scan = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{%- set text = text_of(message.content, false)|trim -%}
{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
{%- set scan.last_query = loop.index0 -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if scan.last_query < 0 %}{{ raise_exception('No user query found in messages.') }}{% endif -%}
{%- for message in messages -%}
{%- set text = text_of(message.content, true)|trim -%}
{%- if message.role == 'system' -%}
{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif -%}
{%- elif message.role == 'user' -%}
<|im_start|>user{{ '\n' ~ text }}<|im_end|>{{ '\n' }}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set text = text.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
<|im_start|>assistant{{ '\n' }}
{%- if loop.index0 > scan.last_query %}{{ '<think>\n' ~ (reasoning|trim) ~ '\n</think>\n\n' }}{% endif -%}
{{- text -}}
{%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first %}{{ '\n' }}{% elif text|trim %}{{ '\n\n' }}{% endif -%}
<tool_call>{{ '\n' }}<function={{ fn.name }}>{{ '\n' }}
{%- if fn.arguments is defined -%}
{%- for name, value in fn.arguments|items -%}
<parameter={{ name }}>{{ '\n' }}
{%- if value is mapping or (value is sequence and value is not string) %}{{ value|tojson }}{% else %}{{ value|string }}{% endif -%}
{{ '\n' }}</parameter>{{ '\n' }}
{%- endfor -%}
{%- endif -%}
</function>{{ '\n' }}</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>{{ '\n' }}
{%- elif message.role == 'tool' -%}
{%- if loop.previtem and loop.previtem.role != 'tool' %}<|im_start|>user{% endif -%}
{{ '\n<tool_response>\n' ~ text ~ '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>{{ '\n' }}{% endif -%}
{%- else -%}
{{- raise_exception('Unexpected message role.') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant{{ '\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif -%}
{%- endif -%}
""".replace("__PREAMBLE__", _TOOLS_PREAMBLE).replace("__INSTRUCTIONS__", _TOOLS_INSTRUCTIONS)
