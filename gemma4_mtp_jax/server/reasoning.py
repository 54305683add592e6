"""Gemma 4's thinking in the model's output -> `reasoning_content`, apart from `content`, whole or streamed.

With thinking on (the chat template's `enable_thinking`, from the request's `chat_template_kwargs`), Gemma 4 writes
its thoughts in a channel before the answer:

    <|channel>thought
    ...the reasoning...<channel|>The answer.

`<|channel>` and `<channel|>` are special tokens; "thought\\n" is the channel's label, not part of the reasoning.
With thinking off the template ends the prompt with an empty channel and the model answers directly. Text outside
a channel is content; a channel left open at the end of the output (max_tokens) is reasoning.

`ReasoningParser.push` takes text deltas of any size and returns ("reasoning" | "content", text) pieces in order,
holding back only the tail that could still be the start of a marker or of the label; `split_reasoning` runs it over
a whole output, so streamed and whole responses agree.
"""

from __future__ import annotations

from gemma4_mtp_jax.server.tool_calls import partial_marker_suffix

CHANNEL_START = "<|channel>"
CHANNEL_END = "<channel|>"
THOUGHT_LABEL = "thought\n"
MARKERS = (CHANNEL_START, CHANNEL_END)

REASONING, CONTENT = "reasoning", "content"
_LABEL = "label"  # the parser's mode just after <|channel>, while the label may still come


class ReasoningParser:
    def __init__(self):
        self._buf = ""
        self._mode = CONTENT  # CONTENT, REASONING or _LABEL
        self._out: list[tuple[str, str]] = []

    def _emit(self, kind: str, text: str) -> None:
        if text:
            if self._out and self._out[-1][0] == kind:
                self._out[-1] = (kind, self._out[-1][1] + text)
            else:
                self._out.append((kind, text))

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        self._run(final=False)
        out, self._out = self._out, []
        return out

    def finish(self) -> list[tuple[str, str]]:
        self._run(final=True)
        self._emit(CONTENT if self._mode == CONTENT else REASONING, self._buf)
        self._buf = ""
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        buf, i = self._buf, 0
        while i < len(buf):
            if self._mode == _LABEL:
                rest = buf[i:]
                if rest.startswith(THOUGHT_LABEL):
                    i += len(THOUGHT_LABEL)
                elif THOUGHT_LABEL.startswith(rest) and not final:
                    break
                self._mode = REASONING
                continue
            kind = self._mode
            # In content a stray <channel|> is dropped; in reasoning a second <|channel> is (it opens nothing new).
            ends = [(j, m) for m in MARKERS if (j := buf.find(m, i)) >= 0]
            if not ends:
                keep = 0 if final else max(partial_marker_suffix(buf, i, m) for m in MARKERS)
                self._emit(kind, buf[i:len(buf) - keep])
                i = len(buf) - keep
                break
            j, marker = min(ends)
            self._emit(kind, buf[i:j])
            i = j + len(marker)
            if marker == CHANNEL_START and kind == CONTENT:
                self._mode = _LABEL
            elif marker == CHANNEL_END and kind == REASONING:
                self._mode = CONTENT
        self._buf = buf[i:]


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    p = ReasoningParser()
    parts = {REASONING: [], CONTENT: []}
    for kind, piece in p.push(text) + p.finish():
        parts[kind].append(piece)
    return "".join(parts[REASONING]), "".join(parts[CONTENT])
