"""MTP speculative decoding: losslessness (greedy in float32 and bfloat16, over an fp8 KV cache, with fp8 weights),
drafter parity with transformers, an independent reference loop, exact rejection sampling (the law of a round's output, Monte Carlo,
and sampled rounds of the engine's program against the target's distribution), drafts that match the target, EOS
inside an accepted run, the drafter's K/V mapping, and the fp8 cache's drift of the target's and the drafter's logits.

CPU, float32 unless said, the tiny transformers-built pairs of hf_tiny.py (the "target" checkpoints, aligned with
their assistants so that drafts are partly accepted). Engines compile every program at start-up (~10 s plain, ~20 s
speculative on 2 cores), so they are built once per module and shared:
  plain   e2b, a26b, b31b, b31b fp8 weights (the non-speculative greedy references)
  spec    e2b k=1, e2b k=2 (2 slots), e2b k=4, a26b k=4, b31b k=4, b31b k=4 fp8 weights
  oracle  e2b k=4 drafting with `TargetGreedyDrafter` (the target's own greedy tokens, plugged into the engine)
  fp8     e2b plain and k=4 over an fp8 KV cache (2 slots)
k=1 and k=2 run on e2b only: it has every special path (centroid head, suppress_tokens, KV-shared layers). The
bfloat16 test builds its own two e2b engines, compiling only the programs it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_tiny
from hf_tiny import assert_close

FAMILIES = ["e2b", "a26b", "b31b"]
# (family, k, cache dtype, weights): an fp8 KV cache (e2b: its drafter reads the target's pages) and fp8 target
# weights (b31b: the dense family, whose programs compile fastest) besides float32
SPEC_CASES = [("e2b", 1, None, None), ("e2b", 2, None, None), ("e2b", 4, None, None), ("a26b", 4, None, None),
              ("b31b", 4, None, None), ("e2b", 4, "fp8", None), ("b31b", 4, None, "fp8")]
K = 4
MAX_NEW = 24
LENGTHS = [3, 5, 8, 9, 13, 17, 24, 30]  # shorter and longer than the window (8) and the prefill chunk (8)
ATOL = 1e-4
S, F = "sliding_attention", "full_attention"


def _config(**kw):
    from gemma4_mtp_jax.engine import EngineConfig

    base = dict(max_num_seqs=4, max_model_len=96, page_size=4, prefill_chunk=8, min_prefill_bucket=4)
    base.update(kw)
    return EngineConfig(**base)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, hf_tiny.VOCAB, size=n).tolist() for n in lengths]


class TargetGreedyDrafter:
    """A drafter (`speculative.Drafter`) whose drafts are the target's own greedy continuation: it runs the target
    on its own pages one token at a time (the K/V it writes there stays inside the draft; the verify forward
    rewrites those positions). Greedy rows then accept every draft; sampled rows get q = one-hot (a deterministic
    proposal)."""

    def params(self):
        return ()

    def draft(self, spec, params_t, params_d, pages, hidden, inputs):
        from gemma4_mtp_jax.steps.forward import forward_paged, lm_logits

        tok, lengths, drafts = inputs.rows.token, inputs.rows.length, []
        for s in range(spec.k):
            h, pages = forward_paged(spec, params_t, pages, tok[:, None], (lengths + s)[:, None], inputs.tables)
            tok = jnp.argmax(lm_logits(spec.target, params_t, h[:, 0]), -1).astype(jnp.int32)
            drafts.append(tok)
        drafts = jnp.stack(drafts, 1)
        q = jax.nn.one_hot(drafts, spec.target.config.vocab_size) * (inputs.sampling.temperature > 0)[:, None, None]
        return drafts, q, None


@pytest.fixture(scope="module")
def engines(tiny_ckpts, jax_models):
    """engines(family, k=0, oracle=False, cache_dtype=None, quantization=None, adaptive=False): one Engine per key
    for the whole module (k=0: no assistant; oracle: drafting with TargetGreedyDrafter; cache_dtype: EngineConfig's,
    the target's float32 when None; quantization "fp8": the target's weights fp8, its activations float32 as the
    others'; adaptive: round sizes chosen per step, compiled in the background). The plain and oracle engines
    compile their programs as their requests need them. An fp8 cache's engines, plain and
    speculative, take 2 sequences (one batch bucket to compile). `engines.drop(...)` (the same arguments) frees an
    engine no later test takes: the module's engines together come near the process's limit of memory mappings
    (conftest.compiled_programs_freed)."""
    from gemma4_mtp_jax.api import load_target
    from gemma4_mtp_jax.engine import Engine

    cache, fp8_targets = {}, {}

    def get(family: str, k: int = 0, oracle: bool = False, cache_dtype: str | None = None,
            quantization: str | None = None, adaptive: bool = False):
        key = (family, k, oracle, cache_dtype, quantization, adaptive)
        if key not in cache:
            p = tiny_ckpts[family]
            if quantization is None:
                target = jax_models.target(p["target"])
            else:
                if family not in fp8_targets:
                    fp8_targets[family] = load_target(p["target"], "float32", quantization=quantization)
                target = fp8_targets[family]
            seqs = {} if cache_dtype is None else dict(max_num_seqs=2, cache_dtype=cache_dtype)
            if k == 0:  # a reference: its programs compile as its requests need them (fewer variants, buckets)
                cache[key] = Engine(target, _config(compile_at_start=False, **seqs))
            else:
                assistant = jax_models.assistant(p["assistant"])
                if adaptive:  # the round sizes chosen per step, compiled behind the first bucket's k
                    seqs = dict(seqs, adaptive_speculation=True, compile_in_background=True)
                if oracle:  # greedy requests alone, none of whose tests counts compilations: its programs compile
                    seqs = dict(seqs, compile_at_start=False)  # as they run (not the sampled / processed variants)
                cfg = _config(num_speculative_tokens=k, **{"max_num_seqs": 2 if k < K else 4, **seqs})
                cache[key] = Engine(target, cfg, assistant=assistant,
                                    drafter=TargetGreedyDrafter() if oracle else None)
        return cache[key]

    def drop(family: str, k: int = 0, oracle: bool = False, cache_dtype: str | None = None,
             quantization: str | None = None, adaptive: bool = False) -> None:
        import gc

        if cache.pop((family, k, oracle, cache_dtype, quantization, adaptive), None) is not None:
            gc.collect()

    get.drop = drop
    return get


_GREEDY = {}


def greedy_reference(engines, family: str, prompts, max_new: int, cache_dtype: str | None = None,
                     quantization: str | None = None) -> list[list[int]]:
    """Non-speculative greedy outputs (plain engine), memoized per (family, cache dtype, weights, prompt, max_new)."""
    from gemma4_mtp_jax.generate import generate

    key = lambda p: (family, cache_dtype, quantization, tuple(p), max_new)  # noqa: E731
    missing = [p for p in prompts if key(p) not in _GREEDY]
    if missing:
        eng = engines(family, cache_dtype=cache_dtype, quantization=quantization)
        for p, r in zip(missing, generate(eng.target, missing, max_new, engine=eng)):
            _GREEDY[key(p)] = r.tokens
    return [_GREEDY[key(p)] for p in prompts]


def _check_round_stats(req, k: int) -> None:
    """Per-request stats agree with its rounds (k drafts each; mean acceptance length; n+1 tokens per round; where
    in the output each began)."""
    rounds = req.accepted_per_round
    assert req.drafts_per_round == [k] * len(rounds)
    assert req.round_starts == [start for start, _ in _round_spans(req)]
    st = req.stats()
    assert st["mean_acceptance_length"] == pytest.approx((sum(rounds) + len(rounds)) / len(rounds))
    # every round emits n+1 tokens; the last may be cut by max_new_tokens / a stop id
    emitted = 1 + sum(n + 1 for n in rounds)
    assert emitted - rounds[-1] <= len(req.output) <= emitted


def _round_spans(req) -> list[tuple[int, int]]:
    """(index in req.output of the round's first emitted token, n accepted) per round (output[0] is the prefill's)."""
    spans, start = [], 1
    for n in req.accepted_per_round:
        spans.append((start, n))
        start += n + 1
    return spans


# ----------------------------------------------------------------------------------------------------------------------
# 1. Greedy speculative == greedy non-speculative
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,k,cache_dtype,quantization", SPEC_CASES,
                         ids=[f"{f}-{k}" + (f"-kv-{c}" if c else "") + (f"-w-{q}" if q else "")
                              for f, k, c, q in SPEC_CASES])
def test_greedy_speculative_equals_plain(family, k, cache_dtype, quantization, engines):
    """8 prompts (3..30 tokens) plus a speculative=False request and a sampled request, all through one continuous
    batch (more requests than slots: they join and leave), then the 30-token prompt twice more, the second time
    with its first 7 pages from the prefix cache: every greedy output equals the plain engine's token for token (with
    an fp8 cache, the plain engine's with that cache: the verify writes the K/V the decode step writes, both read
    them with the same scales, and shared float8 pages are the pages the repeat would write; with fp8 weights, the
    plain engine's with the same weights, activations float32 in both); the rounds mix 0, partial and full
    acceptance; stats are consistent; nothing compiles while serving; every page and slot comes back."""
    from gemma4_mtp_jax.model.sampling import SamplingParams
    from testenv import compilations

    eng = engines(family, k, cache_dtype=cache_dtype, quantization=quantization)
    prompts = _prompts(10, LENGTHS)
    off = _prompts(11, [11])[0]
    want = greedy_reference(engines, family, prompts + [off], MAX_NEW, cache_dtype, quantization)
    with compilations() as compiles:
        reqs = [eng.add_request(p, MAX_NEW) for p in prompts]
        reqs.insert(3, eng.add_request(off, MAX_NEW, speculative=False))
        sampled = eng.add_request(prompts[4], MAX_NEW, SamplingParams(temperature=1.0, seed=5))
        eng.run()
        repeats = []
        for _ in range(2):  # the first puts its pages in the cache (the others' may have evicted its window's)
            hits = eng.kv.hits
            repeats.append(eng.add_request(prompts[7], MAX_NEW))
            eng.run()
    assert compiles == [], f"the speculative engine compiled {len(compiles)} programs while serving"
    assert [r.output for r in repeats] == [want[7]] * 2
    assert eng.kv.hits - hits == 7 * eng.config.page_size, eng.kv.hits - hits
    outs = [r.output for r in reqs]
    assert outs == want[:3] + [want[8]] + want[3:8], [
        (len(r.prompt), i) for i, (r, w) in enumerate(zip(reqs, want[:3] + [want[8]] + want[3:8])) if r.output != w]
    for r in reqs:
        assert r.finish_reason == "length" and len(r.output) == MAX_NEW
    assert reqs[3].accepted_per_round == [] and reqs[3].num_drafted == 0  # speculation off for that request
    spec = [r for r in reqs if r.speculative]
    for r in spec + [sampled]:
        _check_round_stats(r, k)
    rounds = [n for r in spec for n in r.accepted_per_round]
    hist = np.bincount(rounds, minlength=k + 1)
    assert hist[0] > 0 and hist[k] > 0, f"acceptance histogram {hist.tolist()}: the test would prove little"
    if k > 1:
        assert hist[1:k].sum() > 0, f"no partial acceptance: {hist.tolist()}"
    assert len({t for w in want for t in w}) > 20, "degenerate references: the test would prove little"
    assert all(0 <= t < hf_tiny.VOCAB for t in sampled.output) and len(sampled.output) == MAX_NEW
    assert all(n == 0 for n in eng.pages_in_use().values()), eng.pages_in_use()
    assert sorted(eng.kv.free_slots) == list(range(eng.config.max_num_seqs)) and not eng.scheduler.running
    if k < K or quantization is not None:  # taken by no later test
        engines.drop(family, k, cache_dtype=cache_dtype, quantization=quantization)
    if cache_dtype is not None or quantization is not None:  # the plain reference of that cache or those weights
        engines.drop(family, cache_dtype=cache_dtype, quantization=quantization)


def test_round_size_chosen_per_step(engines, monkeypatch):
    """adaptive_speculation (k = 2): the round sizes 0, 1 and 2 compile, the first bucket's k alone before the engine
    returns and the others in the background, and each is timed once compiled. Whatever size each step takes, greedy
    outputs are the plain engine's token for token (a 0-draft round keeps the drafter's h for the next round), and
    a sampled request runs through every size's sampled programs; each request's rounds are recorded with their
    size and where in the output they began. On its own, the policy drafts where drafts pay, and a batch where no
    row speculates takes 0-draft rounds."""
    import itertools

    from gemma4_mtp_jax.model.sampling import SamplingParams

    eng = engines("e2b", 2, adaptive=True)
    programs, policy = eng.programs, eng.speculation
    assert programs.first_round_sizes() == (2,) and programs.wait(timeout=900)
    assert programs.round_sizes(2) == (0, 1, 2)
    prompts = _prompts(12, [4, 9, 17, 26])
    want = greedy_reference(engines, "e2b", prompts, MAX_NEW)

    forced, taken = itertools.cycle([2, 0, 1, 0, 0, 2, 1, 2]), []
    monkeypatch.setattr(policy, "_choose", lambda batch, rows, sizes: taken.append(next(forced)) or taken[-1])
    reqs = [eng.add_request(p, MAX_NEW) for p in prompts]
    sampled = eng.add_request(prompts[1], MAX_NEW, SamplingParams(temperature=1.0, seed=3))
    eng.run()
    assert [r.output for r in reqs] == want
    assert set(taken) == {0, 1, 2} and policy.chosen == {k: taken.count(k) for k in (0, 1, 2)}
    assert set(policy.costs) == {(2, 0), (2, 1), (2, 2)}
    for r in reqs + [sampled]:
        assert set(r.drafts_per_round) == {1, 2} and len(r.output) == MAX_NEW
        assert r.round_starts == sorted(set(r.round_starts)) and r.round_starts[0] >= 1
        st = r.stats()
        assert st["drafted_per_position"] == [len(r.drafts_per_round), r.drafts_per_round.count(2)]
        assert st["acceptance_by_output_position"]["0-127"]["rounds"] == len(r.drafts_per_round)

    # A 0-draft round keeps the drafter's h: after two, a slot holds the target's hidden at the position of the
    # token the second one verified, as a prefill up to there leaves it (steps read one at a time here).
    from gemma4_mtp_jax import target_forward

    monkeypatch.setattr(policy, "_choose", lambda batch, rows, sizes: 0)
    monkeypatch.setattr(eng.config, "async_scheduling", False)
    req = eng.add_request(prompts[2], MAX_NEW)
    while len(req.output) < 3:
        eng.step()
    assert req.drafts_per_round == []
    tokens = np.asarray([prompts[2] + req.output[:2]], np.int32)
    want_h = np.asarray(target_forward(eng.target, tokens).hidden[0, -1])
    assert_close("h after 0-draft rounds", eng.state.hidden[eng.kv.seq(req).slot], want_h)
    eng.cancel(req)
    eng.run()
    monkeypatch.undo()

    # Made-up costs where a 2-draft round costs 10 % more than a 0-draft one: the tiny pair's drafts pay.
    policy.costs, policy.chosen = {(2, 0): 1.0, (2, 1): 1.05, (2, 2): 1.1}, {}
    reqs = [eng.add_request(p, MAX_NEW) for p in prompts[:2]]
    eng.run()
    assert [r.output for r in reqs] == want[:2]
    assert policy.chosen.get(2, 0) > 0.8 * sum(policy.chosen.values()), policy.chosen
    assert not np.allclose(policy.overall_rates(), policy.PRIOR)
    policy.chosen = {}
    reqs = [eng.add_request(p, MAX_NEW, speculative=False) for p in prompts[2:]]
    eng.run()
    assert [r.output for r in reqs] == want[2:] and policy.chosen == {0: policy.chosen[0]}
    assert all(r.drafts_per_round == [] for r in reqs)
    engines.drop("e2b", 2, adaptive=True)


def test_preempted_speculative_sequences_resume_exactly(engines, tiny_ckpts, jax_models):
    """A speculative engine whose full-layer pool cannot hold every sequence's growth: the newest are preempted
    (pages and drafter slot freed) and resume by recomputing their K/V and the drafter's h; every greedy output
    equals the plain engine's, and every page and slot comes back."""
    from gemma4_mtp_jax.engine import Engine

    p = tiny_ckpts["e2b"]
    eng = Engine(jax_models.target(p["target"]), _config(num_speculative_tokens=K, max_model_len=64,
                                                         num_pages={F: 26, S: 25}, compile_at_start=False),
                 assistant=jax_models.assistant(p["assistant"]))
    prompts = _prompts(12, [7, 19, 12, 25])
    want = greedy_reference(engines, "e2b", prompts, MAX_NEW)
    reqs = [eng.add_request(q, MAX_NEW) for q in prompts]
    eng.run()
    assert [r.output for r in reqs] == want
    assert eng.scheduler.num_preemptions > 0 and reqs[0].num_preemptions == 0
    for r in reqs:
        _check_round_stats(r, K)
    assert all(n == 0 for n in eng.pages_in_use().values()), eng.pages_in_use()
    assert sorted(eng.kv.free_slots) == list(range(eng.config.max_num_seqs)) and not eng.scheduler.running


def test_greedy_speculative_equals_plain_bf16(tiny_ckpts, jax_models):
    """bfloat16, the dtype served: e2b's greedy speculative engine (k = 4) against the plain engine on test 1's 8
    prompts, each engine compiling one batch bucket and one prefill bucket. The outputs are equal, except where
    bf16 rounding can flip a near-tie between the two programs, which compute the same logits in differently shaped
    forwards (decode: 1 token, verify: k+1): at each first divergence, plain's token and the speculative one must
    both lie within the two programs' rounding of the top logit there (`_assert_near_ties`); a divergence outside
    that bound, or in the token after the prefill (the same program in both), fails. On the CPU these prompts give
    no divergence (nor did 24 prompts of 32 tokens on e2b k=2, a26b k=4 and b31b k=4): there the equality is the
    check."""
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.generate import generate

    p = tiny_ckpts["e2b"]
    target = jax_models.target(p["target"], dtype="bfloat16")
    one_bucket = dict(max_num_seqs=8, min_batch_bucket=8, min_prefill_bucket=8, compile_at_start=False)
    plain = Engine(target, _config(**one_bucket))
    spec = Engine(target, _config(num_speculative_tokens=K, **one_bucket),
                  assistant=jax_models.assistant(p["assistant"], dtype="bfloat16"))
    assert plain.cache_dtype == spec.cache_dtype == jnp.bfloat16
    prompts = _prompts(10, LENGTHS)
    want = [r.tokens for r in generate(target, prompts, MAX_NEW, engine=plain)]
    results = generate(target, prompts, MAX_NEW, engine=spec)
    got = [r.tokens for r in results]
    hist = np.bincount([n for r in results for n in r.stats["accepted_per_round"]], minlength=K + 1)
    assert hist[0] > 0 and hist[1:K].sum() > 0 and hist[K] > 0, f"acceptance histogram {hist.tolist()}"
    assert all(len(w) == len(g) == MAX_NEW for w, g in zip(want, got))
    first = {i: next(j for j, (a, b) in enumerate(zip(w, g)) if a != b)
             for i, (w, g) in enumerate(zip(want, got)) if w != g}
    if first:
        _assert_near_ties(plain, K, prompts, want, got, first)


def _forward_fn(spec):
    """(params, pages, tokens [B, T], positions [B, T], tables) -> (logits [B, T, V], pages): the target forward of
    the programs of `spec` (a StepSpec: forward_paged + lm_logits) in its target's dtype and its layout, jitted (one
    program per T)."""
    from gemma4_mtp_jax.steps.forward import forward_paged, lm_logits

    def fn(params, pages, toks, positions, tables):
        h, pages = forward_paged(spec, params, pages, toks, positions, tables)
        return lm_logits(spec.target, params, h), pages

    return jax.jit(fn)


def _shaped_logits(spec, cache_dtype, fn, tokens: list[int], start: int, width: int, chunk: int) -> np.ndarray:
    """The target's logits (in its dtype, as float32) predicting tokens[start+1:], computed the way a program that
    runs `width` tokens per forward does: on a fresh pool of spec's layout in `cache_dtype`, the K/V of
    tokens[:start] written `chunk` tokens at a time, then tokens[start:-1] fed `width` tokens at a time to `fn`
    (`_forward_fn(spec)`; width 1: the decode program's shape; k+1: the verify's, every draft accepted). Row r
    predicts tokens[start+1+r]."""
    from gemma4_mtp_jax.model.kv_state import init_pages

    pages = init_pages(spec.target.config, spec.layout, cache_dtype)
    tables = {g: np.arange(1, w + 1, dtype=np.int32)[None] for g, w in spec.layout.pages_per_seq}
    rows = []
    for lo, hi, w in [(0, start, chunk), (start, len(tokens) - 1, width)]:
        for s in range(lo, hi, w):
            n = min(w, hi - s)
            toks, positions = np.zeros((1, w), np.int32), np.full((1, w), -1, np.int32)
            toks[0, :n], positions[0, :n] = tokens[s:s + n], np.arange(s, s + n)
            logits, pages = fn(spec.target.params, pages, toks, positions, tables)
            if lo == start:
                rows.append(np.asarray(logits[0, :n], np.float32))
    return np.concatenate(rows)


def _assert_near_ties(eng, k: int, prompts, plain_out, spec_out, first: dict[int, int]) -> None:
    """Each first divergence (prompt i, output index first[i]) is a near-tie that bf16 rounding can flip. The two
    programs' computations are replayed along the plain output (`_shaped_logits`: decode-shaped, 1 token a forward;
    verify-shaped, k+1), and `spread` is their largest |logit difference| at every position but the divergent ones
    (measured elsewhere, so not circular). Two programs whose logits differ by <= spread per token can only pick
    tokens within 2 * spread of each other's top logit: at a divergence, plain's token and the speculative one must
    both lie within 2 * spread of the top of the decode-shaped logits (plain's top-2 gap, where the replay picks
    plain's token, as it does on the CPU)."""
    assert 0 not in first.values(), f"prompts {[i for i, j in first.items() if j == 0]}: the prefill's token differs"
    spec = eng.steps.spec
    fn, decode, verify = _forward_fn(spec), {}, {}
    for i, prompt in enumerate(prompts):
        tokens = list(prompt) + list(plain_out[i])
        # row r predicts plain_out[i][r + 1]
        decode[i] = _shaped_logits(spec, eng.cache_dtype, fn, tokens, len(prompt), 1, k + 1)
        verify[i] = _shaped_logits(spec, eng.cache_dtype, fn, tokens, len(prompt), k + 1, k + 1)
    elsewhere = [np.delete(np.abs(decode[i] - verify[i]).max(-1), [first[i] - 1] if i in first else [])
                 for i in decode]
    spread = float(np.concatenate(elsewhere).max())
    for i, j in first.items():
        z, a, b = decode[i][j - 1], spec_out[i][j], plain_out[i][j]
        lead = float(z.max() - min(z[a], z[b]))
        assert lead <= 2 * spread, (
            f"prompt {i}, token {j}: plain {b} (logit {z[b]:.4g}), speculative {a} ({z[a]:.4g}), top "
            f"{int(z.argmax())} ({z.max():.4g}): {lead:.4g} apart, beyond the programs' rounding (2 x {spread:.3g})")


# ----------------------------------------------------------------------------------------------------------------------
# Helpers: an engine's state right after a prefill, and the draft loop jitted on it
# ----------------------------------------------------------------------------------------------------------------------
def _prefill_only(eng, prompt):
    """Admit + prefill one request on an idle engine; returns (request, bonus token). Release with _release."""
    assert not eng.has_work
    req = eng.add_request(prompt, 8)
    assert eng.scheduler.admit(eng.config.max_num_seqs, []) == [req]
    # the packed result's first column: the token
    return req, int(eng.runner.prefill(req, eng.runner.row(req), None)[1][0])


def _release(eng, req):
    eng.cancel(req)
    assert all(n == 0 for n in eng.pages_in_use().values())


def _draft_fn(eng, k: int):
    """speculative.draft jitted on an engine's target/assistant/layout, q over the whole vocabulary (traced anew per
    call site: monkeypatches of the module taken at trace time are honoured)."""
    from gemma4_mtp_jax.steps import speculative
    from gemma4_mtp_jax.steps.device_state import StepInputs
    from gemma4_mtp_jax.steps.forward import StepSpec

    spec = StepSpec(eng.target, eng.layout, eng.config.attention_impl, drafter=speculative.AssistantDrafter(
        eng.assistant), k=k)

    def fn(pt, pa, head, pages, tables, rows, hidden, sampling):
        drafts, q, q_ids, hn = speculative.draft(spec, pt, (pa, head), pages, hidden,
                                                 StepInputs(rows, tables, sampling))
        return drafts, speculative.dense_q(q, q_ids, eng.target.config.vocab_size), hn

    return jax.jit(fn)


_DRAFT_FNS = {}


def _run_draft(eng, k, reqs_for_tables, tokens, slots, lengths, sampling=None, fn=None):
    from gemma4_mtp_jax.model.sampling import SamplingBatch, SamplingParams
    from gemma4_mtp_jax.steps.device_state import StepRows
    from gemma4_mtp_jax.steps.speculative import make_draft_head

    B = len(tokens)
    sampling = sampling or SamplingBatch.from_params([SamplingParams()] * B, B)
    if fn is None:
        key = (id(eng), k)
        if key not in _DRAFT_FNS:
            _DRAFT_FNS[key] = _draft_fn(eng, k)
        fn = _DRAFT_FNS[key]
    tables = {g: np.stack([eng.kv.page_table(r)[g] for r in reqs_for_tables]) for g, _ in eng.layout.pages_per_seq}
    rows = StepRows.stack([dict(slot=0, fresh=True, token=t, length=n, remaining=1, stop_ids=-1, speculate=True)
                           for t, n in zip(tokens, lengths)], B)
    return fn(eng.target.params, eng.assistant.params, make_draft_head(eng.assistant), eng.state.pages,
              tables, rows, eng.state.hidden[np.asarray(slots)], sampling)


def _hn_logits(eng, hn):
    """Full-vocabulary draft logits from normed draft hiddens [B, k, Ha] (the module's head, no suppression)."""
    from gemma4_mtp_jax.model.assistant import Gemma4Assistant

    a = eng.assistant
    B, k, Ha = hn.shape
    out = a.module.apply({"params": a.params}, jnp.reshape(hn, (B * k, Ha)), method=Gemma4Assistant.logits)
    return np.asarray(out).reshape(B, k, -1)


# ----------------------------------------------------------------------------------------------------------------------
# 2. First draft round after a prefill == transformers' drafter on the same K/V
# ----------------------------------------------------------------------------------------------------------------------
PARITY_T = 21  # > sliding window (8), > prefill chunk (8): 3 chunks, and the sliding ring (16 slots) wraps


def _parity_mismatch(eng, tiny_ckpts, family, prompt, *, tables_of=None, fn=None, check=True):
    """Draft K tokens from the engine's pages after prefilling `prompt`; compare with hf_draft_steps. Returns the
    worst |logit difference| over the K steps (asserts <= ATOL and equal drafts when `check`)."""
    ref = hf_tiny.hf_draft_steps(tiny_ckpts[family]["target"], tiny_ckpts[family]["assistant"],
                                 np.asarray([prompt]), num_steps=K)
    req, tok = _prefill_only(eng, prompt)
    others = []
    try:
        if tables_of is not None:  # a wrong page table: another sequence's pages
            other = eng.add_request(tables_of, 8)
            assert eng.scheduler.admit(eng.config.max_num_seqs, []) == [other]
            eng.runner.prefill(other, eng.runner.row(other), None)
            others.append(other)
        assert tok == ref[0]["token"], "the engine's first token differs from transformers' bonus token"
        drafts, q, hn = _run_draft(eng, K, others or [req], [tok], [eng.kv.seq(req).slot], [len(prompt)], fn=fn)
        logits = _hn_logits(eng, hn)[0]
        worst = 0.0
        for s, r in enumerate(ref):
            d = np.abs(logits[s] - r["logits"])
            worst = max(worst, float(d.max()))
            if check:
                if family == "e2b":  # centroid head: say whether the selected tokens or the fill differ
                    sel = r["logits"] > r["logits"].min()
                    assert_close(f"{family} step {s + 1} selected logits", logits[s][sel], r["logits"][sel], ATOL)
                assert_close(f"{family} step {s + 1} logits", logits[s], r["logits"], ATOL)
        if check:
            suppress = set(eng.assistant.generation_config.get("suppress_tokens") or [])
            assert not suppress & {r["draft"] for r in ref}, "pick a prompt whose HF drafts avoid suppress_tokens"
            assert np.asarray(drafts)[0].tolist() == [r["draft"] for r in ref]
            assert not np.asarray(q).any(), "greedy rows carry no draft distribution"
        return worst
    finally:
        for o in others:
            eng.cancel(o)
        _release(eng, req)


@pytest.mark.parametrize("family", ["e2b", "b31b"])
def test_first_draft_round_matches_transformers(family, engines, tiny_ckpts):
    """After the engine's chunked prefill of a 21-token prompt, `speculative.draft` on the engine's pages, page
    tables and hidden buffer gives transformers' drafts and logits (<= 1e-4) for all k=4 steps (e2b: centroid head,
    full logits including the fill; b31b: dense head)."""
    eng = engines(family, K)
    prompt = _prompts(20, [PARITY_T])[0]
    _parity_mismatch(eng, tiny_ckpts, family, prompt)


# ----------------------------------------------------------------------------------------------------------------------
# 3. An independent reference loop (dense target_forward + draft_step) gives the engine's accepted counts
# ----------------------------------------------------------------------------------------------------------------------
REF_LEN = 64  # every reference forward is padded to this length (causal: padding never affects earlier positions)


def _reference_loop(target, assistant, prompt, max_new, k):
    """Greedy speculative decoding written plainly: recompute everything from scratch each round. Returns
    (output tokens, accepted drafts per round, {P: (h, draft logits [k, V], drafts)} per round)."""
    from gemma4_mtp_jax import draft_step, target_forward

    suppress = list(assistant.generation_config.get("suppress_tokens") or [])

    def forward(tokens):
        assert len(tokens) <= REF_LEN
        return target_forward(target, np.asarray([list(tokens) + [0] * (REF_LEN - len(tokens))], np.int32))

    first = forward(prompt)
    out = [int(np.argmax(np.asarray(first.logits[0, len(prompt) - 1])))]
    rounds, states = [], {}
    while len(out) < max_new:
        seq = list(prompt) + out
        P = len(seq) - 1  # committed tokens; seq[P] is the newest (the bonus token)
        committed = forward(seq[:P])
        h = committed.hidden[:, P - 1]  # the target's post-norm hidden at P-1
        tok, drafts, logits = seq[P], [], []
        state_h = np.asarray(h[0])
        for _ in range(k):
            d = draft_step(assistant, target, [tok], h, committed.store_kv, [P])
            lg = np.array(d.logits[0])
            logits.append(lg.copy())
            lg[suppress] = -np.inf
            tok = int(np.argmax(lg))
            drafts.append(tok)
            h = d.h_next
        states[P] = (state_h, np.stack(logits), drafts)
        verify = np.asarray(forward(seq + drafts).logits[0, P:P + k + 1]).argmax(-1)
        n = 0
        while n < k and drafts[n] == verify[n]:
            n += 1
        out += drafts[:n] + [int(verify[n])]
        rounds.append(n)
    return out[:max_new], rounds, states


@pytest.mark.parametrize("family", FAMILIES)
def test_accepted_per_round_matches_reference_loop(family, engines):
    """The engine (3 prompts batched, stepped round by round) against a plain reference loop: same output, same
    accepted count in every round; and before every round, the engine's stored h (the target's hidden at P-1) and
    the drafter's logits and drafts on the engine's live pages equal the reference's (<= 1e-4). The last part is
    what catches a wrong next-round h or K/V: the tiny drafters' argmax barely depends on them."""
    eng = engines(family, K)
    prompts = _prompts(30, [5, 14, 27])
    reqs = [eng.add_request(p, MAX_NEW) for p in prompts]
    live = {r.id: {} for r in reqs}  # request -> {P: (h row, draft logits [k, V], drafts)} before each round
    eng.config.async_scheduling = False  # each step read before the next: the device state is the host's view
    try:
        while eng.has_work:
            eng.step()
            for r in eng.scheduler.running:
                if r.output:
                    P = len(r.prompt) + len(r.output) - 1
                    drafts, _, hn = _run_draft(eng, K, [r], [r.output[-1]], [eng.kv.seq(r).slot], [P])
                    live[r.id][P] = (np.asarray(eng.state.hidden[eng.kv.seq(r).slot]), _hn_logits(eng, hn)[0],
                                     np.asarray(drafts)[0].tolist())
    finally:
        eng.config.async_scheduling = True
    total = []
    for p, r in zip(prompts, reqs):
        out, rounds, states = _reference_loop(eng.target, eng.assistant, p, MAX_NEW, K)
        assert r.output == out, f"prompt of {len(p)} tokens: output differs from the reference loop"
        assert r.accepted_per_round == rounds, f"prompt of {len(p)} tokens: accepted per round differs"
        assert sorted(live[r.id]) == sorted(states), "the engine's rounds start at other positions"
        for P, (h, logits, drafts) in states.items():
            got_h, got_logits, got_drafts = live[r.id][P]
            assert_close(f"{family} len {len(p)} P={P}: stored h", got_h, h, ATOL)
            assert_close(f"{family} len {len(p)} P={P}: draft logits", got_logits, logits, ATOL)
            assert got_drafts == drafts, f"{family} len {len(p)} P={P}"
        total += rounds
    assert 0 < sum(total) < K * len(total), "all-or-nothing acceptance: the comparison would prove little"


# ----------------------------------------------------------------------------------------------------------------------
# 4. Rejection sampling (speculative.accept): the exact law of a round's output, Monte Carlo
# ----------------------------------------------------------------------------------------------------------------------
# With drafts d_j ~ q_j and the target's distributions p_0..p_k (filtered at the request's temperature, top-k, top-p),
# a round accepts d_1..d_n and then emits the token drawn after rejecting d_{n+1} (n < k) or the bonus (n = k). The
# law of that output is known exactly: P(n, t_1..t_{n+1}) = prod_{i<n} min(p_i, q_i)(t_i) times
# max(p_n - q_n, 0)(t_{n+1}) if n < k, or p_k(t_{k+1}) if n = k; so every emitted token follows the target,
# t_{j+1} | (n >= j, t_1..t_j) ~ p_j, the bonus included. The tests compare the observed outputs with that law by
# chi-square goodness of fit; a check fails below P_MIN. The seeds are fixed, so each check is deterministic.
MC_ROWS = 20000
P_MIN = 1e-4
# name: (vocabulary, k, candidates per draft step (None: q dense over the vocabulary), temperature, top-k, top-p)
MC_CASES = {
    "V12-k0": (12, 0, None, 1.0, 0, 1.0),  # a round of no draft: the token from p alone
    "V12-k1": (12, 1, None, 1.0, 0, 1.0),
    "V16-k2-sparse6": (16, 2, 6, 1.0, 0, 1.0),
    "V24-k2-filtered": (24, 2, None, 0.7, 8, 0.9),
    "V40-k4": (40, 4, None, 1.0, 0, 1.0),
    "V40-k3-sparse12-filtered": (40, 3, 12, 1.0, 10, 0.9),
}


@dataclasses.dataclass(frozen=True)
class _MCCase:
    target_logits: np.ndarray  # [k+1, V] float32
    q: np.ndarray  # [k, N] float32: draft step j's distribution over its candidates
    q_ids: np.ndarray | None  # [k, N] int32: the candidates' token ids (distinct); None: N = V, vocabulary order
    temperature: float
    top_k: int
    top_p: float

    @property
    def k(self) -> int:
        return self.q.shape[0]

    @property
    def vocab(self) -> int:
        return self.target_logits.shape[1]

    def dense_q(self) -> np.ndarray:
        """q over the vocabulary [k, V], float64."""
        if self.q_ids is None:
            return self.q.astype(np.float64)
        out = np.zeros((self.k, self.vocab))
        out[np.arange(self.k)[:, None], self.q_ids] = self.q
        return out


def _mc_case(name: str, seed: int = 0) -> _MCCase:
    """MC_CASES[name] drawn at random. q_j is the target's step-j distribution at perturbed logits (temperature 1,
    unfiltered), close enough to p that every position, the bonus included, is reached often; a sparse q_j sits on
    n candidates (others at each step) that carry most of the target's mass there, so the tokens outside them are
    common, and reachable only through the residual."""
    V, k, n_cand, temperature, top_k, top_p = MC_CASES[name]
    rng = np.random.default_rng(seed)
    logits = 1.5 * rng.standard_normal((k + 1, V))
    if n_cand is None:
        ids, q_logits = None, logits[:k] + 0.5 * rng.standard_normal((k, V))
    else:
        ids = np.stack([rng.permutation(V)[:n_cand] for _ in range(k)]).astype(np.int32)
        logits[np.arange(k)[:, None], ids] += 2.0
        q_logits = np.take_along_axis(logits[:k], ids, 1) + 0.5 * rng.standard_normal((k, n_cand))
    return _MCCase(logits.astype(np.float32), _softmax(q_logits).astype(np.float32), ids, temperature, top_k, top_p)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _filtered_support(logits, temperature, top_k, top_p):
    """Numpy: the tokens the target's filter keeps (top-k, then the top-p nucleus) at a temperature."""
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    pr = _softmax(x[order])
    before = np.cumsum(pr) - pr
    keep = order[(before < top_p) | (np.arange(len(order)) == 0)]
    return set(keep.tolist())


def _filtered_probs(logits, temperature, top_k=0, top_p=1.0):
    """Numpy, float64: the distribution `sampling.sample` draws from at these settings."""
    x = np.asarray(logits, np.float64)
    mask = np.full(x.shape, -np.inf)
    mask[sorted(_filtered_support(x, temperature, top_k, top_p))] = 0.0
    return _softmax(x / temperature + mask)


def _mc_law(case: _MCCase):
    """(p [k+1, V]; acc [k, V]: P(draft j is x and is accepted); res [k, V]: P(draft j is rejected and x is drawn
    instead)), from the definitions, in float64."""
    p = np.stack([_filtered_probs(lg, case.temperature, case.top_k, case.top_p) for lg in case.target_logits])
    q = case.dense_q()
    return p, np.minimum(p[:-1], q), np.maximum(p[:-1] - q, 0.0)


def _chi2(observed, expected) -> tuple[float, int]:
    """(chi-square statistic, degrees of freedom) of counts against expected counts of the same total. Cells expected
    below 5 are pooled into one, itself merged into the smallest other cell while below 5. An observed count in a
    cell of expected count 0 gives an infinite statistic."""
    o, e = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    if (o[e <= 0] > 0).any():
        return float("inf"), 1
    small = e < 5
    o, e = np.append(o[~small], o[small].sum()), np.append(e[~small], e[small].sum())
    if e[-1] < 5 and len(e) > 1:
        i = int(np.argmin(e[:-1]))
        o[i], e[i] = o[i] + o[-1], e[i] + e[-1]
        o, e = o[:-1], e[:-1]
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def _pvalue(stat: float, df: int) -> float:
    from scipy.stats import chi2

    return 1.0 if df == 0 else float(chi2.sf(stat, df))


def _gof(counts, probs) -> float:
    """p-value of counts over categories against a distribution over them."""
    counts = np.asarray(counts)
    return _pvalue(*_chi2(counts, counts.sum() * np.asarray(probs, np.float64)))


@functools.cache
def _jit(fn):
    return jax.jit(fn)


def _mc_drafts(case: _MCCase, n_rows: int, seed: int = 0) -> np.ndarray:
    """Drafts d_j ~ q_j [n_rows, k] (numpy, one row per sample)."""
    k, N = case.q.shape
    u = np.random.default_rng(seed).random((n_rows, k))
    pick = np.minimum((u[..., None] > np.cumsum(case.q, -1)).sum(-1), N - 1)
    return (pick if case.q_ids is None else case.q_ids[np.arange(k), pick]).astype(np.int32)


def _run_accept(accept_fn, case: _MCCase, drafts: np.ndarray, seeds) -> tuple[np.ndarray, np.ndarray]:
    """accept on rows in the same state but their drafts and seeds (an int: seeds from it on). Returns (emitted
    [R, k+1], n [R])."""
    from gemma4_mtp_jax.model.sampling import SamplingBatch

    R, (k, N) = len(drafts), case.q.shape
    seeds = seeds + np.arange(R) if np.isscalar(seeds) else np.asarray(seeds)
    sampling = SamplingBatch(np.full(R, case.temperature, np.float32), np.full(R, case.top_k, np.int32),
                             np.full(R, case.top_p, np.float32), seeds.astype(np.uint32))
    q_ids = None if case.q_ids is None else np.broadcast_to(case.q_ids, (R, k, N))
    emitted, n = _jit(accept_fn)(drafts, np.broadcast_to(case.q, (R, k, N)), q_ids,
                                 np.broadcast_to(case.target_logits, (R,) + case.target_logits.shape), sampling,
                                 np.ones(R, bool), np.full(R, 17, np.int32))
    return np.asarray(emitted), np.asarray(n)


def _check_layout(drafts, emitted, n) -> None:
    """emitted holds the n accepted drafts, then one token, then -1."""
    k = drafts.shape[1]
    j = np.arange(k + 1)[None, :]
    assert ((n >= 0) & (n <= k)).all()
    assert ((emitted >= 0) == (j <= n[:, None])).all(), "emitted tokens must stop right after the n+1-th"
    assert (np.where(j[:, :k] < n[:, None], emitted[:, :k] == drafts, True)).all(), "accepted tokens must be drafts"


def _round_law_pvalues(case: _MCCase, emitted, n) -> dict[str, float]:
    """p-values of the observed outputs against the exact law (above), check by check:
      position j+1 (j < k): among rows that accepted d_1..d_j, the outcome at j+1 over 2V categories (d_{j+1} = x
        accepted: min(p_j, q_j)(x); d_{j+1} rejected and x drawn: max(p_j - q_j, 0)(x));
      bonus: among rows that accepted all k drafts, the token after them (p_k);
      accepted count: the law of n (prod_{i<n} a_i (1 - a_n), a_i = sum min(p_i, q_i));
      emitted prefixes: the joint law of (n, t_1..t_{n+1}) over every outcome expected >= 5 times (the rest pooled),
        which also sees dependence between positions that the marginals above cannot."""
    p, acc, res = _mc_law(case)
    k, V = case.k, case.vocab
    out = {}
    for j in range(k + 1):
        reached = n >= j
        tok = emitted[reached, j]
        if j < k:
            cat = np.where(n[reached] > j, tok, V + tok)
            out[f"position {j + 1}"] = _gof(np.bincount(cat, minlength=2 * V), np.concatenate([acc[j], res[j]]))
        else:
            out["bonus"] = _gof(np.bincount(tok, minlength=V), p[k])
    a = acc.sum(-1)
    reach = np.concatenate([[1.0], np.cumprod(a)])  # P(n >= j)
    out["accepted count"] = _gof(np.bincount(n, minlength=k + 1), reach * np.append(1.0 - a, 1.0))

    # every outcome expected >= 5 times, by walking the accepted prefixes (an outcome is no likelier than its prefix)
    R = len(n)
    cells = {}

    def walk(prefix: tuple, prob: float, j: int) -> None:
        last = res[j] if j < k else p[k]
        for x in np.flatnonzero(prob * last * R >= 5):
            cells[prefix + (int(x),)] = prob * last[x]
        if j < k:
            for x in np.flatnonzero(prob * acc[j] * R >= 5):
                walk(prefix + (int(x),), prob * acc[j][x], j + 1)

    walk((), 1.0, 0)
    rows = np.arange(R)
    # each row's outcome probability: an observed outcome of probability 0 fails outright
    prob = p[k, emitted[rows, n]]
    if k > 0:
        prob = np.where(n < k, res[np.minimum(n, k - 1), emitted[rows, n]], prob)
    for j in range(k):
        prob = prob * np.where(j < n, acc[j, np.maximum(emitted[:, j], 0)], 1.0)
    counts = dict.fromkeys(cells, 0)
    outcomes = [tuple(e[: m + 1].tolist()) for e, m in zip(emitted, n)]
    for o in outcomes:
        if o in counts:
            counts[o] += 1
    observed = np.array([*counts.values(), R - sum(counts.values())], np.float64)
    expected = R * np.array([*cells.values(), 1.0 - sum(cells.values())])
    out["emitted prefixes"] = 0.0 if (prob <= 0).any() else _pvalue(*_chi2(observed, expected))
    return out


def _mutant(name: str, old: str, new: str):
    """speculative.accept with one source line changed: a deliberately wrong sampler."""
    from gemma4_mtp_jax.steps import speculative

    src = textwrap.dedent(inspect.getsource(speculative.accept))
    assert old in src, f"mutation '{name}': '{old}' no longer appears in speculative.accept; update the test"
    ns = dict(vars(speculative))
    exec(compile(src.replace(old, new), f"<accept mutant {name}>", "exec"), ns)  # noqa: S102
    return ns["accept"]


# name: (line of accept, its wrong version, the MC case that must catch it)
MUTANTS = {
    "residual from p": ("residual = jnp.maximum(p_n - q_n, 0.0)", "residual = p_n", "V12-k1"),
    "accept every draft": ("ok = u * q_d < p_d", "ok = u * q_d < jnp.inf", "V12-k1"),
    "ratio inverted": ("ok = u * q_d < p_d", "ok = u * p_d < q_d", "V12-k1"),
    # the bonus after full acceptance drawn from max(p_k - q_{k-1}, 0) instead of p_k
    "bonus from a residual": ("q_n = jnp.where((spec_on & (n < k))[:, None], q_m, 0.0)",
                              "q_n = jnp.where(spec_on[:, None], q_m, 0.0)", "V12-k1"),
    # one uniform for all k acceptance tests of a row: correlated acceptances
    "one uniform per round": ("jax.random.uniform(key, (k,))", "jnp.repeat(jax.random.uniform(key, (1,)), k)",
                              "V16-k2-sparse6"),
    # sparse q (q_ids): the draft's q read at another draft step's candidates
    "sparse q_d at another step's ids": ("q_d = q_at(q, q_ids, drafts)",
                                         "q_d = q_at(q, None if q_ids is None else jnp.roll(q_ids, 1, 1), drafts)",
                                         "V16-k2-sparse6"),
    # sparse q (q_ids): the residual's q scattered to the wrong candidates
    "sparse residual at wrong ids": ("None if q_ids is None else q_ids[rows, m]",
                                     "None if q_ids is None else q_ids[rows, m][:, ::-1]", "V16-k2-sparse6"),
}


@pytest.mark.parametrize("name", sorted(MC_CASES))
def test_rejection_sampling_follows_the_exact_law(name):
    """accept() over MC_ROWS rows in one state (drafts sampled from q in numpy), dense or sparse q (candidate ids, the
    centroid head's), with and without a top-k/top-p filter: the layout of `emitted`, and every check of
    `_round_law_pvalues` (each emitted position, the bonus, n, the joint law) at p >= 1e-4. The case is built so
    that each check sees thousands of rows: every n from 0 to k occurs in >= 5% of them."""
    from gemma4_mtp_jax.steps.speculative import accept

    case = _mc_case(name)
    drafts = _mc_drafts(case, MC_ROWS)
    emitted, n = _run_accept(accept, case, drafts, 0)
    _check_layout(drafts, emitted, n)
    p, _, _ = _mc_law(case)
    hist = np.bincount(n, minlength=case.k + 1) / MC_ROWS
    assert hist.min() > 0.05, f"n is rarely {hist.argmin()}: {hist.round(3).tolist()}"
    if case.top_k or case.top_p < 1:
        assert all(1 < (row > 0).sum() < case.vocab for row in p), "the filter should cut, and keep > 1 token"
        assert (case.dense_q()[0] * (p[0] == 0)).sum() > 0.15, "drafts outside the filtered support should be common"
    if case.q_ids is not None:
        outside = np.ones(case.vocab, bool)
        outside[case.q_ids[0]] = False
        assert p[0, outside].sum() > 0.1, "tokens outside the candidates should be common"
    pv = _round_law_pvalues(case, emitted, n)
    assert len(pv) == case.k + 3
    bad = {c: v for c, v in pv.items() if not v >= P_MIN}
    assert not bad, f"{name}: checks below p = {P_MIN}: {bad}"


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_rejection_sampling_test_catches_wrong_samplers(mutant):
    """The same checks fail far beyond P_MIN (p < 1e-12) for deliberately wrong samplers (one source line of accept
    changed), each on the case that exercises its line."""
    old, new, name = MUTANTS[mutant]
    case = _mc_case(name)
    drafts = _mc_drafts(case, MC_ROWS)
    emitted, n = _run_accept(_mutant(mutant, old, new), case, drafts, 0)
    _check_layout(drafts, emitted, n)
    pv = _round_law_pvalues(case, emitted, n)
    worst = min(pv, key=pv.get)
    assert pv[worst] < 1e-12, f"{mutant}: the worst check ({worst}) has p = {pv[worst]:.2g}; the test is blind to it"


def test_rejection_sampling_reproducible_and_row_independent():
    """Same drafts and seeds, same outputs; other seeds, other outputs; and a row's output depends on its own draft,
    seed and position only: not on where it sits in the batch, nor on the other rows' seeds. (MC_ROWS rows of a
    case the law test runs: the same compiled program.)"""
    from gemma4_mtp_jax.steps.speculative import accept

    case = _mc_case("V16-k2-sparse6")
    drafts, seeds = _mc_drafts(case, MC_ROWS, seed=4), 1000 + np.arange(MC_ROWS)
    a, b = _run_accept(accept, case, drafts, seeds), _run_accept(accept, case, drafts, seeds)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = _run_accept(accept, case, drafts, seeds + MC_ROWS)
    assert (c[0] != a[0]).any(-1).mean() > 0.2
    flipped = _run_accept(accept, case, drafts[::-1], seeds[::-1])
    assert all(np.array_equal(x[::-1], y) for x, y in zip(a, flipped))
    half = MC_ROWS // 2
    mixed = _run_accept(accept, case, drafts, np.concatenate([seeds[:half], seeds[half:] + MC_ROWS]))
    assert all(np.array_equal(x[:half], y[:half]) for x, y in zip(a, mixed))


# ----------------------------------------------------------------------------------------------------------------------
# 5. Sampled decoding end to end, and suppress_tokens in the drafter
# ----------------------------------------------------------------------------------------------------------------------
def test_sampled_speculative_end_to_end(engines):
    """Temperature > 0 through the speculative step: seeded runs are reproducible whatever the batch around them,
    tokens stay in the vocabulary, drafts get accepted; with top_k=1 sampling must reproduce greedy exactly (same
    output and same accepted counts per round: p and q are one-hot, so acceptance is exact)."""
    from gemma4_mtp_jax.generate import generate
    from gemma4_mtp_jax.model.sampling import SamplingParams

    eng = engines("e2b", K)
    prompts = _prompts(40, [7, 12, 20])
    sp = [SamplingParams(temperature=1.0, top_p=0.95, seed=11), SamplingParams(temperature=0.8, top_k=20, seed=12),
          SamplingParams(temperature=1.3, seed=13)]
    a = generate(eng.target, prompts, 20, sp, engine=eng)
    b = generate(eng.target, prompts[::-1], 20, sp[::-1], engine=eng)
    c = generate(eng.target, prompts[:1], 20, sp[:1], engine=eng)
    assert [r.tokens for r in a] == [r.tokens for r in b[::-1]]
    assert a[0].tokens == c[0].tokens
    assert [r.stats["accepted_per_round"] for r in a] == [r.stats["accepted_per_round"] for r in b[::-1]]
    for r in a:
        assert len(r.tokens) == 20 and all(0 <= t < hf_tiny.VOCAB for t in r.tokens)
    assert sum(r.stats["accepted"] for r in a) > 0, "no sampled draft was ever accepted"
    d = generate(eng.target, prompts[:1], 20, [SamplingParams(temperature=1.0, top_p=0.95, seed=99)], engine=eng)
    greedy = generate(eng.target, prompts, 20, engine=eng)
    assert d[0].tokens != a[0].tokens or a[0].tokens != greedy[0].tokens
    one_hot = generate(eng.target, prompts, 20, SamplingParams(temperature=1.0, top_k=1, seed=7), engine=eng)
    for g, o in zip(greedy, one_hot):
        assert o.tokens == g.tokens
        assert o.stats["accepted_per_round"] == g.stats["accepted_per_round"]
    assert all(n == 0 for n in eng.pages_in_use().values())


def test_suppressed_tokens_never_drafted(engines, tiny_ckpts):
    """e2b's assistant suppresses [3, 4, 5, 300]. Its head leans towards repeating the current token, so feeding a
    suppressed token makes the UNSUPPRESSED argmax a suppressed id (checked: the test can fail); the drafts -
    greedy and sampled at a high temperature over many seeds - never contain one, and q gives them no mass."""
    from gemma4_mtp_jax.model.sampling import SamplingBatch

    eng = engines("e2b", K)
    suppress = list(eng.assistant.generation_config["suppress_tokens"])
    assert suppress == hf_tiny.E2B_SUPPRESS_TOKENS
    prompt = _prompts(50, [19])[0]
    req, _ = _prefill_only(eng, prompt)
    try:
        B = 64
        toks = [suppress[i % len(suppress)] for i in range(B)]
        temp = np.where(np.arange(B) < 8, 0.0, 2.0).astype(np.float32)  # 8 greedy rows, 56 sampled
        sampling = SamplingBatch(temp, np.zeros(B, np.int32), np.ones(B, np.float32), np.arange(B, dtype=np.uint32))
        drafts, q, hn = _run_draft(eng, K, [req] * B, toks, [eng.kv.seq(req).slot] * B, [len(prompt)] * B, sampling)
        drafts, q = np.asarray(drafts), np.asarray(q)
        unsuppressed = _hn_logits(eng, hn).argmax(-1)
        assert np.isin(unsuppressed[:, 0], suppress).sum() >= 4, (
            "the unsuppressed head never prefers a suppressed token here: the check below could not fail")
        assert not np.isin(drafts, suppress).any(), np.argwhere(np.isin(drafts, suppress))[:5].tolist()
        assert np.all(q[8:][..., suppress] == 0) and np.allclose(q[8:].sum(-1), 1.0, atol=1e-5)
        assert len(set(drafts[8:, 0].tolist())) > 1, "sampled drafts should vary across seeds"
    finally:
        _release(eng, req)


def _round_on_copies(eng, req, tok: int, P: int, sampling, k: int, processing=None, history=None):
    """The engine's speculative round (`speculative.speculative_step`, its sampled variant, or with `processing`
    rows and `history` its processed variant, on the engine's target, drafter and layout) jitted for B rows that
    each start from `req`'s state after its prefill (P tokens committed, the newest `tok`): the same token, length
    and h, and each its own copy of req's pages, because the verify forward writes K/V at P..P+k.
    Returns (emitted [B, k+1], n [B])."""
    from gemma4_mtp_jax.model.kv_state import NULL_PAGE
    from gemma4_mtp_jax.steps import speculative
    from gemma4_mtp_jax.steps.device_state import StepInputs, StepRows

    B, steps = len(sampling.seed), eng.steps
    table = eng.kv.page_table(req)  # group -> req's page ids [width]
    widths = dict(eng.layout.pages_per_seq)
    layout = dataclasses.replace(eng.layout, num_pages=tuple((g, 1 + B * widths[g]) for g, _ in eng.layout.num_pages))
    tables = {g: 1 + np.arange(B * w, dtype=np.int32).reshape(B, w) for g, w in widths.items()}  # row b: its copies
    pages = {}
    for i, kv in eng.state.pages.items():
        src = np.concatenate([[NULL_PAGE], np.tile(table[eng.target.config.layers[i].layer_type], B)])
        pages[i] = tuple(a[:, src] for a in kv)
    hidden = jnp.repeat(eng.state.hidden[eng.kv.seq(req).slot][None], B + 1, 0)
    spec = steps.spec.but(layout=layout, k=k, sampled=True, processed=processing is not None)
    rows = StepRows.stack([dict(slot=b, fresh=True, token=tok, length=P, remaining=1 << 20, stop_ids=-1,
                                speculate=True) for b in range(B)], B)
    fn = jax.jit(functools.partial(speculative.speculative_step, spec))
    _, _, emitted, n, _, _ = fn(eng.target.params, steps.draft_params, pages, hidden,
                                StepInputs(rows, tables, sampling, processing), history)
    return np.asarray(emitted), np.asarray(n)


def _target_law_pvalues(eng, context, emitted, n, temperature, top_k,
                        process=None) -> tuple[dict[str, float], list]:
    """p-values of a round's emitted tokens against the target's own sampling distribution, position by position:
    token j+1 of rows that accepted their first j drafts, grouped by those j tokens, against p(. | context, the j
    tokens) = softmax(logits / T) over the top-k, the target's logits from `target_forward` (the dense reference
    forward, not the paged verify), processed by `process(logits, tokens before)` if given. Position k+1 is the
    bonus after full acceptance; a token of probability 0 under its p gives p-value 0. Returns (p-values,
    [(logits, p)] of the groups tested)."""
    from gemma4_mtp_jax import target_forward

    k = emitted.shape[1] - 1
    out, dists = {}, []
    for j in range(k + 1):
        reached = np.flatnonzero(n >= j)
        stat, df = 0.0, 0
        groups = {}
        for r in reached:
            groups.setdefault(tuple(emitted[r, :j].tolist()), []).append(r)
        for prefix, rows in groups.items():  # a small group adds no degree of freedom, but a token outside p fails
            seq = list(context) + list(prefix)
            logits = target_forward(eng.target, np.asarray([seq + [0] * (REF_LEN - len(seq))], np.int32)).logits
            logits = np.asarray(logits[0, len(seq) - 1], np.float64)
            if process is not None:
                logits = process(logits, seq)
            p = _filtered_probs(logits, temperature, top_k)
            dists.append((logits, p))
            counts = np.bincount(emitted[rows, j], minlength=len(p))
            s, d = _chi2(counts, len(rows) * p)
            stat, df = stat + s, df + d
        out["bonus" if j == k else f"token {j + 1}"] = _pvalue(stat, df)
    return out, dists


# family: (prompt seed, k): a prompt whose drafts are often accepted at T = 0.7, top-k 8 (measured: e2b accepts the
# first draft in 1200 of 2048 rows; b31b n = 0, 1, 2 in 914, 978, 156). e2b's second draft is seldom accepted on
# any prompt, so its round is k = 1: token 2 is then the bonus after full acceptance in 1200 rows.
E2E = {"e2b": (82, 1), "b31b": (83, 2)}


@pytest.mark.parametrize("family", sorted(E2E))
def test_sampled_round_follows_the_target(family, engines):
    """Sampling is lossless end to end. 2048 rows in the same state (one prefilled sequence, seeds 0..2047,
    temperature 0.7, top-k 8; e2b: the centroid head's sparse q over candidate ids, b31b: a dense head).
    Drafts: each draft is a sample of the q it returns (accept() is exact only then): the first drafts follow q, q is
    the assistant's filtered distribution at that temperature (<= 8 tokens, softmax(logits/T) over them), and among
    rows whose first draft is the most common token, the second drafts follow their (shared) q.
    Round: the engine's speculative program on a copy of the state per row: the accepted tokens are those drafts,
    and every emitted token follows the target's own sampling distribution given the tokens before it
    (`_target_law_pvalues`), the bonus after full acceptance included, at p >= 1e-4."""
    from gemma4_mtp_jax.model.sampling import SamplingBatch, filter_logits

    eng = engines(family, K)
    seed, k = E2E[family]
    prompt = _prompts(seed, [15])[0]
    req, tok = _prefill_only(eng, prompt)
    try:
        B, T, top_k = 2048, 0.7, 8
        sampling = SamplingBatch(np.full(B, T, np.float32), np.full(B, top_k, np.int32), np.ones(B, np.float32),
                                 np.arange(B, dtype=np.uint32))
        drafts, q, hn = _run_draft(eng, 2, [req] * B, [tok] * B, [eng.kv.seq(req).slot] * B, [len(prompt)] * B, sampling)
        drafts, q = np.asarray(drafts), np.asarray(q, np.float64)
        emitted, n = _round_on_copies(eng, req, tok, len(prompt), sampling, k)
    finally:
        _release(eng, req)
    q0 = q[0, 0]
    assert np.allclose(q[:, 0], q0, atol=1e-6), "rows in the same state must share the first draft distribution"
    support = np.flatnonzero(q0 > 0)
    assert 1 < len(support) <= top_k and abs(q0.sum() - 1) < 1e-5
    logits = _hn_logits(eng, np.asarray(hn)[:1, :1])[0, 0].astype(np.float64)
    suppress = list(eng.assistant.generation_config.get("suppress_tokens") or [])
    logits[suppress] = -np.inf
    top = np.argsort(-logits, kind="stable")[:top_k]
    assert set(support) == set(top.tolist())
    want = _softmax(logits[top] / T)
    np.testing.assert_allclose(q0[top], want, atol=1e-5)
    assert _gof(np.bincount(drafts[:, 0], minlength=len(q0)), q0) >= P_MIN
    mode = np.bincount(drafts[:, 0]).argmax()
    rows = np.flatnonzero(drafts[:, 0] == mode)
    assert len(rows) > 300
    q1 = q[rows[0], 1]
    assert np.allclose(q[rows, 1], q1, atol=1e-6)
    assert _gof(np.bincount(drafts[rows, 1], minlength=len(q1)), q1) >= P_MIN

    _check_layout(drafts[:, :k], emitted, n)
    hist = np.bincount(n, minlength=k + 1)
    assert hist.min() >= 100, f"accepted counts {hist.tolist()}: some position would be barely tested"
    pv, dists = _target_law_pvalues(eng, prompt + [tok], emitted, n, T, top_k)
    assert len(dists) > k, "too few groups of rows to test"
    # the distributions compared with are the ones `sampling.sample` draws from on those logits
    for logits, p in dists[:3]:
        np.testing.assert_allclose(np.asarray(jax.nn.softmax(filter_logits(
            jnp.asarray(logits[None] / T, jnp.float32), jnp.array([top_k]), jnp.array([1.0]))))[0], p, atol=1e-6)
    bad = {c: v for c, v in pv.items() if not v >= P_MIN}
    assert not bad, f"{family}: emitted tokens off the target's distribution (p < {P_MIN}): {bad}; all: {pv}"


# ----------------------------------------------------------------------------------------------------------------------
# 6. Drafts equal to the target's: 100% acceptance; 7. EOS inside an accepted run
# ----------------------------------------------------------------------------------------------------------------------
def test_drafts_matching_the_target_are_all_accepted(engines):
    """Drafts equal to the target's own greedy continuation (TargetGreedyDrafter plugged into the engine) are all
    accepted: every round accepts k, mean acceptance length k+1, output = the plain engine's reference."""
    eng = engines("e2b", K, oracle=True)
    prompts = _prompts(60, [4, 11, 19, 26])
    M = 22  # (22 - 1) % 5 != 0: the last round is cut by max_new_tokens inside an accepted run
    refs = greedy_reference(engines, "e2b", prompts, M + K)
    reqs = [eng.add_request(p, M) for p in prompts]
    eng.run()
    for r, ref in zip(reqs, refs):
        assert r.output == ref[:M] and r.finish_reason == "length"
        _check_round_stats(r, K)
        assert r.accepted_per_round == [K] * len(r.accepted_per_round)
        assert r.num_accepted == r.num_drafted
        assert r.stats()["mean_acceptance_length"] == K + 1
    assert all(n == 0 for n in eng.pages_in_use().values())


def _stop_candidates(output, spans, min_accepted=2):
    """Indices i of `output` that are an accepted draft (not the round's last emitted token) in a round accepting
    >= min_accepted, and the first occurrence of their token (so a stop id there stops exactly there)."""
    out = []
    for start, n in spans:
        if n < min_accepted:
            continue
        for i in range(start, start + n):
            if i < len(output) and output[i] not in output[:i]:
                out.append(i)
    return out


def test_eos_inside_accepted_run_cuts_there(engines):
    """A stop id that falls on an accepted draft in the middle of a round ends the output right there (the rest of
    the round's accepted drafts and its bonus token are dropped), finish_reason 'stop' (TargetGreedyDrafter's
    rounds accept k). max_new_tokens falling inside a naturally accepted run cuts there too."""
    eng = engines("e2b", K, oracle=True)
    prompts = _prompts(70, [6, 10, 15, 21, 28])
    refs = greedy_reference(engines, "e2b", prompts, MAX_NEW + K)
    found = None
    for p, ref in zip(prompts, refs):
        spans = [(1 + r * (K + 1), K) for r in range((MAX_NEW - 1) // (K + 1) + 1)]  # every round accepts k
        cands = [i for i in _stop_candidates(ref[:MAX_NEW], spans) if (i - 1) % (K + 1) >= 1]
        if cands:
            found = (p, ref, cands[0])
            break
    assert found, "no prompt has a first-occurrence token in the middle of a round; change the prompts"
    p, ref, i = found
    r = eng.add_request(p, MAX_NEW, stop_ids=frozenset([ref[i]]), request_id="eos")
    eng.run()
    assert r.output == ref[: i + 1] and r.finish_reason == "stop", (i, r.output, ref)
    assert r.accepted_per_round[-1] == K  # the round accepted everything; the output was cut inside it
    assert all(n == 0 for n in eng.pages_in_use().values())

    # natural acceptance (no forcing): max_new_tokens falling inside a round that accepted >= 2 drafts. (A natural
    # stop id there is out of reach: the tiny drafters mostly repeat the current token, so an accepted draft is
    # almost never a token's first occurrence - 1 case in 48 prompts.)
    spec = engines("e2b", K)
    ps = _prompts(10, LENGTHS)
    runs = [spec.add_request(x, MAX_NEW) for x in ps]
    spec.run()
    for x, rq in zip(ps, runs):
        inner = [(start, n) for start, n in _round_spans(rq)[:-1] if n >= 2]
        if inner:
            start, n = inner[0]
            cut = spec.add_request(x, start + 1)  # keep the round's first accepted draft, drop the rest and the bonus
            spec.run()
            assert cut.output == rq.output[: start + 1] and cut.finish_reason == "length"
            assert cut.accepted_per_round == rq.accepted_per_round[: len(cut.accepted_per_round)]
            assert cut.accepted_per_round[-1] == n
            assert all(v == 0 for v in spec.pages_in_use().values())
            return
    pytest.fail("no natural round accepted >= 2 drafts")


# ----------------------------------------------------------------------------------------------------------------------
# 8. The drafter's K/V mapping
# ----------------------------------------------------------------------------------------------------------------------
REAL_STORE = {"e2b": {S: 13, F: 14}, "e4b": {S: 22, F: 23}, "26b": {S: 28, F: 29}, "31b": {S: 58, F: 59}}


@pytest.mark.parametrize("name", sorted(REAL_STORE))
def test_drafter_source_layers_real_configs(name):
    """For the four released configs: each assistant layer reads the target's last non-KV-shared layer of its
    type (the source `speculative.draft` computes), with the same K/V geometry, and check_pair accepts the pair.
    The expected layers are computed here from the raw config too, not only from the table."""
    from benchmarks.common import ASSISTANTS, TARGETS
    from gemma4_mtp_jax.model.config import check_pair, parse_assistant_config, parse_target_config

    raw = TARGETS[name]
    t = parse_target_config(raw)
    a = parse_assistant_config(ASSISTANTS[name])
    check_pair(t, a)
    types = list(raw["layer_types"])
    types[-1] = F
    owning = len(types) - (raw.get("num_kv_shared_layers") or 0)
    independent = {ty: max(i for i in range(owning) if types[i] == ty) for ty in (S, F)}
    assert independent == REAL_STORE[name]
    source = {i: t.store_layers[ty] for i, ty in enumerate(a.text.layer_types)}  # as speculative.draft computes it
    assert a.text.layer_types == (S, S, S, F)
    assert source == {0: REAL_STORE[name][S], 1: REAL_STORE[name][S], 2: REAL_STORE[name][S], 3: REAL_STORE[name][F]}
    for i, ty in enumerate(a.text.layer_types):
        src = t.layers[source[i]]
        assert src.layer_type == ty and src.kv_mode == "store"
        assert a.text.kv_geometry(ty) == (src.num_kv_heads, src.head_dim)
        # the KV-shared target layers of that type read the same store layer
        assert all(lc.kv_source == source[i] for lc in t.layers[owning:] if lc.layer_type == ty)


WRONG_SOURCE = {"e2b": {S: 2}, "b31b": {S: 4, F: 2}}  # same-geometry layers that are NOT the store layers


def test_wrong_kv_mapping_is_caught(engines, tiny_ckpts, monkeypatch):
    """A drafter reading the wrong target layer (same geometry, so nothing crashes) or another sequence's page table
    drafts silently differently. On the tiny pairs acceptance barely depends on K/V (measured: e2b 18% correct,
    ~13-17% wrong; 11% with zeroed K/V), so the mapping is pinned by parity with transformers instead: the wrong
    mappings put the draft logits far outside the 1e-4 of test 2, while the greedy output stays exact."""
    from gemma4_mtp_jax.steps import speculative

    prompt = _prompts(20, [PARITY_T])[0]
    other = _prompts(21, [PARITY_T])[0]
    for family, wrong in WRONG_SOURCE.items():
        eng = engines(family, K)
        cfg = eng.target.config
        assert cfg.store_layers == {"e2b": {S: 4, F: 3}, "b31b": {S: 5, F: 6}}[family]
        assert _parity_mismatch(eng, tiny_ckpts, family, prompt) <= ATOL
        # another sequence's page tables
        assert _parity_mismatch(eng, tiny_ckpts, family, prompt, tables_of=other, check=False) > 1e-2
        # a wrong source layer per type
        for ty, layer in wrong.items():
            assert cfg.layers[layer].layer_type == ty and cfg.layers[layer].kv_mode is None
            assert (cfg.layers[layer].num_kv_heads, cfg.layers[layer].head_dim) == cfg.kv_geometry(ty)
            orig = speculative.PagedDraftKV

            def patched(*, source, _ty=ty, _layer=layer, _orig=orig, _eng=eng, **kw):
                types = _eng.assistant.config.text.layer_types
                return _orig(source={i: (_layer if types[i] == _ty else s) for i, s in source.items()}, **kw)

            monkeypatch.setattr(speculative, "PagedDraftKV", patched)
            worst = _parity_mismatch(eng, tiny_ckpts, family, prompt, check=False, fn=_draft_fn(eng, K))
            monkeypatch.setattr(speculative, "PagedDraftKV", orig)
            assert worst > 1e-2, f"{family}: drafter reading layer {layer} for {ty} is indistinguishable"


# ----------------------------------------------------------------------------------------------------------------------
# 9. An fp8 KV cache: the target's logits, and the drafter reading the target's pages with their scales
# ----------------------------------------------------------------------------------------------------------------------
FP8_CHUNK, FP8_LEN = 8, 48  # tokens per forward, and in all: the sliding rings (20 slots) wrap twice


def _paged_logits(target, cache_dtype, tokens: list[int]) -> np.ndarray:
    """The target's logits predicting tokens[FP8_CHUNK + 1:] over a one-sequence paged cache of `cache_dtype` (a
    float8 one with `kv_cache_scales`), FP8_CHUNK tokens a forward (a prefill chunk's or a verify's shape; one
    program per cache dtype: the decode step's shape runs in the fp8 engines' tests)."""
    from gemma4_mtp_jax.model.kv_state import kv_cache_scales, make_layout
    from gemma4_mtp_jax.steps.forward import StepSpec

    cfg = target.config
    layout = make_layout(cfg, page_size=4, max_model_len=len(tokens), num_pages={S: 64, F: 64}, prefill_chunk=8,
                         scales=kv_cache_scales(cfg, target.params, cache_dtype))
    spec = StepSpec(target, layout)
    return _shaped_logits(spec, cache_dtype, _forward_fn(spec), tokens, FP8_CHUNK, FP8_CHUNK, FP8_CHUNK)


# The fp8 cache's logits against the float32 cache's on `_prompts(90, [FP8_LEN])`, measured (KL nats, top-1): e2b
# 0.049, 0.82; a26b 0.107, 0.56; b31b 0.052, 0.62. The tiny random models attend sharply (q_norm and k_norm weights
# ~1 +- 0.3 stand in for 1/sqrt(D)) and their next-token laws are flat, near-ties everywhere, so e4m3's 3 mantissa
# bits move them far more than a trained model's: a bfloat16 cache already moves them by KL 2e-4 (e2b, b31b) to
# 6e-3 (a26b), top-1 0.90-1.0. Mutants: pages read unscaled, KL 0.75-0.83, top-1 0.15-0.28; K written unscaled
# (read scaled), KL 1.0-1.5, top-1 0.05-0.23.
FP8_KL, FP8_TOP1 = 0.2, 0.5
FP8_DRAFT_KL = 0.02  # the drafter's (test_fp8_drafter_reads_the_target_scales)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_cache_keeps_the_target_logits(family, tiny_ckpts, jax_models):
    """The target's logits over an fp8 KV cache (each layer's K and V scaled by powers of two from its weights) stay
    within KL <= FP8_KL nats and top-1 agreement >= FP8_TOP1 of the float32 cache's at the 39 positions after an
    8-token prompt (measured: above FP8_KL); the scales are far from 1.0 (2^-7..2^-5), so a reader or writer dropping
    them falls far outside."""
    from gemma4_mtp_jax.model.kv_state import kv_cache_scales
    from testenv import kl_and_top1

    target = jax_models.target(tiny_ckpts[family]["target"])
    scales = kv_cache_scales(target.config, target.params, jnp.float8_e4m3fn)
    assert scales and all(2.0**-7 <= s <= 2.0**-5 for pair in scales.values() for s in pair), scales
    tokens = _prompts(90, [FP8_LEN])[0]
    kl, top1 = kl_and_top1(_paged_logits(target, jnp.float32, tokens),
                           _paged_logits(target, jnp.float8_e4m3fn, tokens))
    assert kl <= FP8_KL and top1 >= FP8_TOP1, f"{family}: KL {kl:.4g}, top-1 {top1:.3f}"


def test_fp8_drafter_reads_the_target_scales(engines):
    """e2b's assistant over an fp8 cache: its Q-only layers read the target's float8 pages with the scales of the
    target layers that wrote them (2^-6..2^-5 here, far from 1.0). After the same prefill, from the same token, its
    k = 4 draft logits (each step while the drafts so far agree: 13 of 16) stay within KL <= FP8_DRAFT_KL and top-1
    >= FP8_TOP1 of the float32 cache's drafter (measured: KL 0.0014, top-1 0.92); a PagedDraftKV that reads the
    pages as if unscaled (a mutant, as a drafter whose scales default to 1.0) gives KL 0.46."""
    from testenv import kl_and_top1

    exact, fp8 = engines("e2b", K), engines("e2b", K, cache_dtype="fp8")
    assert fp8.layout.kv_scales() and not exact.layout.kv_scales()
    got, want = [], []
    for prompt in _prompts(91, [6, 11, 17, 23]):
        logits, drafts, tok = {}, {}, None
        for name, eng in (("exact", exact), ("fp8", fp8)):
            req, bonus = _prefill_only(eng, prompt)
            tok = bonus if tok is None else tok  # both draft from the float32 engine's token
            d, _, hn = _run_draft(eng, K, [req], [tok], [eng.kv.seq(req).slot], [len(prompt)])
            drafts[name], logits[name] = np.asarray(d)[0], _hn_logits(eng, hn)[0]
            _release(eng, req)
        same = 1 + next((s for s in range(K - 1) if drafts["exact"][s] != drafts["fp8"][s]), K - 1)
        want.append(logits["exact"][:same])
        got.append(logits["fp8"][:same])
    kl, top1 = kl_and_top1(np.concatenate(want), np.concatenate(got))
    assert kl <= FP8_DRAFT_KL and top1 >= FP8_TOP1, f"drafts over the fp8 cache: KL {kl:.4g}, top-1 {top1:.3f}"


def test_speculative_step_updates_state_in_place(engines):
    """The speculative program aliases the donated pages and hidden buffer to its outputs and copies no
    cache-sized array (the same check test_engine.py makes for prefill and decode)."""
    import re

    engine = engines("e2b", 4)
    compiled = engine.steps.compile_speculative(4)
    for variant in (compiled, engine.steps.compile_speculative(4, sampled=True)):
        assert " conditional(" not in variant.as_text(), "a conditional's predicate would hold the host (test_engine)"
    donated = sum(a.nbytes for kv in engine.state.pages.values() for a in kv) + engine.state.hidden.nbytes
    assert compiled.memory_analysis().alias_size_in_bytes >= donated
    dt = {"float32": "f32", "bfloat16": "bf16"}[engine.cache_dtype.name]
    shapes = {f"{dt}[{','.join(map(str, k.shape))}]" for k, _ in engine.state.pages.values()}
    copies = [line for line in compiled.as_text().splitlines()
              if (m := re.match(r"\s*(?:ROOT\s+)?%\S+ = (\S+?)\{[^}]*\} copy\(", line)) and m.group(1) in shapes]
    assert not copies, copies[:3]
    # The packed host inputs are read by two instructions, their write into the staging buffer and the result's
    # write over them, and every output aliases a donated parameter (test_engine.py).
    from gemma4_mtp_jax.programs.input_pack import packed_width
    from testenv import hlo_outputs_of_their_own, hlo_parameter_users

    shape = f"s32[4,{packed_width(engine.steps._abstract_inputs(4))}]"
    users = hlo_parameter_users(compiled.as_text(), shape)
    assert len(users) == 2, users
    assert not hlo_outputs_of_their_own(compiled.as_text())


def test_device_stop_check():
    """The step's own stop rule (packed keep / finished): first stop id kept, max tokens, padding after n+1."""
    import jax.numpy as jnp

    from gemma4_mtp_jax.steps.device_state import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, stop_check

    emitted = jnp.array([[5, 7, 9, -1], [5, 7, 9, 2], [5, 7, 9, 2], [3, -1, -1, -1], [8, 8, 8, 8], [5, 7, -1, -1]],
                        jnp.int32)
    n = jnp.array([2, 3, 3, 0, 3, 1], jnp.int32)
    stops = jnp.array([[7, -1], [2, -1], [-1, -1], [-1, -1], [-1, 9], [7, -1]], jnp.int32)
    remaining = jnp.array([10, 10, 2, 1, 10, 2], jnp.int32)
    keep, reason = stop_check(emitted, n, stops, remaining)
    assert keep.tolist() == [2, 4, 2, 1, 4, 2]
    # a stop id reached on the last allowed token is a stop
    S, L, N = FINISH_STOP, FINISH_LENGTH, FINISH_NONE
    assert reason.tolist() == [S, S, L, L, N, S]


# ----------------------------------------------------------------------------------------------------------------------
# Logits processing (penalties, bias, min_tokens, allowed tokens) and logprobs: exact under speculation
# ----------------------------------------------------------------------------------------------------------------------
def _processed_reference(logits, prompt, outputs, pp, stop_ids=(), out_index=0):
    """Numpy, float64, from the definitions (OpenAI's penalties, vLLM's repetition penalty and order): a request's
    logits at a position after `prompt` and `outputs` (its output tokens so far), the sampled token being output
    number `out_index`."""
    x = np.array(logits, np.float64)
    V = len(x)
    if pp.allowed_token_ids is not None:
        keep = np.zeros(V, bool)
        keep[list(pp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    x[list(pp.bad_token_ids)] = -np.inf
    for t, b in pp.logit_bias:
        x[t] += b
    if out_index < pp.min_tokens:
        x[list(stop_ids)] = -np.inf
    counts = np.bincount(np.asarray(outputs, int), minlength=V)
    seen = counts > 0
    seen[list(prompt)] = True
    r = pp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - pp.frequency_penalty * counts - pp.presence_penalty * (counts > 0)


def test_process_logits_matches_its_definition():
    """sampling.process_logits at T = 3 positions of 4 rows, each with its own prompt, output so far, penalties,
    bias, min_tokens, allowed and bad tokens (and a grammar's mask at one row's first position), against `_processed_reference` position by position (each position
    counting the inputs before it); and min-p keeps exactly the tokens of probability >= min_p * max."""
    from gemma4_mtp_jax.model.sampling import SamplingParams, filter_logits, pack_bits, process_logits, unpack_bits
    from gemma4_mtp_jax.steps.device_state import History, ProcessingRows

    rng = np.random.default_rng(0)
    B, T, V = 4, 3, 50
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6),
              SamplingParams(logit_bias=((3, 5.0), (7, -100.0)), min_tokens=6, bad_token_ids=(11,)),
              SamplingParams(allowed_token_ids=tuple(range(0, 50, 3)), repetition_penalty=0.7, presence_penalty=-1.0),
              SamplingParams()]
    prompts = [rng.integers(0, V, 6).tolist() for _ in range(B)]
    before = [rng.integers(0, V, n).tolist() for n in (5, 2, 0, 3)]  # output tokens committed so far
    inputs = rng.integers(0, V, (B, T)).astype(np.int32)
    for b in range(B):
        inputs[b, 1] = inputs[b, 0]  # repeats count twice
    stop_ids = np.full((B, 4), -1, np.int32)
    stop_ids[:, :2] = [[1, 9]]
    positions = np.array([[len(prompts[b]) + len(before[b]) + j for j in range(T)] for b in range(B)], np.int32)
    logits = rng.normal(0, 3, (B, T, V)).astype(np.float32)
    rows = ProcessingRows.stack([pp.processing_row(len(prompts[b])) | {"allowed": pp.allowed_mask(V)}
                                 for b, pp in enumerate(params)], B, (2, 1, 2))
    grammar = np.zeros(64, bool)
    grammar[[4, 5, 6]] = True
    rows.mask[3, 0] = pack_bits(grammar)  # a grammar's mask at row 3's first position
    counts = np.stack([np.bincount(before[b], minlength=V) for b in range(B)]).astype(np.int32)
    seen = np.zeros((B, V), bool)
    for b in range(B):
        seen[b, prompts[b]] = True
    history = History(jnp.asarray(counts), jnp.asarray(seen), unpack_bits(jnp.asarray(rows.allowed), V))
    got = np.asarray(process_logits(jnp.asarray(logits), rows, history, jnp.asarray(stop_ids),
                                    jnp.asarray(positions), jnp.asarray(inputs)))
    for b, pp in enumerate(params):
        for j in range(T):
            want = _processed_reference(logits[b, j], prompts[b], before[b] + inputs[b, :j + 1].tolist(), pp,
                                        [1, 9], positions[b, j] + 1 - len(prompts[b]))
            if (b, j) == (3, 0):
                want[~grammar[:V]] = -np.inf
            np.testing.assert_allclose(got[b, j], want, rtol=1e-6, atol=1e-5, err_msg=f"row {b} position {j}")
    assert np.isinf(got[1, :, [1, 9]]).all() and (got[1, :, 7] < -90).all()  # min_tokens, bias -100
    x = rng.normal(0, 2, (3, V)).astype(np.float32)
    min_p = np.array([0.0, 0.1, 0.5], np.float32)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(x), jnp.zeros(3, jnp.int32), jnp.ones(3), min_p)))
    p = _softmax(x.astype(np.float64))
    assert (kept == (p >= min_p[:, None] * p.max(-1, keepdims=True))).all()


def test_processed_speculative_equals_plain(engines):
    """Greedy requests with penalties, logit bias, min_tokens, allowed tokens and logprobs, beside a plain request,
    through one continuous batch: the speculative engine (k = 4) emits the plain engine's tokens and logprobs (the
    verify processes each position as a decode step does, its counts including the drafts before it) — float32 —
    and drafts still get accepted; the requests' constraints hold; a greedy token is its position's top logprob."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    prompts = _prompts(50, [5, 9, 14, 20, 7])
    plain = greedy_reference(engines, "e2b", prompts, MAX_NEW)
    stop = {plain[2][1], plain[2][3]}  # tokens the plain run emits early: min_tokens must hold them back
    allowed = tuple(sorted(set(range(3, hf_tiny.VOCAB, 5)) | set(plain[3][:4])))
    params = [SamplingParams(presence_penalty=1.2, frequency_penalty=0.6, logprobs=5),
              SamplingParams(repetition_penalty=1.8, logprobs=0),
              SamplingParams(min_tokens=6, logit_bias=((plain[2][0], -100.0), (plain[2][5], 3.0)), logprobs=2),
              SamplingParams(allowed_token_ids=allowed, presence_penalty=0.5),
              SamplingParams()]
    stops = [None, None, frozenset(stop), None, None]
    runs = {}
    for k in (0, K):
        eng = engines("e2b", k)
        reqs = [eng.add_request(p, MAX_NEW, pp, stop_ids=s) for p, pp, s in zip(prompts, params, stops)]
        eng.run()
        runs[k] = reqs
        assert all(n == 0 for n in eng.pages_in_use().values())
    for a, b in zip(runs[0], runs[K]):
        assert a.output == b.output, (a.sampling, a.output, b.output)
        assert len(a.logprobs) == len(a.output) if a.sampling.logprobs is not None else not a.logprobs
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], atol=1e-4)
    assert sum(r.num_accepted for r in runs[K]) > 0, "no draft accepted: the test would prove little"
    pen, rep, early, restricted, free = runs[0]
    assert pen.output != plain[0] and rep.output != plain[1] and free.output == plain[4]
    assert not stop & set(early.output[:6]) and plain[2][0] not in early.output
    assert set(restricted.output) <= set(allowed)
    for r in (pen, rep, early):
        for tok, lp in zip(r.output, r.logprobs):
            assert len(lp.top) == r.sampling.logprobs
            if lp.top:
                assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)
            assert lp.logprob <= 0
    assert len(set(pen.output)) > len(set(plain[0])) or pen.output != plain[0]


def test_processed_round_follows_the_target(engines):
    """Sampling stays lossless with processing: as `test_sampled_round_follows_the_target` (b31b, 2048 rows, T = 0.7,
    top-k 8, k = 1), the processed round with presence, frequency and repetition penalties and a logit bias, the last 6
    prompt tokens standing as output tokens already counted (prompt_len 9 of 15): every emitted token follows the
    target's processed distribution given the tokens before it (`_processed_reference`, the drafts before it
    counting), the bonus included, at p >= 1e-4."""
    from gemma4_mtp_jax.model.sampling import SamplingBatch, SamplingParams
    from gemma4_mtp_jax.steps.device_state import History, ProcessingRows

    eng = engines("b31b", K)
    seed, k = E2E["b31b"][0], 1  # the penalties, absent from the drafts, lower acceptance: one draft per round
    prompt = _prompts(seed, [15])[0]
    req, tok = _prefill_only(eng, prompt)
    V, P0 = eng.target.config.vocab_size, 9
    try:
        B, T, top_k = 2048, 0.7, 8
        sampling = SamplingBatch(np.full(B, T, np.float32), np.full(B, top_k, np.int32), np.ones(B, np.float32),
                                 np.arange(B, dtype=np.uint32))
        # Negative presence and frequency penalties favour the tokens already out: the draft before the bonus then
        # gains 2 logits there, which a round that did not count it would miss.
        pp = SamplingParams(temperature=T, top_k=top_k, presence_penalty=-1.0, frequency_penalty=-1.0,
                            repetition_penalty=1.3, logit_bias=((tok, 1.0),))
        processing = ProcessingRows.stack([pp.processing_row(P0)] * B, B)
        counts = np.bincount(prompt[P0:], minlength=V).astype(np.int32)
        seen = np.zeros(V, bool)
        seen[prompt[:P0]] = True
        history = History(jnp.asarray(np.tile(counts, (B, 1))), jnp.asarray(np.tile(seen, (B, 1))),
                          jnp.ones((B, V), bool))
        emitted, n = _round_on_copies(eng, req, tok, len(prompt), sampling, k, processing, history)
    finally:
        _release(eng, req)
    hist = np.bincount(n, minlength=k + 1)
    assert hist.min() >= 200, f"accepted counts {hist.tolist()}: some position would be barely tested"

    def process(logits, seq):  # seq: the prompt, the newest token, the drafts before this position
        return _processed_reference(logits, seq[:P0], seq[P0:], pp)

    pv, dists = _target_law_pvalues(eng, prompt + [tok], emitted, n, T, top_k, process)
    assert len(dists) > k, "too few groups of rows to test"
    bad = {c: v for c, v in pv.items() if not v >= P_MIN}
    assert not bad, f"emitted tokens off the target's processed distribution (p < {P_MIN}): {bad}; all: {pv}"
    plain, _ = _target_law_pvalues(eng, prompt + [tok], emitted, n, T, top_k)
    assert min(plain.values()) < P_MIN, "the penalties change nothing here: the test would prove little"
