"""Request validation for the OpenAI-compatible endpoints: JSON bodies in, `GenerationParams` out, or an APIError.

Every field the server understands is checked for type and range; a parameter the server does not implement is
refused with a 400 that names it when it asks for a behaviour we can't give (n > 1, logprobs, tools, ...), and
accepted when it carries its default value (clients often send `"n": 1` or `"logprobs": null`). A field the
OpenAI API doesn't know is refused too, as OpenAI itself does.

Numbers are checked against what the engine holds (int32 counts and top_k, float32 temperatures), and no string
with a lone UTF-16 surrogate gets past `parse_json` (JSON can spell one, "\\ud800"; the tokenizer, the logs and
UTF-8 output cannot take it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable

from gemma4_mtp_jax.model.sampling import FLOAT32_MAX, INT32_MAX
from gemma4_mtp_jax.server.errors import bad_request

MAX_STOP_STRINGS = 16
# A chat's messages at most, by default (--max-messages): each costs the template a few tokens, so 4096 fill ~20k
# tokens with turn markers alone; long agent sessions stay well below.
DEFAULT_MAX_MESSAGES = 4096
MAX_STOP_CHARS = 256
# Below this, sampling is greedy (as in vLLM): the logits divided by a much smaller temperature overflow float32,
# and at this one sampling already is argmax but for exact ties.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass
class GenerationParams:
    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, str]] | None = None  # chat: [{"role", "content"}] with text content
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float | None = None  # None: the checkpoint's default
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    seed: int | None = None  # None: a fresh random seed
    stop: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # extension (as in vLLM): token ids of the prompt and of each choice / chunk
    ignore_eos: bool = False  # extension (as in vLLM): generate max_tokens whatever the model's EOS (benchmarks)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.") from None
    if not text.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {_type_name(body)}.")
    if _SURROGATE_ESCAPE.search(text):  # only a \\u escape can make a lone surrogate: valid UTF-8 can't
        _check_surrogates(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_surrogates(body: dict) -> None:
    """400 naming the first string (value or key) with a lone surrogate, by its path in the body."""
    for k in body:
        if _has_surrogate(k):
            raise bad_request(f"the field name {json.dumps(k)} contains a lone UTF-16 surrogate; names and strings "
                              f"must be valid Unicode", None, "invalid_string")
    stack: list[tuple[Any, str, str]] = [(v, k, k) for k, v in reversed(body.items())]  # (value, path, field)
    while stack:
        v, path, param = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                raise bad_request(f"'{path}' contains a lone UTF-16 surrogate; strings must be valid Unicode",
                                  param, "invalid_string")
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]", param) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, dict):
            for k in v:
                if _has_surrogate(k):
                    raise bad_request(f"'{path}' has a field name with a lone UTF-16 surrogate", param,
                                      "invalid_string")
            stack.extend((x, f"{path}.{k}", param) for k, x in reversed(v.items()))


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def show_json(v: Any, limit: int = 64) -> str:
    """A value as JSON, cut to `limit` characters, for error messages."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------- fields
def _get_int(body: dict, key: str, lo: int | None = None, hi: int | None = INT32_MAX) -> int | None:
    """An integer field (or None); the default upper bound is int32's, what the engine's arrays hold."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise bad_request(f"'{key}' must be an integer, got {_type_name(v)}: {show_json(v)}", key)
    v = int(v)
    if lo is not None and v < lo:
        raise bad_request(f"'{key}' must be >= {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise bad_request(f"'{key}' must be <= {hi}, got {v}", key)
    return v


def _get_float(body: dict, key: str, check: Callable[[float], bool], rule: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{key}' must be a number, got {_type_name(v)}", key)
    v = float(v)
    if not math.isfinite(v) or not check(v):
        raise bad_request(f"'{key}' must be {rule}, got {v}", key)
    return v


def _get_bool(body: dict, key: str, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {_type_name(v)}", param or key)
    return v


def _get_str(body: dict, key: str, param: str | None = None) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{key}' must be a string, got {_type_name(v)}", param or key)
    return v


def _get_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    for s in items:
        if not s:
            raise bad_request("'stop' strings must not be empty", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"'stop' strings may be at most {MAX_STOP_CHARS} characters long", "stop")
    return list(dict.fromkeys(items))


# ------------------------------------------------------------------------------------- parameters we do not offer
def _is_default(*defaults: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == d and type(v) is type(d) for d in defaults)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


_UNSUPPORTED_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_is_default(1), "only n=1 is supported"),
    "presence_penalty": (_is_default(0, 0.0), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (_is_default(0, 0.0), "frequency_penalty is not supported (only 0)"),
    "logit_bias": (_empty, "logit_bias is not supported"),
}
_UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED_COMMON,
    "logprobs": (lambda v: v is None, "logprobs are not supported"),
    "echo": (_is_default(False), "echo is not supported"),
    "best_of": (_is_default(1), "best_of is not supported (only 1)"),
    "suffix": (_is_default(""), "suffix is not supported"),
}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "logprobs": (_is_default(False), "logprobs are not supported"),
    "top_logprobs": (_is_default(0), "top_logprobs is not supported"),
    "tools": (_empty, "tools (function calling) are not supported"),
    "tool_choice": (_is_default("none", "auto"), "tool_choice is not supported"),
    "functions": (_empty, "functions (function calling) are not supported"),
    "function_call": (_is_default("none", "auto"), "function_call is not supported"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "parallel_tool_calls must be a boolean"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "only response_format {\"type\": \"text\"} is "
                                                                        "supported"),
    "store": (_is_default(False), "store is not supported"),
    "audio": (_empty, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (_empty, "predicted outputs are not supported"),
}
_IGNORED = {"user", "metadata", "service_tier"}  # accepted and ignored (they change nothing about the output)

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "return_token_ids", "ignore_eos"}
_COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_UNSUPPORTED_COMPLETION) | _IGNORED
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_UNSUPPORTED_CHAT) | _IGNORED


def _check_fields(body: dict, known: set[str], unsupported: dict) -> None:
    for key in body:
        if key not in known:
            name = key if len(key) <= 64 else key[:61] + "..."
            raise bad_request(f"Unrecognized request argument supplied: '{name}'", name, "unrecognized_argument")
    for key, (ok, why) in unsupported.items():
        if key in body and not ok(body[key]):
            raise bad_request(f"'{key}' = {show_json(body[key])}: {why}", key, "unsupported_parameter")


def _check_ignored(body: dict) -> None:
    """The fields we accept and ignore still have to be what OpenAI documents."""
    _get_str(body, "user")
    _get_str(body, "service_tier")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad_request("'metadata' must be an object of string values", "metadata")


def _common(body: dict, kind: str) -> GenerationParams:
    model = _get_str(body, "model")
    _check_ignored(body)
    stream = _get_bool(body, "stream") or False
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad_request("'stream_options' must be an object with 'include_usage'", "stream_options")
        include_usage = bool(_get_bool(opts, "include_usage", "stream_options"))
        _get_bool(opts, "continuous_usage_stats", "stream_options")
    top_k = _get_int(body, "top_k", lo=-1)
    seed = _get_int(body, "seed", lo=-(2**63), hi=2**64 - 1)
    temperature = _get_float(body, "temperature", lambda v: 0 <= v <= FLOAT32_MAX,
                             f"a number in [0, {FLOAT32_MAX:.4g}]")
    if temperature is not None and temperature < MIN_TEMPERATURE:
        temperature = 0.0
    return GenerationParams(
        kind=kind,
        model=model,
        max_tokens=_get_int(body, "max_tokens", lo=1),
        temperature=temperature,
        top_p=_get_float(body, "top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=None if top_k is None else max(top_k, 0),  # -1 (vLLM) and 0 both mean "off"
        seed=None if seed is None else seed % 2**32,
        stop=_get_stop(body),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_get_bool(body, "return_token_ids") or False,
        ignore_eos=_get_bool(body, "ignore_eos") or False,
    )


def parse_completion(body: dict) -> GenerationParams:
    _check_fields(body, _COMPLETION_FIELDS, _UNSUPPORTED_COMPLETION)
    p = _common(body, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    # One prompt per request: a string, an array of token ids, or a one-element array of either.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        raise bad_request(f"only one prompt per request is supported, got {len(prompt)}", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("'prompt' must be a string or an array of integer token ids", "prompt")
    else:
        raise bad_request(f"'prompt' must be a string or an array of token ids, got {_type_name(prompt)}", "prompt")
    p.prompt = prompt
    return p


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_FIELDS = {"role", "content", "name"}
_NULLABLE_MESSAGE_FIELDS = {"tool_calls", "function_call", "refusal", "audio"}


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise bad_request(f"{where}.content parts must be objects with a 'type'", "messages")
            if part["type"] != "text":
                raise bad_request(f"{where}.content: content of type {show_json(part['type'], 40)} is not supported "
                                  f"(text only)", "messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: a text part needs a string 'text'", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or an array of text parts, got {_type_name(content)}",
                      "messages")


def parse_chat(body: dict, max_messages: int = DEFAULT_MAX_MESSAGES) -> GenerationParams:
    _check_fields(body, _CHAT_FIELDS, _UNSUPPORTED_CHAT)
    p = _common(body, "chat")
    mct = _get_int(body, "max_completion_tokens", lo=1)
    if mct is not None:
        if p.max_tokens is not None and p.max_tokens != mct:
            raise bad_request("give 'max_tokens' or 'max_completion_tokens', not two different values",
                              "max_completion_tokens")
        p.max_tokens = mct
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise bad_request(f"'messages' must be an array, got {_type_name(msgs)}", "messages")
    if not msgs:
        raise bad_request("'messages' must not be empty", "messages")
    if len(msgs) > max_messages:
        raise bad_request(f"'messages' may hold at most {max_messages} messages on this server, got {len(msgs)}",
                          "messages", "too_many_messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {_type_name(m)}", "messages")
        for k in m:
            if k not in _MESSAGE_FIELDS and not (k in _NULLABLE_MESSAGE_FIELDS and _empty(m[k])):
                raise bad_request(f"{where}: field '{k}' is not supported", "messages")
        role = m.get("role")
        if role == "tool" or role == "function":
            raise bad_request(f"{where}: role '{role}' is not supported (no tool calling)", "messages")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}, got {show_json(role, 40)}", "messages")
        if not isinstance(m.get("name", ""), str):
            raise bad_request(f"{where}.name must be a string, got {_type_name(m['name'])}", "messages")
        if "content" not in m or m["content"] is None:
            raise bad_request(f"{where}.content is required", "messages")
        out.append({"role": _ROLES[role], "content": _text_content(m["content"], where)})
    p.messages = out
    return p
