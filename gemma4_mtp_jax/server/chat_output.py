"""A chat choice's output -> `content`, `reasoning_content` and `tool_calls`: the output parsers of the served model
(`--tool-call-parser`, `--reasoning-parser`) and the per-choice object that runs them on its text deltas.

The parsers read markers that are special tokens (`<|tool_call>`, `<|"|>`, `<|channel>`, ...), whose text the
detokenizer usually drops: a request that uses a parser has its output detokenized with exactly those special tokens
shown (`OutputParsers.for_request`), every other special token still hidden.

A request's output is parsed for tool calls when the model has a tool-call parser and the request renders tools
(`tools` given and `tool_choice` not "none"), and for reasoning whenever the model has a reasoning parser.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Union

from gemma4_mtp_jax.server import reasoning, tool_calls
from gemma4_mtp_jax.server.reasoning import ReasoningParser
from gemma4_mtp_jax.server.tool_calls import ToolCallDelta, ToolCallParser

log = logging.getLogger(__name__)

PARSER_CHOICES = ("auto", "gemma4", "none")  # the flags' values; "auto": gemma4 when the tokenizer has its markers


def _marker_ids(tokenizer: Any, markers: tuple[str, ...]) -> frozenset[int] | None:
    """The ids of `markers` when every one is a special token of `tokenizer`, else None."""
    if tokenizer is None:
        return None
    ids = [tokenizer.tokenizer.token_to_id(m) for m in markers]
    if any(i is None or i not in tokenizer.special_ids for i in ids):
        return None
    return frozenset(ids)


@dataclasses.dataclass(frozen=True)
class OutputParsers:
    """The parsers of the served model: the special tokens each reads (None: that parser is off)."""

    tool_call_ids: frozenset[int] | None = None
    reasoning_ids: frozenset[int] | None = None

    @classmethod
    def select(cls, tokenizer: Any, tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> OutputParsers:
        """The parsers the flags ask for; "auto" turns one on when the tokenizer has its markers as special tokens.
        Raises ValueError when a parser is asked for by name and the tokenizer lacks its markers."""
        found = {}
        for flag, value, markers in (("--tool-call-parser", tool_call_parser, tool_calls.MARKERS),
                                     ("--reasoning-parser", reasoning_parser, reasoning.MARKERS)):
            if value not in PARSER_CHOICES:
                raise ValueError(f"{flag} must be one of {', '.join(PARSER_CHOICES)}, got {value!r}")
            ids = None if value == "none" else _marker_ids(tokenizer, markers)
            if value == "gemma4" and ids is None:
                raise ValueError(f"{flag} gemma4: the tokenizer lacks the special tokens {' '.join(markers)}")
            found[flag] = ids
        return cls(found["--tool-call-parser"], found["--reasoning-parser"])

    def for_request(self, params: Any) -> tuple[ChatOutputParser | None, frozenset[int]]:
        """The request's output parser (None: its text is content as it is) and the special tokens to show."""
        tools = self.tool_call_ids is not None and params.kind == "chat" and bool(params.tools)
        thinking = self.reasoning_ids is not None and params.kind == "chat"
        if not tools and not thinking:
            return None, frozenset()
        shown = (self.tool_call_ids if tools else frozenset()) | (self.reasoning_ids if thinking else frozenset())
        parser = ChatOutputParser(thinking, tools, None if params.parallel_tool_calls else 1)
        return parser, shown


Event = Union[tuple[str, str], ToolCallDelta]  # ("content" | "reasoning", text), or a piece of a tool call


class ChatOutputParser:
    """One choice's output text, delta by delta -> OpenAI chat deltas ({"content"}, {"reasoning_content"},
    {"tool_calls"}) in the order the model wrote them; `message` gives a whole output's message fields."""

    def __init__(self, reasoning: bool, tools: bool, max_calls: int | None = None):
        self.reasoning = reasoning
        self._reasoning = ReasoningParser() if reasoning else None
        self._tools = ToolCallParser(max_calls) if tools else None

    @property
    def num_tool_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def push(self, text: str) -> list[dict[str, Any]]:
        return _deltas(self._events(text, final=False))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas held back until the output's end."""
        return _deltas(self._events("", final=True))

    def message(self, text: str) -> dict[str, Any]:
        """A whole output as a chat message's fields (this parser must be fresh)."""
        events = self._events(text, final=True)
        content = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == reasoning.CONTENT)
        thought = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == reasoning.REASONING)
        _, calls = tool_calls.merge_events([e for e in events if isinstance(e, ToolCallDelta)])
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning:
            msg["reasoning_content"] = thought or None
        if calls:
            msg["tool_calls"] = calls
        return msg

    def _events(self, text: str, final: bool) -> list[Event]:
        try:
            return self._parse(text, final)
        except Exception:  # a parser bug fails no request: the rest of the output is content as it stands
            log.exception("the chat output parsers failed; the rest of this output is plain content")
            self._reasoning = self._tools = None
            return [(reasoning.CONTENT, text)] if text else []

    def _parse(self, text: str, final: bool) -> list[Event]:
        if self._reasoning is None:
            pieces = [(reasoning.CONTENT, text)] if text else []
        else:
            pieces = self._reasoning.push(text) + (self._reasoning.finish() if final else [])
        out: list[Event] = []
        for kind, piece in pieces:
            if kind == reasoning.CONTENT and self._tools is not None:
                out += [(kind, e) if isinstance(e, str) else e for e in self._tools.push(piece)]
            else:
                out.append((kind, piece))
        if final and self._tools is not None:
            out += [(reasoning.CONTENT, e) if isinstance(e, str) else e for e in self._tools.finish()]
        return out


_DELTA_FIELD = {reasoning.CONTENT: "content", reasoning.REASONING: "reasoning_content"}


def _deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Events as chat deltas, neighbours of one kind merged."""
    out: list[dict[str, Any]] = []
    for e in events:
        last = out[-1] if out else {}
        if isinstance(e, ToolCallDelta):
            if "tool_calls" in last:
                last["tool_calls"].append(e.openai())
            else:
                out.append({"tool_calls": [e.openai()]})
        else:
            field = _DELTA_FIELD[e[0]]
            if field in last:
                last[field] += e[1]
            elif e[1]:
                out.append({field: e[1]})
    return out
