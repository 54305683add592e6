"""Structured output at the edge: `response_format` (OpenAI) and `structured_outputs` (vLLM's extension) read into
one `StructuredOutput`, checked against size limits before anything compiles, and compiled off the event loop with
a time limit (engine/grammar.py holds the grammars and the matchers).

    response_format: {"type": "text"}                                   no constraint
                     {"type": "json_object"}                            any JSON object
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs: exactly one of
                     {"json": schema (an object, or its JSON text)}     as json_schema
                     {"json_object": true}                              as json_object
                     {"regex": pattern}                                 the whole output matches it
                     {"choice": [string, ...]}                          the output is one of them
                     {"grammar": text}                                  a Lark grammar (llguidance's syntax)

A schema is enforced whatever its `strict` says (as vLLM does): the output always validates. Every refusal is a 400
naming the field at fault.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
from typing import Any

from gemma4_mtp_jax.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec, Vocabulary
from gemma4_mtp_jax.server.errors import bad_request

# Limits checked before compiling (a schema's cost grows with its size; these are far above real-world schemas:
# OpenAI's strict mode allows 5000 properties over 10 levels of nesting).
MAX_SCHEMA_BYTES = 128 * 1024  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 64  # nested JSON arrays and objects in the schema document (an object level is two)
MAX_PATTERN_CHARS = 4096  # a regex
MAX_GRAMMAR_CHARS = 64 * 1024  # a Lark grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 64 * 1024  # all choices together
# How long a request waits for its grammar: compilation takes milliseconds for usual schemas, 0.3 s for a hostile
# one (docs/decisions/0019-grammar-engine.md).
DEFAULT_COMPILE_TIMEOUT_S = 10.0

_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_JSON_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A request's output constraint: the grammar, and the request field it came from (for errors)."""

    spec: GrammarSpec
    param: str  # "response_format" or "structured_outputs"


def parse_structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The output constraint of a request body (chat or completions), or None. Raises a 400 naming the field for
    a malformed or oversized one, or when both fields constrain the output."""
    rf = _response_format(body.get("response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    if rf is not None and so is not None:
        raise bad_request("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    return rf or so


def _response_format(v: Any) -> StructuredOutput | None:
    p = "response_format"
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request(f"'{p}' must be an object with a 'type'", p)
    kind = v.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise bad_request(f"'{p}.type' must be one of {list(_RESPONSE_FORMATS)}, got {_show(kind)}", p)
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _only_keys(v, allowed, p, p)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(GrammarSpec.json_schema(_JSON_OBJECT), p)
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request(f"'{p}.json_schema' must be an object with 'name' and 'schema'", p)
    _only_keys(js, {"name", "schema", "strict", "description"}, f"{p}.json_schema", p)
    name = js.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise bad_request(f"'{p}.json_schema.name' must be 1-64 characters of a-z, A-Z, 0-9, _ and -", p)
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad_request(f"'{p}.json_schema.strict' must be a boolean", p)
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise bad_request(f"'{p}.json_schema.description' must be a string", p)
    schema = js.get("schema", {})  # OpenAI: an absent schema is the empty one (any JSON value)
    return StructuredOutput(_schema_spec(schema, f"{p}.json_schema.schema", p), p)


def _structured_outputs(v: Any) -> StructuredOutput | None:
    p = "structured_outputs"
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request(f"'{p}' must be an object", p)
    _only_keys(v, set(_STRUCTURED_KEYS), p, p)
    given = [k for k in _STRUCTURED_KEYS if v.get(k) is not None and v.get(k) is not False]
    if len(given) != 1:
        raise bad_request(f"'{p}' needs exactly one of {list(_STRUCTURED_KEYS)}, got {given or 'none'}", p)
    key = given[0]
    where, value = f"{p}.{key}", v[key]
    if key == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise bad_request(f"'{where}' is not valid JSON: {e}", p) from None
        return StructuredOutput(_schema_spec(value, where, p), p)
    if key == "json_object":
        if value is not True:
            raise bad_request(f"'{where}' must be true", p)
        return StructuredOutput(GrammarSpec.json_schema(_JSON_OBJECT), p)
    if key == "regex":
        _text(value, where, p, MAX_PATTERN_CHARS)
        return StructuredOutput(GrammarSpec("regex", value), p)
    if key == "grammar":
        _text(value, where, p, MAX_GRAMMAR_CHARS)
        return StructuredOutput(GrammarSpec("lark", value), p)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"'{where}' must be a non-empty array of non-empty strings", p)
    if len(value) > MAX_CHOICES:
        raise bad_request(f"'{where}' may hold at most {MAX_CHOICES} strings, got {len(value)}", p)
    if sum(map(len, value)) > MAX_CHOICE_CHARS:
        raise bad_request(f"'{where}' may hold at most {MAX_CHOICE_CHARS} characters in all", p)
    return StructuredOutput(GrammarSpec.choice(list(dict.fromkeys(value))), p)


def _schema_spec(schema: Any, where: str, param: str) -> GrammarSpec:
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{where}' must be a JSON schema (an object), got {_show(schema)}", param)
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(f"'{where}' nests {depth} levels of arrays and objects; at most {MAX_SCHEMA_DEPTH} are "
                          f"allowed", param, "schema_too_deep")
    try:
        spec = GrammarSpec.json_schema(schema)
    except ValueError as e:  # NaN or infinity: not JSON
        raise bad_request(f"'{where}' is not valid JSON: {e}", param) from None
    size = len(spec.source.encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"'{where}' is {size} bytes as compact JSON; at most {MAX_SCHEMA_BYTES} are allowed",
                          param, "schema_too_large")
    return spec


def schema_depth(value: Any) -> int:
    """How deep arrays and objects nest in a JSON value (a scalar is 0); iterative, so any depth is safe."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def _text(value: Any, where: str, param: str, limit: int) -> None:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{where}' must be a non-empty string", param)
    if len(value) > limit:
        raise bad_request(f"'{where}' may be at most {limit} characters long, got {len(value)}", param)


def _only_keys(v: dict, allowed: set[str], where: str, param: str) -> None:
    for k in v:
        if k not in allowed:
            raise bad_request(f"'{where}' has an unknown field {_show(k)} (expected {sorted(allowed)})", param)


def _show(v: Any, limit: int = 64) -> str:
    text = json.dumps(v, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------------ compiling
def grammar_compiler(tokenizer_json: str, vocab_size: int, stop_ids, *, workers: int | None = None,
                     cache_size: int = 256) -> GrammarCompiler:
    """The server's compiler for the checkpoint's tokenizer (`TextTokenizer.tokenizer.to_str()`), the model's
    vocabulary size (the logits' width) and its stop ids (EOS and end-of-turn: what a complete grammar allows).
    Make it at start-up, before serving: indexing the vocabulary holds the GIL (~2.5 s for 262144 tokens)."""
    return GrammarCompiler(Vocabulary(tokenizer_json, vocab_size, stop_ids), workers=workers, cache_size=cache_size)


async def compile_structured(compiler: GrammarCompiler, so: StructuredOutput,
                             timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> CompiledGrammar:
    """The compiled grammar of a request, waited for without blocking the event loop. A spec that cannot compile
    is a 400 with the library's reason; one still compiling after `timeout_s` a 400 of its own (its compilation
    goes on in the compiler's threads, bounded by the parser limits, and other requests are not held up)."""
    fut = compiler.submit(so.spec)
    try:
        # shield: a timed-out wait must not cancel a compilation other requests of the same spec may share
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout_s)
    except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
        raise bad_request(f"'{so.param}': the grammar did not compile within {timeout_s:g} s; simplify the "
                          f"schema", so.param, "grammar_timeout") from None
    except GrammarError as e:
        raise bad_request(f"'{so.param}': the grammar cannot be compiled: {_reason(e)}", so.param,
                          "invalid_grammar") from None


def _reason(e: Exception, limit: int = 1000) -> str:
    text = str(e).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."

