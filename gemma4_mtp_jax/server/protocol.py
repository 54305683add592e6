"""Request validation for the OpenAI-compatible endpoints: JSON bodies in, `GenerationParams` out, or an APIError.

Every field the server understands is checked for type and range; a parameter the server does not implement is
refused with a 400 that names it when it asks for a behaviour we can't give (a forced tool call, suffix, ...), and
accepted when it carries its default value (clients often send `"suffix": ""`). A field neither the OpenAI API nor
the vLLM extensions we follow know is refused too, as OpenAI itself does. What needs the model (token ids within its
vocabulary, `bad_words` as single tokens, `min_tokens` against the request's max_tokens) is checked by prepare.py.

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

from gemma4_mtp_jax.model.sampling import (
    FLOAT32_MAX,
    INT32_MAX,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
)
from gemma4_mtp_jax.server.chat import TEMPLATE_GLOBALS
from gemma4_mtp_jax.server.errors import bad_request
from gemma4_mtp_jax.server.media import MEDIA_MARKS, MediaPart, read_part
from gemma4_mtp_jax.server.structured import StructuredOutput, parse_structured_output
from gemma4_mtp_jax.server.tool_calls import forced_tool_calls
from gemma4_mtp_jax.steps.device_state import MAX_STOP_IDS

MAX_STOP_STRINGS = 16
# A chat's messages at most, by default (--max-messages): each costs the template a few tokens, so 4096 fill ~20k
# tokens with turn markers alone; long agent sessions stay well below.
DEFAULT_MAX_MESSAGES = 4096
MAX_STOP_CHARS = 256
# Choices per request (`n`, `best_of`): each is a sequence of the batch, so one request may not take them all.
MAX_CHOICES = 16
MAX_ALLOWED_TOKEN_IDS = 16384  # `allowed_token_ids` entries
MAX_BAD_WORDS = 64
# Below this, sampling is greedy (as in vLLM): the logits divided by a much smaller temperature overflow float32,
# and at this one sampling already is argmax but for exact ties.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass
class GenerationParams:
    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, Any]] | None = None  # chat: as the template gets them (`_message`), text content
    media: list[MediaPart] = dataclasses.field(default_factory=list)  # chat: image / audio parts, in order
    tools: list[dict[str, Any]] | None = None  # chat: the tools the template renders, output parsed for calls
    tool_choice: str = "auto"  # "auto", "none", "required", or the name of the function a call must go to
    parallel_tool_calls: bool = True  # false: calls after the model's first are dropped
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # more template variables
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
    n: int = 1  # choices returned
    best_of: int = 1  # completions: choices generated (>= n); the n of highest cumulative logprob are returned
    logprobs: int | None = None  # per token: the chosen token's logprob and this many top ones; None: none
    echo: bool = False  # completions: the prompt's text before each choice's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (as in vLLM)
    min_p: float = 0.0  # extension (as in vLLM)
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    min_tokens: int = 0  # extension (as in vLLM): no stop token before this many output tokens
    allowed_token_ids: list[int] | None = None  # extension (as in vLLM): sample only among these
    bad_words: list[str] = dataclasses.field(default_factory=list)  # extension (as in vLLM): never these words
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # extension (as in vLLM): stop at these too
    # The output's grammar: response_format, vLLM's structured_outputs, or a forced tool_choice (structured.py)
    structured: StructuredOutput | None = None


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


def _get_token_ids(body: dict, key: str, limit: int) -> list[int] | None:
    """An array of token ids (non-negative integers; the vocabulary's bound is prepare.py's), at most `limit`."""
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{key}' must be an array of integer token ids", key)
    if len(v) > limit:
        raise bad_request(f"'{key}' may hold at most {limit} token ids, got {len(v)}", key)
    bad = next((t for t in v if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        raise bad_request(f"'{key}' holds {show_json(bad)}, not a token id", key)
    return list(dict.fromkeys(v))


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def _get_logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to biases in [-MAX_BIAS, MAX_BIAS] added to the
    logits."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request(f"'logit_bias' must be an object of token ids to numbers, got {_type_name(v)}",
                          "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}", "logit_bias")
    out = {}
    for k, bias in v.items():
        if not _TOKEN_ID_KEY.fullmatch(k) or int(k) > INT32_MAX:
            raise bad_request(f"'logit_bias' keys must be token ids, got {show_json(k)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise bad_request(f"'logit_bias' values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got "
                              f"{show_json(bias)} for token {k}", "logit_bias")
        out[int(k)] = float(bias)
    return out


def _get_bad_words(body: dict) -> list[str]:
    v = body.get("bad_words")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
        raise bad_request("'bad_words' must be an array of strings", "bad_words")
    if len(v) > MAX_BAD_WORDS:
        raise bad_request(f"'bad_words' may hold at most {MAX_BAD_WORDS} words, got {len(v)}", "bad_words")
    for w in v:
        if not w.strip() or len(w) > MAX_STOP_CHARS:
            raise bad_request(f"'bad_words' entries must be words of 1 to {MAX_STOP_CHARS} characters, got "
                              f"{show_json(w)}", "bad_words")
    return list(dict.fromkeys(v))


def _get_choices(body: dict, p: GenerationParams) -> None:
    """`n` and (completions) `best_of`: 1..MAX_CHOICES, best_of >= n; best_of > n picks by the whole choice's
    logprob, so it can't stream."""
    p.n = _get_int(body, "n", lo=1, hi=MAX_CHOICES) or 1
    best_of = _get_int(body, "best_of", lo=1, hi=MAX_CHOICES)
    p.best_of = p.n if best_of is None else best_of
    if p.best_of < p.n:
        raise bad_request(f"'best_of' ({p.best_of}) must be >= 'n' ({p.n})", "best_of")
    if p.best_of > p.n and p.stream:
        raise bad_request("'best_of' > 'n' can't stream: the best choices are known only at the end", "best_of")


def _get_shaping(body: dict, p: GenerationParams) -> None:
    """Penalties and logit shaping (the engine applies them inside its programs, at every verified position)."""
    def penalty(key: str) -> float:
        v = _get_float(body, key, lambda x: -MAX_PENALTY <= x <= MAX_PENALTY, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        return 0.0 if v is None else v

    p.presence_penalty = penalty("presence_penalty")
    p.frequency_penalty = penalty("frequency_penalty")
    rp = _get_float(body, "repetition_penalty", lambda x: 0 < x <= MAX_PENALTY, f"in (0, {MAX_PENALTY:g}]")
    p.repetition_penalty = 1.0 if rp is None else rp
    min_p = _get_float(body, "min_p", lambda x: 0 <= x <= 1, "in [0, 1]")
    p.min_p = 0.0 if min_p is None else min_p
    p.logit_bias = _get_logit_bias(body)
    p.min_tokens = _get_int(body, "min_tokens", lo=0) or 0
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise bad_request(f"'min_tokens' ({p.min_tokens}) must be <= 'max_tokens' ({p.max_tokens})", "min_tokens")
    allowed = _get_token_ids(body, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)
    if allowed is not None and not allowed:
        raise bad_request("'allowed_token_ids' must not be empty", "allowed_token_ids")
    p.allowed_token_ids = allowed
    p.bad_words = _get_bad_words(body)
    p.stop_token_ids = _get_token_ids(body, "stop_token_ids", MAX_STOP_IDS) or []


# ------------------------------------------------------------------------------------- parameters we do not offer
def _is_default(*defaults: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == d and type(v) is type(d) for d in defaults)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


_UNSUPPORTED_COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_is_default(""), "suffix is not supported"),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_empty, "functions (deprecated) are not supported: use 'tools'"),
    "function_call": (_is_default("none", "auto"), "function_call (deprecated) is not supported: use 'tool_choice'"),
    "store": (_is_default(False), "store is not supported"),
    "audio": (_empty, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (_empty, "predicted outputs are not supported"),
}
_IGNORED = {"user", "metadata", "service_tier"}  # accepted and ignored (they change nothing about the output)

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "return_token_ids", "ignore_eos", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_p", "logit_bias", "min_tokens", "allowed_token_ids", "bad_words", "stop_token_ids",
           "response_format", "structured_outputs"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "logprobs", "echo"} | set(_UNSUPPORTED_COMPLETION) | _IGNORED
_CHAT_FIELDS = (_COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                          "parallel_tool_calls", "chat_template_kwargs"} | set(_UNSUPPORTED_CHAT) | _IGNORED)


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
    max_tokens = _get_int(body, "max_tokens", lo=1)
    if kind == "chat":
        mct = _get_int(body, "max_completion_tokens", lo=1)
        if mct is not None:
            if max_tokens is not None and max_tokens != mct:
                raise bad_request("give 'max_tokens' or 'max_completion_tokens', not two different values",
                                  "max_completion_tokens")
            max_tokens = mct
    p = GenerationParams(
        kind=kind,
        model=model,
        max_tokens=max_tokens,
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
    _get_choices(body, p)
    _get_shaping(body, p)
    p.structured = parse_structured_output(body)
    if p.structured is not None and p.ignore_eos:
        raise bad_request(f"'ignore_eos' with '{p.structured.param}': a complete output may only end, so it would "
                          f"repeat the end-of-sequence token up to max_tokens", "ignore_eos")
    return p


def parse_completion(body: dict) -> GenerationParams:
    _check_fields(body, _COMPLETION_FIELDS, _UNSUPPORTED_COMPLETION)
    p = _common(body, "completion")
    p.logprobs = _get_int(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    p.echo = _get_bool(body, "echo") or False
    if p.echo and p.logprobs is not None and p.stream:
        raise bad_request("'echo' with 'logprobs' (the prompt's logprobs) is answered whole, not streamed",
                          "echo", "unsupported_parameter")
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


# ---------------------------------------------------------------------------------------------------------- chat
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"}
_NULLABLE_MESSAGE_FIELDS = {"function_call", "refusal", "audio"}
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_TOOLS_CHARS = 2**20  # the tool list, as JSON
MAX_JSON_DEPTH = 32  # the nesting of a tool's parameters, a call's arguments, a template variable
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 64 * 2**10
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_CALLED_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")  # a name in a call sent back (what the model may write)
_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _json_depth(v: Any) -> int:
    """How deep objects and arrays nest in `v` (0 for a scalar); iterative, whatever the depth."""
    depth, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            depth = max(depth, d)
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return depth


def _check_json_value(v: Any, where: str, param: str, max_chars: int | None = None) -> None:
    if _json_depth(v) > MAX_JSON_DEPTH:
        raise bad_request(f"'{where}' nests deeper than {MAX_JSON_DEPTH} levels", param)
    if max_chars is not None and len(json.dumps(v, ensure_ascii=False)) > max_chars:
        raise bad_request(f"'{where}' is larger than {max_chars} characters as JSON", param)


def _check_keys(obj: dict, allowed: set[str], where: str, param: str) -> None:
    for k in obj:
        if k not in allowed:
            raise bad_request(f"'{where}': field {show_json(k, 40)} is not supported (allowed: "
                              f"{', '.join(sorted(allowed))})", param)


def _get_tools(body: dict) -> list[dict[str, Any]] | None:
    """The OpenAI tool list, checked: each {"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}} with a unique name of [a-zA-Z0-9_-]{1,64} and parameters a JSON Schema object."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be an array, got {_type_name(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"'{where}' must be an object, got {_type_name(tool)}", "tools")
        _check_keys(tool, {"type", "function"}, where, "tools")
        if tool.get("type") != "function":
            raise bad_request(f"'{where}.type' must be \"function\", got {show_json(tool.get('type'), 40)}", "tools")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise bad_request(f"'{where}.function' must be an object, got {_type_name(f)}", "tools")
        _check_keys(f, {"name", "description", "parameters", "strict"}, f"{where}.function", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"'{where}.function.name' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                              f"{show_json(name, 80)}", "tools")
        if name in names:
            raise bad_request(f"'{where}.function.name': two tools are named {show_json(name)}", "tools")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON Schema object, got "
                              f"{_type_name(params)}", "tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise bad_request(f"'{where}.function.strict' must be a boolean", "tools")
        _check_json_value(params, f"{where}.function.parameters", "tools")
    _check_json_value(tools, "tools", "tools", MAX_TOOLS_CHARS)
    return tools or None


def _get_tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> str:
    """"auto" (the default), "none", "required", or the name of the function a call must go to."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict):
        f = choice.get("function")
        if set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(f, dict) \
                or set(f) != {"name"} or not isinstance(f["name"], str):
            raise bad_request("'tool_choice' as an object must be {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        if not any(t["function"]["name"] == f["name"] for t in tools or []):
            raise bad_request(f"'tool_choice' names the function {show_json(f['name'], 80)}, which is not in "
                              f"'tools'", "tool_choice")
        return f["name"]
    raise bad_request(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {show_json(choice, 60)}", "tool_choice")


def _get_template_kwargs(body: dict) -> dict[str, Any]:
    """`chat_template_kwargs` (vLLM's extension): more variables for the chat template, e.g. enable_thinking."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise bad_request(f"'chat_template_kwargs' must be an object, got {_type_name(kw)}", "chat_template_kwargs")
    if len(kw) > MAX_TEMPLATE_KWARGS:
        raise bad_request(f"'chat_template_kwargs' may hold at most {MAX_TEMPLATE_KWARGS} variables",
                          "chat_template_kwargs")
    for k in kw:
        if not _TEMPLATE_NAME.fullmatch(k):
            raise bad_request(f"'chat_template_kwargs': {show_json(k, 70)} is not a template variable name (letters, "
                              f"digits and _, at most 64)", "chat_template_kwargs")
        if k in TEMPLATE_GLOBALS:
            raise bad_request(f"'chat_template_kwargs': the server sets {k!r} itself", "chat_template_kwargs")
    _check_json_value(kw, "chat_template_kwargs", "chat_template_kwargs", MAX_TEMPLATE_KWARGS_CHARS)
    return kw


def _assistant_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls for the template: each {"id", "type", "function": {"name", "arguments"}}
    with its arguments' JSON text parsed to an object, as Hugging Face's and vLLM's servers pass them."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array, got {_type_name(calls)}", "messages")
    if len(calls) > MAX_TOOL_CALLS:
        raise bad_request(f"{where}.tool_calls may hold at most {MAX_TOOL_CALLS} calls", "messages")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise bad_request(f"{w} must be an object, got {_type_name(call)}", "messages")
        _check_keys(call, {"id", "type", "function", "index"}, w, "messages")
        if call.get("type", "function") != "function":
            raise bad_request(f"{w}.type must be \"function\"", "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{w}.id must be a string", "messages")
        f = call.get("function")
        if not isinstance(f, dict):
            raise bad_request(f"{w}.function must be an object, got {_type_name(f)}", "messages")
        _check_keys(f, {"name", "arguments"}, f"{w}.function", "messages")
        name, args = f.get("name"), f.get("arguments")
        if not isinstance(name, str) or not _CALLED_NAME.fullmatch(name):
            raise bad_request(f"{w}.function.name must be 1 to 64 characters of a-z, A-Z, 0-9, _, . and -, got "
                              f"{show_json(name, 80)}", "messages")
        if not isinstance(args, str):
            raise bad_request(f"{w}.function.arguments must be a string of JSON, got {_type_name(args)}", "messages")
        try:
            parsed = json.loads(args, parse_constant=_no_constant) if args.strip() else {}
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")  # no lone surrogate from a \\u escape
        except (ValueError, RecursionError, UnicodeEncodeError) as e:
            raise bad_request(f"{w}.function.arguments is not valid JSON: {e}", "messages") from None
        if not isinstance(parsed, dict):
            raise bad_request(f"{w}.function.arguments must be a JSON object, got {_type_name(parsed)}", "messages")
        _check_json_value(parsed, f"{w}.function.arguments", "messages")
        out.append({"id": call_id or "", "type": "function", "function": {"name": name, "arguments": parsed}})
    return out


def _message(m: Any, where: str, media: list[MediaPart]) -> dict[str, Any]:
    """A chat message as the template gets it: role (developer -> system), text content ("" for an assistant's
    message of tool calls alone), and name, tool_calls, tool_call_id, reasoning_content / reasoning when given. Its
    image and audio parts go onto `media` (their marks in the text: server/media.py)."""
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object, got {_type_name(m)}", "messages")
    for k in m:
        if k not in _MESSAGE_FIELDS and not (k in _NULLABLE_MESSAGE_FIELDS and _empty(m[k])):
            raise bad_request(f"{where}: field '{k}' is not supported", "messages")
    role = m.get("role")
    if role == "function":
        raise bad_request(f"{where}: role 'function' (deprecated) is not supported: use 'tool'", "messages")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}, got {show_json(role, 40)}", "messages")
    msg: dict[str, Any] = {"role": _ROLES[role]}
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise bad_request(f"{where}.name must be a string, got {_type_name(m['name'])}", "messages")
        msg["name"] = m["name"]
    if not _empty(m.get("tool_calls")):
        if role != "assistant":
            raise bad_request(f"{where}: only assistant messages have tool_calls", "messages")
        msg["tool_calls"] = _assistant_tool_calls(m["tool_calls"], where)
    if m.get("content") is None:
        if "tool_calls" not in msg:
            raise bad_request(f"{where}.content is required", "messages")
        msg["content"] = ""
    else:
        msg["content"] = _text_content(m["content"], where, media)
    call_id = m.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id is required (a string) in a tool message", "messages")
        msg["tool_call_id"] = call_id
    elif call_id is not None:
        raise bad_request(f"{where}: only tool messages have a tool_call_id", "messages")
    for key in ("reasoning_content", "reasoning"):
        if m.get(key) is not None:
            if role != "assistant" or not isinstance(m[key], str):
                raise bad_request(f"{where}.{key} must be a string, in an assistant message", "messages")
            msg[key] = m[key]
    return msg


def _text_content(content: Any, where: str, media: list[MediaPart]) -> str:
    if isinstance(content, str):
        _check_no_marks(content, f"{where}.content")
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            at = f"{where}.content[{i}]"
            if not isinstance(part, dict) or "type" not in part:
                raise bad_request(f"{where}.content parts must be objects with a 'type'", "messages")
            if part["type"] in ("image_url", "input_audio"):
                media.append(read_part(part, at))
                parts.append(MEDIA_MARKS[media[-1].kind])
                continue
            if part["type"] != "text":
                raise bad_request(f"{at}: content of type {show_json(part['type'], 40)} is not supported (text, "
                                  f"image_url, input_audio)", "messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{at}: a text part needs a string 'text'", "messages")
            _check_no_marks(part["text"], at)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or an array of content parts, got {_type_name(content)}",
                      "messages")


def _check_no_marks(text: str, where: str) -> None:
    """Client text may not hold the characters that mark media parts (Unicode noncharacters, server/media.py)."""
    for kind, mark in MEDIA_MARKS.items():
        if mark in text:
            raise bad_request(f"{where}: the text holds U+{ord(mark):04X}, a noncharacter this server reserves for "
                              f"{kind} parts", "messages")


def parse_chat(body: dict, max_messages: int = DEFAULT_MAX_MESSAGES) -> GenerationParams:
    _check_fields(body, _CHAT_FIELDS, _UNSUPPORTED_CHAT)
    p = _common(body, "chat")
    # Chat's logprobs: a switch, and how many top tokens besides the chosen one.
    top = _get_int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if _get_bool(body, "logprobs"):
        p.logprobs = top or 0
    elif top:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
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
    media: list[MediaPart] = []
    out = [_message(m, f"messages[{i}]", media) for i, m in enumerate(msgs)]
    p.messages, p.media = out, media
    tools = _get_tools(body)
    p.tool_choice = _get_tool_choice(body, tools)
    if p.tool_choice == "required" and not tools:
        raise bad_request("'tool_choice' \"required\" needs 'tools'", "tool_choice")
    p.tools = tools if p.tool_choice != "none" else None  # "none": no tools in the prompt (SERVING.md, "Tools")
    p.parallel_tool_calls = _get_bool(body, "parallel_tool_calls") is not False
    if p.tool_choice not in ("auto", "none"):  # "required" or a named function: the grammar engine forces the call
        if p.structured is not None:
            raise bad_request(f"give a forced 'tool_choice' or '{p.structured.param}', not both", "tool_choice")
        p.structured = forced_tool_calls(tools, p.tool_choice, p.parallel_tool_calls)
    p.chat_template_kwargs = _get_template_kwargs(body)
    return p
