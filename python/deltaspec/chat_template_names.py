"""Chat templates that `--chat-template NAME` selects by name, as llama.cpp's built-in names do.

Only the formats Qwen3.5 / Qwen3.6 models speak: `chatml` (their base format: each message as
<|im_start|>ROLE\\nCONTENT<|im_end|>) and `qwen35` (the Qwen3.5 format with thinking and tool calls,
what `deltaspec synth` writes into its files). llama.cpp's names for other families (llama3,
gemma, mistral, ...) would render tokens these models never learned, so they are refused.
"""

from __future__ import annotations

from .qwen35_template import QWEN35_CHAT_TEMPLATE

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

BUILTIN_CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "qwen35": QWEN35_CHAT_TEMPLATE}
