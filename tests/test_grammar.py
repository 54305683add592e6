"""Structured output's host side (engine/grammar.py, server/structured.py) on the demo pair's tokenizer: masks
exactly right against an independent oracle, rollback, the drafts of a speculative round, random walks whose text
always parses and validates, and the 400s of the request edge (limits, compile errors, the time limit)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import regex
from tokenizers import Tokenizer

from gemma4_mtp_jax.engine.grammar import (JSON_WHITESPACE, GrammarCompiler, GrammarError, GrammarSpec, RoundMasks,
                                           Vocabulary, allows, compile_grammar)
from gemma4_mtp_jax.server.errors import APIError
from gemma4_mtp_jax.server.structured import (MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, StructuredOutput,
                                              compile_structured, parse_structured_output, schema_depth)

TOKENIZER = Path(__file__).resolve().parent.parent / "gemma4_mtp_jax" / "demo_pair" / "target" / "tokenizer.json"
STOP = (1, 5)  # <eos>, <end_of_turn>
V = 8192

TINY_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}
# The JSON documents of TINY_SCHEMA as the grammar writes them: whitespace between tokens, none around the object.
_WS = JSON_WHITESPACE
TINY_DOCUMENTS = rf'\{{{_WS}"ok"{_WS}:{_WS}(true|false){_WS}\}}'
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "dims": {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "boolean"}},
                 "required": ["w"], "additionalProperties": False},
    },
    "required": ["name", "size", "count", "dims"],
    "additionalProperties": False,
}
HOSTILE_SCHEMA: dict = {"type": "boolean"}
for _d in range(12):  # 12 levels, each of 150 properties of three types: ~0.1 s to compile
    HOSTILE_SCHEMA = {"type": "object", "properties": {**{f"p{_d}_{j}": {"anyOf": [
        {"type": "string"}, {"type": "integer"}, {"type": "null"}]} for j in range(150)}, "next": HOSTILE_SCHEMA},
        "required": ["next"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary(TOKENIZER.read_text(), V, STOP)


@pytest.fixture(scope="module")
def texts(tokenizer) -> list[str]:
    """Each token's text (special tokens as their markup, so that no pattern of plain text matches them)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in range(V)]


def allowed(mask: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist())


def oracle(pattern: str, prefix: str, texts: list[str]) -> set[int]:
    """The tokens a grammar whose documents are the full matches of `pattern` must allow after `prefix`: those
    whose text extends it to a prefix of a document, and the stop ids where `prefix` is a document."""
    ok = {t for t, s in enumerate(texts) if s and regex.fullmatch(pattern, prefix + s, partial=True)}
    return ok | set(STOP) if regex.fullmatch(pattern, prefix) else ok


def walk_masks(m, ids, vocab) -> list[np.ndarray]:
    """The masks before each of `ids` and after the last, accepting them on the way."""
    masks = []
    for t in ids:
        masks.append(vocab.new_masks())
        m.fill_mask(masks[-1])
        assert m.accept(t)
    masks.append(vocab.new_masks())
    m.fill_mask(masks[-1])
    return masks


# ---------------------------------------------------------------------------------------------------- exact masks
@pytest.mark.parametrize("spec, pattern, document", [
    (GrammarSpec.choice(["yes", "yesterday", "no"]), "yes|yesterday|no", "yesterday"),
    (GrammarSpec.choice(["yes", "yesterday", "no"]), "yes|yesterday|no", "yes"),
    (GrammarSpec.json_schema(TINY_SCHEMA), TINY_DOCUMENTS, '{ "ok":\n  false}'),
    (GrammarSpec("regex", "[0-9]{2,3}"), "[0-9]{2,3}", "123"),
])
def test_masks_are_exact(vocab, tokenizer, texts, spec, pattern, document):
    m = compile_grammar(spec, vocab).matcher()
    ids = tokenizer.encode(document, add_special_tokens=False).ids
    prefix = ""
    for t, mask in zip(ids + [STOP[0]], walk_masks(m, ids, vocab)):
        got, want = allowed(mask), oracle(pattern, prefix, texts)
        # Where the grammar forces the next bytes (a required key), llguidance allows only the first token of
        # their canonical tokenization: '"ok"' may start with "ok", not with "o".
        assert got == want or (len(got) == 1 and got < want), f"after {prefix!r}"
        prefix += texts[t]
    assert m.accept(STOP[1]) and m.is_terminated()
    done = vocab.new_masks()
    m.fill_mask(done)
    assert allowed(done) == set(STOP)  # the model can still only stop
    assert not m.accept(ids[0]) and m.accept(STOP[0])


def test_a_forbidden_token_is_refused_without_harm(vocab, tokenizer):
    m = compile_grammar(GrammarSpec.choice(["yes", "no"]), vocab).matcher()
    before = vocab.new_masks()
    m.fill_mask(before)
    bad = tokenizer.encode("maybe", add_special_tokens=False).ids[0]
    assert not allows(before, bad)
    assert not m.accept(bad) and not m.accept(STOP[0]) and m.num_accepted == 0
    after = vocab.new_masks()
    m.fill_mask(after)
    np.testing.assert_array_equal(before, after)
    assert all(m.accept(t) for t in tokenizer.encode("no", add_special_tokens=False).ids)


def test_pad_bits_past_the_vocabulary_are_zero(tokenizer):
    wide = Vocabulary(TOKENIZER.read_text(), V + 40, STOP)  # a model whose logits are wider than the tokenizer
    m = compile_grammar(GrammarSpec("regex", "(.|\n)*"), wide).matcher()
    mask = wide.new_masks()
    m.fill_mask(mask)
    assert mask.shape == (-(-(V + 40) // 32),) and max(allowed(mask)) < V
    every = wide.new_masks()
    wide.allow_all(every)
    assert allowed(every) == set(range(V + 40))


# ------------------------------------------------------------------------------------------------------- rollback
def test_rollback_restores_the_state(vocab, tokenizer):
    doc = json.dumps({"name": "box", "size": "large", "count": 7, "tags": ["a"], "dims": {"w": 1.5}})
    ids = tokenizer.encode(doc, add_special_tokens=False).ids
    m = compile_grammar(GrammarSpec.json_schema(NESTED_SCHEMA), vocab).matcher()
    masks = walk_masks(m, ids, vocab)
    assert m.accept(STOP[0]) and m.is_terminated()
    for n in (1, 3, len(ids) + 1):  # the stop alone, into the document, back to the start
        m.rollback(n)
        assert not m.is_terminated() and m.num_accepted == len(ids) + 1 - n
        now = vocab.new_masks()
        m.fill_mask(now)
        np.testing.assert_array_equal(now, masks[len(ids) + 1 - n])
        redo = ids[len(ids) + 1 - n:] if n > 1 else []
        assert all(m.accept(t) for t in redo) and m.accept(STOP[0])
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(len(ids) + 2)


def test_rollback_of_a_stop_where_the_grammar_could_go_on(vocab, tokenizer):
    m = compile_grammar(GrammarSpec("regex", "[0-9]+"), vocab).matcher()  # "12" may end or grow
    ids = tokenizer.encode("12", add_special_tokens=False).ids
    masks = walk_masks(m, ids, vocab)
    assert STOP[0] in allowed(masks[-1]) and len(allowed(masks[-1])) > len(STOP)
    assert m.accept(STOP[0]) and m.is_terminated()
    m.rollback(1)
    now = vocab.new_masks()
    m.fill_mask(now)
    np.testing.assert_array_equal(now, masks[-1])


# --------------------------------------------------------------------------------------------------------- drafts
def test_draft_masks_match_the_masks_one_token_at_a_time(vocab, tokenizer):
    doc = json.dumps({"name": "cup", "size": "small", "count": 12, "dims": {"w": 2, "h": True}})
    ids = tokenizer.encode(doc, add_special_tokens=False).ids + [STOP[0]]
    compiled = compile_grammar(GrammarSpec.json_schema(NESTED_SCHEMA), vocab)
    reference = walk_masks(compiled.matcher(), ids[:-1], vocab)
    m, k, pos = compiled.matcher(), 4, 0
    while pos + k <= len(ids):
        out = vocab.new_masks(k + 1)
        assert m.fill_draft_masks(ids[pos:pos + k], out) == k + 1
        assert m.num_accepted == pos  # rolled back
        for i in range(min(k + 1, len(reference) - pos)):
            np.testing.assert_array_equal(out[i], reference[pos + i])
        assert all(m.accept(t) for t in ids[pos:pos + k + 1])  # the round accepted every draft and a bonus
        pos += k + 1


def test_draft_masks_stop_at_a_forbidden_draft(vocab, tokenizer):
    m = compile_grammar(GrammarSpec.choice(["yes", "no"]), vocab).matcher()
    yes = tokenizer.encode("yes", add_special_tokens=False).ids
    bad = tokenizer.encode("x", add_special_tokens=False).ids[0]
    drafts = yes[:1] + [bad, bad, bad]
    out = vocab.new_masks(len(drafts) + 1)
    out[2:] = 12345  # rows past the forbidden draft's position stay as they were
    assert m.fill_draft_masks(drafts, out) == 2
    assert allows(out[0], drafts[0]) and not allows(out[1], bad)
    assert (out[2:] == 12345).all()
    assert m.num_accepted == 0
    first = vocab.new_masks()
    m.fill_mask(first)
    np.testing.assert_array_equal(first, out[0])


def test_draft_masks_stop_where_the_mask_forbids_a_draft_the_matcher_would_take(vocab, tokenizer):
    # In a forced stretch ('"ok"') the mask allows only the canonical "ok"; the device rejects an "o" there, so the
    # walk must stop at it even though the grammar could go on from it.
    m = compile_grammar(GrammarSpec.json_schema(TINY_SCHEMA), vocab).matcher()
    o, k_ = (tokenizer.token_to_id(t) for t in ("o", "k"))
    drafts = [tokenizer.token_to_id("{"), tokenizer.token_to_id('"'), o, k_]
    out = vocab.new_masks(len(drafts) + 1)
    assert m.fill_draft_masks(drafts, out) == 3 and not allows(out[2], o)
    assert m.num_accepted == 0


def test_draft_masks_past_a_stop_allow_only_stops(vocab, tokenizer):
    m = compile_grammar(GrammarSpec.choice(["no"]), vocab).matcher()
    no = tokenizer.encode("no", add_special_tokens=False).ids
    drafts = no + [STOP[0], STOP[0]]
    out = vocab.new_masks(len(drafts) + 1)
    assert m.fill_draft_masks(drafts, out) == len(drafts) + 1
    assert all(allowed(out[i]) == set(STOP) for i in range(len(no), len(drafts) + 1))
    assert m.num_accepted == 0 and not m.is_terminated()


def test_a_batch_round_fills_what_each_matcher_fills(vocab, tokenizer):
    doc = tokenizer.encode(json.dumps({"name": "cup", "size": "small", "count": 3, "dims": {"w": 2}}),
                           add_special_tokens=False).ids + [STOP[0]]
    compiled = compile_grammar(GrammarSpec.json_schema(NESTED_SCHEMA), vocab)
    choice = compile_grammar(GrammarSpec.choice(["yes", "no"]), vocab)
    bad = tokenizer.encode("x", add_special_tokens=False).ids[0]
    k = 4
    # (matcher, tokens accepted first, drafts): all allowed, a forbidden one, through the stop, a finished match
    cases = [(compiled.matcher(), doc[:3], doc[3:7]), (compiled.matcher(), doc[:5], doc[5:7] + [bad, bad]),
             (compiled.matcher(), doc[:-3], doc[-3:] + [STOP[0]]), (choice.matcher(), [], [bad] * k)]
    cases.append((choice.matcher(), tokenizer.encode("no", add_special_tokens=False).ids + [STOP[1]], [STOP[0]] * k))
    for m, before, _ in cases:
        assert all(m.accept(t) for t in before)
    matchers, drafts = [m for m, _, _ in cases], [d for _, _, d in cases]
    out = vocab.new_masks(len(cases), k + 1)
    assert RoundMasks(threads=2).fill(matchers, drafts, out) == []
    for b, (m, before, d) in enumerate(cases):
        ref = vocab.new_masks(k + 1)
        n = m.fill_draft_masks(d, ref)
        if STOP[0] in d:  # the sequence ends at its first stop: the rows after it do not count
            n = min(n, d.index(STOP[0]) + 1)
        np.testing.assert_array_equal(out[b, :n], ref[:n], err_msg=f"case {b}")
        assert m.num_accepted == len(before)


# ---------------------------------------------------------------------------------------------------- random walks
def random_walk(m, vocab, texts, rng: random.Random, limit: int = 1000) -> list[int]:
    """Sample only allowed tokens until the grammar ends: a stop half the time one is allowed, else uniformly, and
    after a while mostly tokens that close something (so that an open-ended grammar ends too)."""
    out, mask = [], vocab.new_masks()
    for _ in range(limit):
        m.fill_mask(mask)
        ok = sorted(allowed(mask))
        assert ok, "a mask must allow something"
        stops = [t for t in ok if t in STOP]
        closing = [t for t in ok if t in STOP or any(c in texts[t] for c in '"]}')]
        if stops and rng.random() < 0.5:
            t = stops[0]
        elif closing and len(out) > 40 and rng.random() < 0.8:
            t = rng.choice(closing)
        else:
            t = rng.choice(ok)
        assert m.accept(t)
        if m.is_terminated():
            return out
        out.append(t)
    raise AssertionError(f"no stop after {limit} tokens")


@pytest.mark.parametrize("schema", [TINY_SCHEMA, NESTED_SCHEMA, {"type": "object"}], ids=["tiny", "nested", "object"])
def test_random_walks_parse_and_validate(vocab, tokenizer, texts, schema):
    m = compile_grammar(GrammarSpec.json_schema(schema), vocab).matcher()
    for seed in range(6):
        ids = random_walk(m, vocab, texts, random.Random(seed))
        text = tokenizer.decode(ids, skip_special_tokens=False)
        jsonschema.validate(json.loads(text), schema)
        m.rollback(m.num_accepted)


def test_random_walks_of_a_regex_and_a_choice(vocab, tokenizer, texts):
    cases = [(GrammarSpec("regex", r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"), r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"),
             (GrammarSpec.choice(["alpha", "beta", "gamma delta"]), r"alpha|beta|gamma delta")]
    for spec, pattern in cases:
        m = compile_grammar(spec, vocab).matcher()
        for seed in range(6):
            text = tokenizer.decode(random_walk(m, vocab, texts, random.Random(seed)))
            assert re.fullmatch(pattern, text), text
            m.rollback(m.num_accepted)


# ------------------------------------------------------------------------------------------- compiling and caching
def test_compile_errors_carry_the_library_reason(vocab):
    with pytest.raises(GrammarError, match="strin"):
        compile_grammar(GrammarSpec.json_schema({"type": "strin"}), vocab)
    with pytest.raises(GrammarError, match="unclosed group"):
        compile_grammar(GrammarSpec("regex", "(ab"), vocab)
    with pytest.raises(GrammarError, match="foo"):
        compile_grammar(GrammarSpec("lark", "start: foo"), vocab)


def test_the_compiler_caches_by_spec(vocab):
    compiler = GrammarCompiler(vocab, workers=2, cache_size=2)
    try:
        a = compiler.submit(GrammarSpec.json_schema(TINY_SCHEMA))
        assert compiler.submit(GrammarSpec.json_schema(json.loads(json.dumps(TINY_SCHEMA)))) is a
        assert a.result(30).spec.kind == "json"
        # Key order is kept (a schema's property order is its output's order): another spec, another grammar.
        swapped = dict(reversed(list(TINY_SCHEMA.items())))
        assert compiler.submit(GrammarSpec.json_schema(swapped)) is not a
    finally:
        compiler.shutdown()


def test_the_cache_is_bounded(vocab):
    compiler = GrammarCompiler(vocab, workers=1, cache_size=2)
    try:
        specs = [GrammarSpec.choice([w]) for w in ("a", "b", "c")]
        futures = [compiler.submit(s) for s in specs]
        assert len(compiler) == 2
        assert compiler.submit(specs[2]) is futures[2] and compiler.submit(specs[0]) is not futures[0]
        failed = compiler.submit(GrammarSpec("regex", "("))
        with pytest.raises(GrammarError):
            failed.result(30)
        assert compiler.submit(GrammarSpec("regex", "(")) is failed  # a failure is remembered too
    finally:
        compiler.shutdown()


# ------------------------------------------------------------------------------------------------- the request edge
def test_response_format_and_structured_outputs_parse():
    assert parse_structured_output({}) is None
    assert parse_structured_output({"response_format": {"type": "text"}}) is None
    so = parse_structured_output({"response_format": {"type": "json_object"}})
    assert so == StructuredOutput(GrammarSpec.json_schema({"type": "object"}), "response_format")
    so = parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "tiny", "schema": TINY_SCHEMA, "strict": True}}})
    assert so.spec == GrammarSpec.json_schema(TINY_SCHEMA) and so.param == "response_format"
    so = parse_structured_output({"structured_outputs": {"json": json.dumps(TINY_SCHEMA)}})
    assert so.spec == GrammarSpec.json_schema(TINY_SCHEMA) and so.param == "structured_outputs"
    assert parse_structured_output({"structured_outputs": {"choice": ["a", "b", "a"]}}).spec == \
        GrammarSpec.choice(["a", "b"])
    assert parse_structured_output({"structured_outputs": {"regex": "[0-9]+"}}).spec == GrammarSpec("regex", "[0-9]+")
    assert parse_structured_output({"structured_outputs": {"grammar": "start: \"x\""}}).spec.kind == "lark"
    assert parse_structured_output({"structured_outputs": {"json_object": True}}).spec.kind == "json"


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format",
     "must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format", "strict"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "unknown field"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty array"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs", "non-empty strings"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"regex": "a" * 5000}}, "structured_outputs", "at most"),
    ({"structured_outputs": {"whitespace": 1}}, "structured_outputs", "unknown field"),
])
def test_malformed_requests_are_400s_naming_the_field(body, param, words):
    with pytest.raises(APIError) as e:
        parse_structured_output(body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_schema_limits_are_checked_before_compiling():
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    assert schema_depth(deep) > MAX_SCHEMA_DEPTH
    with pytest.raises(APIError) as e:
        parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": deep}}})
    assert (e.value.status, e.value.param, e.value.code) == (400, "response_format", "schema_too_deep")
    wide = {"type": "object", "properties": {f"p{i:06d}": {"type": "string"} for i in range(MAX_SCHEMA_BYTES // 20)}}
    with pytest.raises(APIError) as e:
        parse_structured_output({"structured_outputs": {"json": wide}})
    assert (e.value.status, e.value.param, e.value.code) == (400, "structured_outputs", "schema_too_large")
    assert schema_depth(3) == 0 and schema_depth({"a": [1, {"b": {}}]}) == 4


def test_compile_failure_and_timeout_are_400s(vocab):
    compiler = GrammarCompiler(vocab, workers=2)

    async def run():
        bad = StructuredOutput(GrammarSpec.json_schema({"type": "strin"}), "response_format")
        with pytest.raises(APIError) as e:
            await compile_structured(compiler, bad)
        assert (e.value.status, e.value.param, e.value.code) == (400, "response_format", "invalid_grammar")
        assert "strin" in e.value.message
        # A hostile schema times out alone: a small one submitted beside it compiles.
        hostile = StructuredOutput(GrammarSpec.json_schema(HOSTILE_SCHEMA), "response_format")
        small = StructuredOutput(GrammarSpec.json_schema(TINY_SCHEMA), "structured_outputs")
        slow, fast = await asyncio.gather(compile_structured(compiler, hostile, timeout_s=0.001),
                                          compile_structured(compiler, small, timeout_s=30),
                                          return_exceptions=True)
        assert isinstance(slow, APIError) and (slow.status, slow.param, slow.code) == (
            400, "response_format", "grammar_timeout")
        assert fast.spec == small.spec
        # The timed-out compilation finishes in the background and serves the next request.
        compiled = await compile_structured(compiler, hostile, timeout_s=60)
        assert compiled.matcher().num_accepted == 0

    try:
        asyncio.run(run())
    finally:
        compiler.shutdown()
