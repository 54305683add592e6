"""Gemma 4's tool calls in the model's output -> OpenAI `tool_calls`, whole or streamed.

Gemma 4 writes a call as

    <|tool_call>call:get_weather{location:<|"|>Paris<|"|>,days:3,units:{metric:true},tags:[<|"|>a<|"|>]}<tool_call|>

`<|tool_call>`, `<tool_call|>` and the string quote `<|"|>` are special tokens (the detokenizer keeps their text for
this parser, see chat_output.py); keys are bare (or quoted), strings are quoted by `<|"|>` and hold any character
unescaped, numbers, `true`, `false` and `null` are bare, objects and arrays nest, and calls follow each other without
a separator. The model stops after the last one (`<|tool_response>` is a stop token of Gemma 4).

One parser serves both paths: `ToolCallParser.push` takes text deltas of any size (a speculative step brings several
tokens; a delta may end anywhere, inside a marker too) and returns what is now certain, in order: content text and
`ToolCallDelta`s. A call's id and name go out once its header `call:NAME{` is read; its arguments go out as a JSON
text written while the Gemma syntax is read (a transducer, not a re-parse of a growing prefix), so every fragment
sent is final and their concatenation is the arguments' JSON. `parse_tool_calls` runs the same parser over the whole
text, so a streamed response and a non-streamed one always agree, however the text was split.

What does not parse:
- text after `<|tool_call>` that is not a call header (`call:` and a name of [A-Za-z0-9_.-], up to 64 characters,
  then `{`) is content, the marker included;
- once a header is read the call is sent, so a call whose arguments stop parsing (a syntax error, the output cut
  by max_tokens, `<tool_call|>` before the braces close) keeps the arguments written so far, an incomplete JSON
  text that no JSON parser accepts (as OpenAI's own responses cut by max_tokens), so no client runs a half-read
  call; the rest of that call's text, up to its `<tool_call|>`, is dropped (as is text between a call's closing
  brace and its `<tool_call|>`).
The parser is lenient where the intent is plain: whitespace anywhere between tokens, trailing commas, quoted keys, a
bare word as a string value (`unit:celsius`), Python's `None` for null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import string
from typing import Any, Union

from gemma4_mtp_jax.engine.grammar import GrammarSpec
from gemma4_mtp_jax.server.structured import StructuredOutput

TOOL_CALL_START = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
STRING_DELIM = '<|"|>'
MARKERS = (TOOL_CALL_START, TOOL_CALL_END, STRING_DELIM)  # the special tokens this parser reads
MAX_NAME_CHARS = 64

_CALL_PREFIX = "call:"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_WS = frozenset(" \t\r\n")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": "true", "false": "false", "null": "null", "None": "null"}


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of the call at `index`: its first carries `id` and `name`; `arguments` continue its JSON text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """As an element of a chunk's `delta.tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Event = Union[str, ToolCallDelta]  # content text, or a piece of a call


# The parser's modes.
_TEXT, _HEADER, _ARGS, _AFTER_CALL, _SKIP = range(5)
# Inside the arguments: what the next token may be.
_KEY, _BARE_KEY, _QUOTED_KEY, _COLON, _VALUE, _STRING, _BARE, _AFTER_VALUE = range(8)


class _Break(Exception):
    """The arguments stop parsing here."""


class ToolCallParser:
    """Incremental: `push(text)` returns the content and call pieces now certain; `finish()` the rest."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # parallel_tool_calls=false: 1 (later calls are dropped)
        self.num_calls = 0
        self._buf = ""  # text not yet consumed
        self._mode = _TEXT
        self._events: list[Event] = []
        self._header = ""  # the text after <|tool_call> while in _HEADER
        self._stack: list[list] = []  # [bracket, a member was written] per open object / array
        self._sub = _KEY
        self._acc = ""  # a key or a bare value being read
        self._gap = ""  # whitespace after a call's closing brace, content unless <tool_call|> follows

    # ------------------------------------------------------------------ output
    def _content(self, text: str) -> None:
        if text:
            if self._events and isinstance(self._events[-1], str):
                self._events[-1] += text
            else:
                self._events.append(text)

    def _args(self, text: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and last.index == self.num_calls - 1:
            last.arguments += text
        else:
            self._events.append(ToolCallDelta(self.num_calls - 1, text))

    def _take(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ input
    def push(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The end of the output: what was held back, as what it turned out to be."""
        self._run(final=True)
        if self._mode == _HEADER:  # "<|tool_call>call:na" at the very end: not a call
            self._content(TOOL_CALL_START + self._header)
        elif self._mode == _AFTER_CALL:
            self._content(self._gap)
        elif self._mode == _TEXT:
            self._content(self._buf)
        self._buf, self._mode = "", _TEXT
        return self._take()

    def _marker_at(self, i: int, final: bool) -> str | None:
        """The marker starting at buf[i], "" when the text so far could still become one (wait), else None."""
        buf = self._buf
        if buf[i] != "<":
            return None
        for m in MARKERS:
            if buf.startswith(m, i):
                return m
        if not final and any(m.startswith(buf[i:]) for m in MARKERS):
            return ""
        return None

    def _run(self, final: bool) -> None:
        i = 0
        while i < len(self._buf):
            mode = self._mode
            if mode == _TEXT:
                i = self._text(i, final)
                if i < 0:
                    return
            elif mode == _HEADER:
                i = self._read_header(i)
            elif mode == _SKIP:
                i = self._skip(i, final)
                if i < 0:
                    return
            else:
                marker = self._marker_at(i, final)
                if marker == "":
                    break  # wait for the rest of a marker
                try:
                    i = self._after_call(i, marker) if mode == _AFTER_CALL else self._read_args(i, marker)
                except _Break:
                    self._mode = _SKIP
        self._buf = self._buf[i:]

    def _text(self, i: int, final: bool) -> int:
        """Content up to the next call; returns where to go on, or -1 when the rest is held back (buffer kept)."""
        buf = self._buf
        j = buf.find(TOOL_CALL_START, i)
        if j < 0:
            keep = 0 if final else partial_marker_suffix(buf, i, TOOL_CALL_START)
            self._content(buf[i:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return -1
        self._content(buf[i:j])
        self._mode, self._header = _HEADER, ""
        return j + len(TOOL_CALL_START)

    def _read_header(self, i: int) -> int:
        ch, h = self._buf[i], self._header
        if len(h) < len(_CALL_PREFIX):
            ok = ch == _CALL_PREFIX[len(h)]
        elif ch == "{" and len(h) > len(_CALL_PREFIX):
            self._start_call(h[len(_CALL_PREFIX):])
            return i + 1
        else:
            ok = ch in _NAME_CHARS and len(h) - len(_CALL_PREFIX) < MAX_NAME_CHARS
        if ok:
            self._header = h + ch
            return i + 1
        # Not a call: the marker is content, and what followed it is read again as text.
        self._content(TOOL_CALL_START)
        self._buf = h + self._buf[i:]
        self._mode = _TEXT
        return 0

    def _start_call(self, name: str) -> None:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            self._mode = _SKIP
            return
        self.num_calls += 1
        self._events.append(ToolCallDelta(self.num_calls - 1, "{", new_tool_call_id(), name))
        self._mode, self._stack, self._sub = _ARGS, [["{", False]], _KEY

    def _skip(self, i: int, final: bool) -> int:
        """Drop the rest of a call that stopped parsing (or one past max_calls), up to its end marker."""
        buf = self._buf
        ends = [j for j in (buf.find(TOOL_CALL_END, i), buf.find(TOOL_CALL_START, i)) if j >= 0]
        if not ends:
            keep = 0 if final else max(partial_marker_suffix(buf, i, TOOL_CALL_END),
                                       partial_marker_suffix(buf, i, TOOL_CALL_START))
            self._buf = buf[len(buf) - keep:]
            return -1
        j = min(ends)
        self._mode = _TEXT
        return j + len(TOOL_CALL_END) if buf.startswith(TOOL_CALL_END, j) else j

    def _after_call(self, i: int, marker: str | None) -> int:
        """After a call's closing brace: its end marker (whitespace before it dropped); a new call without one (the
        whitespace is content); anything else is the call's too, dropped up to its end marker."""
        if marker == TOOL_CALL_END:
            self._mode, self._gap = _TEXT, ""
            return i + len(marker)
        ch = self._buf[i]
        if ch in _WS:
            self._gap += ch
            return i + 1
        if marker == TOOL_CALL_START:
            self._content(self._gap)
            self._mode = _TEXT
        else:
            self._mode = _SKIP
        self._gap = ""
        return i

    # ------------------------------------------------------------------ the arguments: Gemma syntax -> JSON text
    def _read_args(self, i: int, marker: str | None) -> int:
        if marker == TOOL_CALL_END:  # the call ends before its braces close: arguments stay incomplete
            self._mode = _TEXT
            return i + len(marker)
        sub, buf = self._sub, self._buf
        if marker == TOOL_CALL_START and sub != _STRING and sub != _QUOTED_KEY:
            raise _Break  # a new call where this one's arguments go on: this one stops here
        if sub == _STRING:
            if marker == STRING_DELIM:
                self._args('"')
                self._value_done()
                return i + len(marker)
            j = buf.find("<", i + 1)
            j = len(buf) if j < 0 else j
            self._args(json.dumps(buf[i:j], ensure_ascii=False)[1:-1])
            return j
        if sub == _QUOTED_KEY:
            if marker == STRING_DELIM:
                self._sub = _COLON
                return i + len(marker)
            self._acc += buf[i]
            return i + 1
        ch = buf[i]
        if marker is None and ch in _WS and sub != _BARE_KEY and sub != _BARE:
            return i + 1
        top = self._stack[-1]
        if sub == _KEY:
            if marker == STRING_DELIM:
                self._sub, self._acc = _QUOTED_KEY, ""
                return i + len(marker)
            if ch == "}":
                self._close()
            elif ch == ",":
                pass
            elif ch in "{[]:" or marker is not None:
                raise _Break
            else:
                self._sub, self._acc = _BARE_KEY, ch
            return i + 1
        if sub == _BARE_KEY:
            if ch == ":":
                self._key()
            elif ch in "{}[],\"" or marker is not None:
                raise _Break
            else:
                self._acc += ch
            return i + 1
        if sub == _COLON:
            if ch != ":":
                raise _Break
            self._key()
            return i + 1
        if sub == _VALUE:
            if ch == "]" and top[0] == "[":
                self._close()
                return i + 1
            if ch in ",}]":
                raise _Break
            self._member()
            if marker == STRING_DELIM:
                self._args('"')
                self._sub = _STRING
                return i + len(marker)
            if ch in "{[":
                self._args(ch)
                self._stack.append([ch, False])
                self._sub = _KEY if ch == "{" else _VALUE
            else:
                self._sub, self._acc = _BARE, ch
            return i + 1
        if sub == _BARE:
            if ch in ",}]" or marker == STRING_DELIM:
                if marker is not None:
                    raise _Break
                self._args(_literal(self._acc.strip()))
                self._value_done()
                return i  # the delimiter is read again after the value
            self._acc += ch
            return i + 1
        # _AFTER_VALUE
        if ch == ",":
            self._sub = _KEY if top[0] == "{" else _VALUE
        elif (ch == "}" and top[0] == "{") or (ch == "]" and top[0] == "["):
            self._close()
        else:
            raise _Break
        return i + 1

    def _member(self) -> None:
        """A new member of the open object or array: the comma before it."""
        top = self._stack[-1]
        if top[0] == "[":
            if top[1]:
                self._args(",")
            top[1] = True

    def _key(self) -> None:
        key = self._acc.strip() if self._sub == _BARE_KEY else self._acc
        if not key and self._sub == _BARE_KEY:
            raise _Break
        top = self._stack[-1]
        self._args(("," if top[1] else "") + json.dumps(key, ensure_ascii=False) + ":")
        top[1] = True
        self._sub, self._acc = _VALUE, ""

    def _close(self) -> None:
        bracket = self._stack.pop()[0]
        self._args("}" if bracket == "{" else "]")
        if self._stack:
            self._value_done()
        else:
            self._mode, self._gap = _AFTER_CALL, ""

    def _value_done(self) -> None:
        self._sub, self._acc = _AFTER_VALUE, ""


def _literal(text: str) -> str:
    """A bare value as JSON: a number or literal as it stands, a number in another spelling normalized, any other
    word as a string."""
    if text in _LITERALS:
        return _LITERALS[text]
    if _JSON_NUMBER.fullmatch(text):
        return text
    try:
        value: float | int = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            return json.dumps(text, ensure_ascii=False)
    if not math.isfinite(value):
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(value)


def partial_marker_suffix(buf: str, start: int, marker: str) -> int:
    """The length of the tail of buf[start:] that is a proper prefix of `marker` (held back: the rest of the marker
    may come with the next delta), 0 if none. Every marker has one '<', its first character, so such a tail starts
    at the last '<' of the text."""
    j = buf.rfind("<", max(start, len(buf) - len(marker) + 1))
    return len(buf) - j if j >= 0 and marker.startswith(buf[j:]) else 0


def merge_events(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    """Content and complete OpenAI `tool_calls` from a parser's events (all of one output, in order)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.id is not None:
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": e.arguments}})
        else:
            calls[e.index]["function"]["arguments"] += e.arguments
    return "".join(content), calls


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output."""
    p = ToolCallParser(max_calls)
    return merge_events(p.push(text) + p.finish())


# ---------------------------------------------------------------------------------------------------------- grammar
# Gemma 4's call syntax as a Lark grammar in llguidance's dialect (special tokens written as <|name>), for the
# grammar engine to force calls: tool_choice "required" (one call or more, to the tools given) and a named function
# (exactly that one). An optional thought channel may come first. Values follow each top-level parameter's JSON
# Schema type where it names one (string, with its enum; number; integer; boolean; null; array; object), and are any
# Gemma value elsewhere; which parameters come, and in which order, is the model's.
_GRAMMAR_COMMON = r"""
thought: <|channel> ANY <channel|>
members: pair ("," pair)*
pair: key ":" value
key: KEY | <|"|> ANY <|"|>
value: string | NUMBER | "true" | "false" | "null" | object | array
object: "{" members? "}"
array: "[" (value ("," value)*)? "]"
string: <|"|> ANY <|"|>
KEY: /[^:,{}\[\]<>"\s]+/
ANY: /(?s:.*)/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
INTEGER: /-?(0|[1-9][0-9]*)/
"""
_TYPE_RULES = {"string": "string", "number": "NUMBER", "integer": "INTEGER", "boolean": '("true" | "false")',
               "null": '"null"', "array": "array", "object": "object"}


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # llguidance's Lark reads JSON's escapes in string literals


def _typed_value(schema: Any) -> str:
    """The Lark expression of a parameter's value: by its schema's type (and a string enum), else any value."""
    if not isinstance(schema, dict):
        return "value"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) and e for e in enum):
        return '<|"|> (' + " | ".join(_lark_literal(e) for e in enum) + ') <|"|>'
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or not all(t in _TYPE_RULES for t in types):
        return "value"
    return "(" + " | ".join(_TYPE_RULES[t] for t in types) + ")"


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's) of an output that is only tool calls: to `name` exactly once, or to any of
    `tools` (the request's validated OpenAI list), once or more (`parallel`) or once."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        f = tool["function"]
        if name is not None and f["name"] != name:
            continue
        props = (f.get("parameters") or {}).get("properties")
        if isinstance(props, dict) and props and all(isinstance(k, str) and k for k in props):
            pairs = " | ".join(f"{_lark_literal(k)} \":\" {_typed_value(s)}" for k, s in props.items())
            rules.append(f"pair{i}: {pairs}")
            members = f"pair{i} (\",\" pair{i})*"
        else:
            members = "members"
        rules.append(f'call{i}: <|tool_call> "call:" {_lark_literal(f["name"])} "{{" ({members})? "}}" <tool_call|>')
        calls.append(f"call{i}")
    if not calls:
        raise ValueError(f"no tool named {name!r}")
    start = "start: thought? (" + " | ".join(calls) + ")" + ("+" if parallel and name is None else "")
    return "\n".join([start, *rules]) + _GRAMMAR_COMMON


def forced_tool_calls(tools: list[dict[str, Any]], tool_choice: str, parallel: bool = True) -> StructuredOutput:
    """The output constraint of tool_choice "required" or a named function (GenerationParams.tool_choice), for
    the grammar engine like a response_format's."""
    name = None if tool_choice == "required" else tool_choice
    return StructuredOutput(GrammarSpec("lark", tool_call_grammar(tools, name, parallel)), "tool_choice")
