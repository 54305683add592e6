"""A tiny tokenizer and chat template shaped like Gemma 4's for the tool-call and reasoning tests (this module holds
no tests): the demo pair's byte-level tokenizer plus Gemma 4's turn, tool, tool-call, tool-response, string-quote,
channel and think markers as special tokens, and a template of our own that renders a chat the way Gemma 4's does:

    <bos><|turn>system\\n<|think|>\\n{system}
        <|tool>declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}<tool|><turn|>\\n
    <|turn>user\\n{text}<turn|>\\n
    <|turn>model\\n<|tool_call>call:NAME{key:<|"|>v<|"|>}<tool_call|>
        <|tool_response>response:NAME{value:<|"|>...<|"|>}<tool_response|>{answer}<turn|>\\n
    <|turn>model\\n<|channel>thought\\n<channel|>      (the generation prompt, thinking off)

(one line per turn; wrapped here)

Thinking is on with `enable_thinking` (the system turn opens with <|think|>); off, the generation prompt holds an
empty thought channel. A model turn with tool calls stays open for the tool responses that follow it, and the model
goes on in that turn (no new generation prompt after a tool response).
"""

from __future__ import annotations

import json
from pathlib import Path

TURN_START, TURN_END = "<|turn>", "<turn|>"
SPECIALS = [TURN_START, TURN_END, "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
            "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
STOP_TOKENS = (TURN_END, "<|tool_response>")  # as Gemma 4's generation_config: the model stops after its calls

TEMPLATE = r"""
{%- macro value(v) -%}
  {%- if v is string -%}<|"|>{{ v }}<|"|>
  {%- elif v is boolean -%}{{ 'true' if v else 'false' }}
  {%- elif v is none -%}null
  {%- elif v is mapping -%}
    {{- '{' -}}{%- for k, x in v | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}{{- '}' -}}
  {%- elif v is iterable -%}
    {{- '[' -}}{%- for x in v -%}{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}{{- ']' -}}
  {%- else -%}{{ v }}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set has_system = messages and messages[0]['role'] == 'system' -%}
{%- if enable_thinking or tools or has_system -%}
  <|turn>system{{ '\n' }}
  {%- if enable_thinking %}<|think|>{{ '\n' }}{% endif -%}
  {%- if has_system %}{{ messages[0]['content'] | trim }}{% endif -%}
  {%- for tool in tools or [] -%}
    <|tool>declaration:{{ tool['function']['name'] }}{{ '{' }}
    {{- 'description:' }}{{ value(tool['function']['description'] or '') }}
    {%- if tool['function']['parameters'] %},parameters:{{ value(tool['function']['parameters']) }}{% endif -%}
    {{ '}' }}<tool|>
  {%- endfor -%}
  <turn|>{{ '\n' }}
{%- endif -%}
{%- set ns = namespace(open=false, calls=[]) -%}
{%- for m in messages -%}
  {%- if loop.first and has_system -%}
  {%- elif m['role'] == 'tool' -%}
    {%- set call = namespace(name=m['name'] or 'unknown') -%}
    {%- for c in ns.calls if c['id'] == m['tool_call_id'] %}{% set call.name = c['function']['name'] %}{% endfor -%}
    <|tool_response>response:{{ call.name }}{{ '{' }}value:{{ value(m['content']) }}{{ '}' }}<tool_response|>
  {%- elif m['role'] == 'assistant' -%}
    {%- if not ns.open %}<|turn>model{{ '\n' }}{% endif -%}
    {%- for c in m['tool_calls'] or [] -%}
      <|tool_call>call:{{ c['function']['name'] }}{{ '{' }}
      {%- for k, x in c['function']['arguments'] | dictsort -%}
        {{ k }}:{{ value(x) }}{{ ',' if not loop.last }}
      {%- endfor -%}
      {{ '}' }}<tool_call|>
    {%- endfor -%}
    {{- m['content'] | trim -}}
    {%- if m['tool_calls'] -%}
      {%- set ns.open = true -%}{%- set ns.calls = m['tool_calls'] -%}
    {%- else -%}
      <turn|>{{ '\n' }}{%- set ns.open = false -%}
    {%- endif -%}
  {%- else -%}
    {%- if ns.open %}<turn|>{{ '\n' }}{% set ns.open = false %}{% endif -%}
    <|turn>{{ m['role'] }}{{ '\n' }}{{ m['content'] | trim }}<turn|>{{ '\n' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}
  <|turn>model{{ '\n' }}{% if not enable_thinking %}<|channel>thought{{ '\n' }}<channel|>{% endif -%}
{%- endif -%}
"""


def write_gemma4_tokenizer(directory: Path) -> Path:
    """tokenizer.json (the demo byte-level BPE + SPECIALS as special tokens), tokenizer_config.json and
    chat_template.jinja in `directory`."""
    from tokenizers import AddedToken, Tokenizer

    from gemma4_mtp_jax.weights.demo import _tokenizer_json

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(_tokenizer_json())
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                                 "pad_token": "<pad>", "unk_token": "<unk>"}))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory
