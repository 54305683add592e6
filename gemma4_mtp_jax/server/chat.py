"""The checkpoint's tokenizer and chat template.

The chat template comes from the checkpoint's `chat_template.jinja` file, or `chat_template.json`, or the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates: "default" is used). It
is rendered with jinja2 in a sandbox, with the special tokens of `tokenizer_config.json` (`bos_token`, ...) and
`add_generation_prompt=True`, as Hugging Face tokenizers render it.

A chat's special tokens are the template's alone: the text of a special token inside a message's content
(`<end_of_turn>`, `<start_of_turn>model`) is tokenized as the plain text it is, never as the control token, so that
a client cannot forge turns (`TextTokenizer.encode_chat`). A completions prompt is the client's raw model input:
there the text of a special token is the special token (`TextTokenizer.encode`), as in vLLM and Hugging Face.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from pathlib import Path
from typing import Any

from gemma4_mtp_jax.server.errors import APIError, bad_request

log = logging.getLogger(__name__)

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# The variables the server gives every render: a request's chat_template_kwargs may not set them.
TEMPLATE_GLOBALS = frozenset({"messages", "tools", "add_generation_prompt", "raise_exception", "strftime_now",
                              *_SPECIAL_KEYS})


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # older tokenizer_config.json files store AddedToken dicts
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("could not read %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


class TemplateRenderError(Exception):
    pass


def literal_pattern(words) -> re.Pattern:
    """A regex of `words` that matches, at the leftmost position, the longest of them there (as a tokenizer matches
    its added tokens). A trie, not an alternation: the time per position does not grow with the number of words."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict) -> str:
        alternatives = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word first

    return re.compile(pattern(trie) if trie else "(?!)")


# Placeholders for special-token text in message contents: Unicode's supplementary private use area B, which no
# template filter changes (not whitespace, no case) and no tokenizer splits or normalizes away.
_PLACEHOLDERS = range(0x100000, 0x10FFFE)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str = "<string>"):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateRenderError(message)

        def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.origin = origin
        self.source = source
        self.special_tokens = special_tokens
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template does not parse: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat as text, as Hugging Face renders it: `tools` (None: none) as the template's `tools`, and the
        request's `chat_template_kwargs` as more variables (protocol.py keeps them off the names set here)."""
        import jinja2

        try:
            return self._template.render(**self.special_tokens, **(template_kwargs or {}), messages=messages,
                                         tools=tools, add_generation_prompt=add_generation_prompt)
        except TemplateRenderError as e:
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                RecursionError) as e:
            raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                              "messages") from None


class TextTokenizer:
    """A checkpoint's tokenizer (`tokenizer.json`), its special tokens and its chat template (if any)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        d = Path(directory)
        self.directory = d
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        # The same tokenizer reading the text of special tokens as plain text (a second one: the switch is the
        # tokenizer's state, and encodings run in several threads at once).
        self._literal = Tokenizer.from_file(str(d / "tokenizer.json"))
        self._literal.encode_special_tokens = True
        added = self.tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._special_text = literal_pattern(t.content for t in added.values() if t.special and t.content)
        cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.chat_template = self._load_template(d, cfg)
        # Characters a rendered chat holds besides the messages' own: placeholders must be none of them.
        self._template_chars = frozenset("".join([self.chat_template.source if self.chat_template else "",
                                                  *self.special_tokens.values()]))

    def _load_template(self, d: Path, cfg: dict) -> ChatTemplate | None:
        source, origin = None, None
        if (d / "chat_template.jinja").is_file():
            source, origin = (d / "chat_template.jinja").read_text(), str(d / "chat_template.jinja")
        elif (d / "chat_template.json").is_file():
            source, origin = _read_json(d / "chat_template.json").get("chat_template"), str(d / "chat_template.json")
        elif cfg.get("chat_template") is not None:
            source, origin = cfg["chat_template"], str(d / "tokenizer_config.json")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return None
        return ChatTemplate(source, self.special_tokens, origin)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`, the text of a special token included (`<end_of_turn>` is the control token: a
        completions prompt is raw model input). With `special`, the tokenizer's special tokens (BOS) are added
        unless the text already starts with the BOS token (as a rendered chat template does)."""
        add_special = special and not (self.bos_token and text.startswith(self.bos_token))
        return self.tokenizer.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token: int) -> str | None:
        """The vocabulary's piece for `token` (`▁the`, `<0xE2>`), None for an id it doesn't have."""
        return self.tokenizer.id_to_token(token)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        if self.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages",
                           code="no_chat_template")
        return self.chat_template.render(messages, True, tools, template_kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, marks: dict[str, int] | None = None) -> list[int]:
        """Token ids of the rendered chat, where only the template's special tokens are control tokens: the text of
        a special token inside any string the client sent (contents, tool calls' names and arguments, tool
        results, the tool list, template variables) is tokenized as plain text. A chat without such text gets
        exactly `encode(render_chat(messages, tools, template_kwargs))`.

        Such text is swapped for a placeholder character before rendering (so every template filter, `trim`
        included, sees the string as before), and each stretch of the rendered text between two of the template's
        special tokens that holds a placeholder is tokenized again with the text put back, special tokens read as
        plain text. The tokenizer splits a text at its added tokens and tokenizes the pieces apart, so the other
        stretches keep their tokens.

        `marks`: characters the server put in the contents for media parts (server/media.py), each to become the
        special token of the id it maps to (the model's image or audio token)."""
        (messages, tools, template_kwargs), restore = self._escape_special_text((messages, tools, template_kwargs))
        text = self.render_chat(messages, tools, template_kwargs)
        for mark, token in (marks or {}).items():
            piece = self.id_to_token(token)
            if token not in self.special_ids or piece is None:
                raise bad_request(f"the tokenizer has no special token of id {token} to stand for a media part",
                                  "messages")
            text = text.replace(mark, piece)
        if not restore:
            return self.encode(text)
        placeholder = re.compile("[" + "".join(map(chr, restore)) + "]")
        enc = self.tokenizer.encode(text, add_special_tokens=not (self.bos_token and text.startswith(self.bos_token)))
        ids, offsets, added = enc.ids, enc.offsets, enc.special_tokens_mask
        lo, hi = 0, len(ids)  # the tokens of the text, between those the post-processor added (a BOS)
        while lo < hi and added[lo]:
            lo += 1
        while hi > lo and added[hi - 1]:
            hi -= 1
        out = ids[:lo]
        start, first = 0, lo  # the stretch of text since the last special token, and its first token

        def stretch(end_char: int, end_token: int) -> None:
            piece = text[start:end_char]
            if placeholder.search(piece):
                out.extend(self._literal.encode(piece.translate(restore), add_special_tokens=False).ids)
            else:
                out.extend(ids[first:end_token])

        for i in range(lo, hi):
            if ids[i] in self.special_ids:
                stretch(offsets[i][0], i)
                out.append(ids[i])
                start, first = offsets[i][1], i + 1
        stretch(len(text), hi)
        return out + ids[hi:]

    def _escape_special_text(self, value: Any) -> tuple[Any, dict[int, str]]:
        """`value` (JSON-like: dicts, lists, strings, ...) with each special token's text in its strings and keys
        replaced by a placeholder character, and the map back ({} when no string holds any: `value` as it is)."""
        strings = list(_strings(value))
        if not any(self._special_text.search(s) for s in strings):
            return value, {}
        taken = set(self._template_chars).union(*strings)
        free = (chr(c) for c in _PLACEHOLDERS if chr(c) not in taken)
        placeholders: dict[str, str] = {}

        def swap(m: re.Match) -> str:
            text = m.group()
            if text not in placeholders:
                p = next(free, None)
                if p is None:
                    raise bad_request("the messages use every character of Unicode's private use area B, which the "
                                      "server needs to read special-token text in them as text", "messages")
                placeholders[text] = p
            return placeholders[text]

        def escape(v: Any) -> Any:
            if isinstance(v, str):
                return self._special_text.sub(swap, v)
            if isinstance(v, dict):
                return {escape(k): escape(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return type(v)(escape(x) for x in v)
            return v

        return escape(value), {ord(p): text for text, p in placeholders.items()}


def _strings(value: Any):
    """Every string in a JSON-like value, keys included (iteratively: a value may nest as deep as JSON allows)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
