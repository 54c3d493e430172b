"""A character tokenizer with a chat template, for the OpenAI endpoint's tests (no model).

``ChatCharTokenizer`` is ``agent_fakes.CharTokenizer`` (one token per character, EOS id 3) with a
Jinja chat template shaped as Qwen3's: ``\\x01ROLE\\n CONTENT \\x03\\n`` per message (``\\x03`` is
EOS, so an action that stops ends with the template's end-of-turn token), tools listed in a
system turn, tool calls written as ``<tool_call>{json}</tool_call>`` after the content, and, as
Qwen3 does, the ``<think>...</think>`` block of every assistant message before the last user
message dropped: the history rewrite the endpoint's exact-reuse rule is for; and, as Qwen3's,
``enable_thinking=False`` opens the reply with an empty ``<think></think>``.
"""

from __future__ import annotations

from typing import Any

import jinja2

from helpers.agent_fakes import CharTokenizer

TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}{{ '\x01system\ntools:' }}{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\x03\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set c = m.content or '' -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{ '\x01' + m.role + '\n' + c }}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "<tool_call>{{ tc.function | tojson }}</tool_call>"
    "{%- endfor -%}{%- endif -%}"
    "{{ '\x03\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\x01assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think></think>' }}{%- endif -%}"
    "{%- endif -%}"
)

_env = jinja2.Environment()
_env.policies["json.dumps_kwargs"] = {"sort_keys": False}
_template = _env.from_string(TEMPLATE)


class ChatCharTokenizer(CharTokenizer):
    all_special_ids = [CharTokenizer.eos_token_id]
    name_or_path = "char-model"

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: Any = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kw: Any,
    ) -> Any:
        text = _template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kw)
        return [ord(c) for c in text] if tokenize else text

    def get_vocab(self) -> dict[str, int]:  # vLLM's tool parsers read it
        return {chr(i): i for i in range(32, 127)}


def render(messages: list[dict], tools: Any = None, add_generation_prompt: bool = True) -> str:
    return ChatCharTokenizer().apply_chat_template(messages, tools, add_generation_prompt, tokenize=False)
