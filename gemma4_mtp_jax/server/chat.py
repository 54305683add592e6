"""The checkpoint's tokenizer and chat template.

The chat template comes from the checkpoint's `chat_template.jinja` file, or `chat_template.json`, or the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates: "default" is used). It
is rendered with jinja2 in a sandbox, with the special tokens of `tokenizer_config.json` (`bos_token`, ...) and
`add_generation_prompt=True`, as Hugging Face tokenizers render it.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

from gemma4_mtp_jax.server.errors import APIError, bad_request

log = logging.getLogger(__name__)

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


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
        self.special_tokens = special_tokens
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template does not parse: {e}") from None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except TemplateRenderError as e:
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                              "messages") from None


class TextTokenizer:
    """A checkpoint's tokenizer (`tokenizer.json`), its special tokens and its chat template (if any)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        d = Path(directory)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.chat_template = self._load_template(d, cfg)

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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the tokenizer's special tokens (BOS) are added unless the text already starts with
        the BOS token (as a rendered chat template does)."""
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return self.tokenizer.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if self.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages",
                           code="no_chat_template")
        return self.chat_template.render(messages, add_generation_prompt=True)
