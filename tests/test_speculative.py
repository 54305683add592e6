"""MTP speculative decoding (issue 4): losslessness, drafter parity with transformers, an independent reference
loop, exact rejection sampling, drafts that match the target, EOS inside an accepted run, and the drafter's K/V
mapping.

CPU, float32, the tiny transformers-built pairs of hf_tiny.py (the "target" checkpoints, aligned with their
assistants so that drafts are partly accepted). Engines compile every program at start-up (~10 s plain, ~20 s
speculative on 2 cores), so they are built once per module and shared:
  plain   e2b, a26b, b31b                 (the non-speculative greedy references)
  spec    e2b k=1, e2b k=2 (2 slots), e2b k=4, a26b k=4, b31b k=4
  oracle  e2b k=4 drafting with `TargetGreedyDrafter` (the target's own greedy tokens, plugged into the engine)
k=1 and k=2 run on e2b only: it has every special path (centroid head, suppress_tokens, KV-shared layers).
"""

from __future__ import annotations

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
SPEC_CASES = [("e2b", 1), ("e2b", 2), ("e2b", 4), ("a26b", 4), ("b31b", 4)]
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
    """engines(family, k=0, oracle=False): one Engine per key for the whole module (k=0: no assistant; oracle:
    drafting with TargetGreedyDrafter)."""
    from gemma4_mtp_jax.engine import Engine

    cache = {}

    def get(family: str, k: int = 0, oracle: bool = False):
        key = (family, k, oracle)
        if key not in cache:
            p = tiny_ckpts[family]
            target = jax_models.target(p["target"])
            if k == 0:
                cache[key] = Engine(target, _config())
            else:
                assistant = jax_models.assistant(p["assistant"])
                cfg = _config(num_speculative_tokens=k, max_num_seqs=2 if k < K else 4)
                cache[key] = Engine(target, cfg, assistant=assistant,
                                    drafter=TargetGreedyDrafter() if oracle else None)
        return cache[key]

    return get


_GREEDY = {}


def greedy_reference(engines, family: str, prompts, max_new: int) -> list[list[int]]:
    """Non-speculative greedy outputs (plain engine), memoized per (family, prompt, max_new)."""
    from gemma4_mtp_jax.generate import generate

    missing = [p for p in prompts if (family, tuple(p), max_new) not in _GREEDY]
    if missing:
        eng = engines(family)
        for p, r in zip(missing, generate(eng.target, missing, max_new, engine=eng)):
            _GREEDY[(family, tuple(p), max_new)] = r.tokens
    return [_GREEDY[(family, tuple(p), max_new)] for p in prompts]


def _check_round_stats(req, k: int) -> None:
    """Per-request stats agree with its rounds (k drafts each; mean acceptance length; n+1 tokens per round)."""
    rounds = req.accepted_per_round
    assert req.num_speculative_tokens == k
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
@pytest.mark.parametrize("family,k", SPEC_CASES)
def test_greedy_speculative_equals_plain(family, k, engines):
    """8 prompts (3..30 tokens) plus a speculative=False request and a sampled request, all through one continuous
    batch (more requests than slots: they join and leave): every greedy output equals the plain engine's token for
    token; the rounds mix 0, partial and full acceptance; stats are consistent; nothing compiles while serving;
    every page and slot comes back."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    eng = engines(family, k)
    prompts = _prompts(10, LENGTHS)
    off = _prompts(11, [11])[0]
    want = greedy_reference(engines, family, prompts + [off], MAX_NEW)
    compiles, listening = [], [True]

    def on_event(event, duration, **kw):
        if listening[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        reqs = [eng.add_request(p, MAX_NEW) for p in prompts]
        reqs.insert(3, eng.add_request(off, MAX_NEW, speculative=False))
        sampled = eng.add_request(prompts[4], MAX_NEW, SamplingParams(temperature=1.0, seed=5))
        eng.run()
    finally:
        listening[0] = False
    assert compiles == [], f"the speculative engine compiled {len(compiles)} programs while serving"
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
    from gemma4_mtp_jax.steps.device_state import StepRows
    from gemma4_mtp_jax.model.sampling import SamplingBatch, SamplingParams
    from gemma4_mtp_jax.steps.speculative import make_draft_head

    B = len(tokens)
    sampling = sampling or SamplingBatch.from_params([SamplingParams()] * B, B)
    if fn is None:
        key = (id(eng), k)
        if key not in _DRAFT_FNS:
            _DRAFT_FNS[key] = _draft_fn(eng, k)
        fn = _DRAFT_FNS[key]
    tables = {g: np.stack([eng.kv.page_table(r)[g] for r in reqs_for_tables]) for g, _ in eng.layout.pages_per_seq}
    rows = StepRows.stack([dict(token=t, length=n) | {"slot": 0, "fresh": True, "remaining": 1, "speculate": True,
                                                       "stop_ids": -1}
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
# 4. Rejection sampling (speculative.accept) — Monte Carlo on a small vocabulary
# ----------------------------------------------------------------------------------------------------------------------
MC_V, MC_K = 12, 2


def _mc_problem(seed=0):
    rng = np.random.default_rng(seed)
    target_logits = (1.5 * rng.standard_normal((MC_K + 1, MC_V))).astype(np.float32)
    q_logits = 1.5 * rng.standard_normal((MC_K, MC_V))
    q = np.exp(q_logits - q_logits.max(-1, keepdims=True))
    q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
    return target_logits, q


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _tvd(samples, p):
    freq = np.bincount(samples, minlength=len(p)) / max(len(samples), 1)
    return 0.5 * float(np.abs(freq - p).sum())


def _tvd_bound(p, n):
    """~3.8x the expected TVD of an n-sample empirical distribution (E|f_i - p_i| ~ sqrt(2 p_i (1-p_i) / (pi n)))."""
    return 1.5 * float(np.sqrt(p * (1 - p) / n).sum())


@functools.cache
def _jit(fn):
    return jax.jit(fn)


def _run_accept(accept_fn, target_logits, q, n_rows, seed0, *, temperature=1.0, top_k=0, top_p=1.0, draft_seed=0,
                draft_q=None):
    """Draft from q (numpy, one row per sample), run accept on n_rows copies. Returns (emitted [N, k+1], n [N])."""
    from gemma4_mtp_jax.model.sampling import SamplingBatch

    rng = np.random.default_rng(draft_seed)
    dq = q if draft_q is None else draft_q
    cdf = np.cumsum(dq, -1)
    u = rng.random((n_rows, MC_K))
    drafts = np.minimum((u[..., None] > cdf[None]).sum(-1), MC_V - 1).astype(np.int32)  # d_j ~ q_j
    sampling = SamplingBatch(np.full(n_rows, temperature, np.float32), np.full(n_rows, top_k, np.int32),
                             np.full(n_rows, top_p, np.float32), (seed0 + np.arange(n_rows)).astype(np.uint32))
    emitted, n = _jit(accept_fn)(drafts, np.broadcast_to(q, (n_rows,) + q.shape), None,
                                 np.broadcast_to(target_logits, (n_rows,) + target_logits.shape), sampling,
                                 np.ones(n_rows, bool), np.full(n_rows, 17, np.int32))
    return np.asarray(emitted), np.asarray(n)


def _mc_distances(accept_fn, n_rows, seed0=0):
    """(TVD of the first emitted token to p_0, its bound, TVD of the second token given an accepted first draft to
    p_1, its bound, acceptance rate of the first draft)."""
    target_logits, q = _mc_problem()
    p = _softmax(target_logits.astype(np.float64))
    emitted, n = _run_accept(accept_fn, target_logits, q, n_rows, seed0, draft_seed=seed0)
    second = emitted[n >= 1, 1]
    return (_tvd(emitted[:, 0], p[0]), _tvd_bound(p[0], n_rows), _tvd(second, p[1]), _tvd_bound(p[1], len(second)),
            float((n >= 1).mean()))


def _mutant(name: str, old: str, new: str):
    """speculative.accept with one source line changed: a deliberately wrong sampler."""
    from gemma4_mtp_jax.steps import speculative

    src = textwrap.dedent(inspect.getsource(speculative.accept))
    assert old in src, f"mutation '{name}': '{old}' no longer appears in speculative.accept; update the test"
    ns = dict(vars(speculative))
    exec(compile(src.replace(old, new), f"<accept mutant {name}>", "exec"), ns)  # noqa: S102
    return ns["accept"]


MUTANTS = {
    "residual from p": ("residual = jnp.maximum(p_n - q_n, 0.0)", "residual = p_n"),
    "accept every draft": ("ok = u * q_d < p_d", "ok = u * q_d < jnp.inf"),
    "ratio inverted": ("ok = u * q_d < p_d", "ok = u * p_d < q_d"),
}


def test_rejection_sampling_matches_target_distribution():
    """The first emitted token ~ softmax(target_logits[0]); the second, given the first draft was accepted,
    ~ softmax(target_logits[1]); acceptance rate = sum(min(p_0, q_0)); the distance shrinks like 1/sqrt(N)."""
    from gemma4_mtp_jax.steps.speculative import accept

    target_logits, q = _mc_problem()
    p = _softmax(target_logits.astype(np.float64))
    tvd1, bound1, tvd2, bound2, rate = _mc_distances(accept, 20000)
    assert tvd1 < bound1, (tvd1, bound1)
    assert tvd2 < bound2, (tvd2, bound2)
    expected_rate = float(np.minimum(p[0], q[0]).sum())
    assert abs(rate - expected_rate) < 4 * np.sqrt(expected_rate * (1 - expected_rate) / 20000), (rate, expected_rate)
    assert 0.2 < expected_rate < 0.8, "p and q should differ enough for the mutants to be visible"
    # the distance shrinks as expected: mean over 8 independent runs at N and at 10N
    small = np.mean([_mc_distances(accept, 2000, seed0=10**6 * (i + 1))[0] for i in range(8)])
    large = np.mean([_mc_distances(accept, 20000, seed0=10**7 * (i + 1))[0] for i in range(8)])
    assert 2.0 < small / large < 5.0, (small, large)  # sqrt(10) = 3.16


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_rejection_sampling_test_catches_wrong_samplers(mutant):
    """The same statistics fail for deliberately wrong samplers (one source line of accept changed)."""
    fn = _mutant(mutant, *MUTANTS[mutant])
    tvd1, bound1, *_ = _mc_distances(fn, 20000)
    assert tvd1 > 3 * bound1, f"{mutant}: TVD {tvd1:.4f} is within 3x the bound {bound1:.4f}; the test is blind to it"


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


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.8), (6, 0.9)])
def test_rejection_sampling_respects_top_k_top_p(top_k, top_p):
    """With a filter, every emitted token (accepted drafts, the resampled or bonus token) lies in the target's
    filtered support at its position, though the drafts come from an unfiltered q; and the first emitted token
    follows the filtered target distribution."""
    from gemma4_mtp_jax.steps.speculative import accept

    T, N = 0.7, 20000
    target_logits, q = _mc_problem(seed=6)
    emitted, n = _run_accept(accept, target_logits, q, N, 0, temperature=T, top_k=top_k, top_p=top_p)
    supports = [_filtered_support(target_logits[j].astype(np.float64), T, top_k, top_p) for j in range(MC_K + 1)]
    assert all(1 < len(s) < MC_V for s in supports)
    assert q[0, sorted(set(range(MC_V)) - supports[0])].sum() > 0.3, "drafts outside the support should be common"
    for j in range(MC_K + 1):
        col = emitted[:, j]
        got = set(col[col >= 0].tolist())
        assert got <= supports[j], f"position {j}: tokens {sorted(got - supports[j])} outside the filtered support"
    assert (emitted[np.arange(N), n] >= 0).all() and (emitted[n < MC_K, -1] == -1).all()
    # the first emitted token ~ the filtered, renormalised target distribution
    x = target_logits[0].astype(np.float64) / T
    mask = np.full(MC_V, -np.inf)
    mask[sorted(supports[0])] = 0.0
    p0 = _softmax(x + mask)
    assert _tvd(emitted[:, 0], p0) < _tvd_bound(p0, N)


def test_rejection_sampling_reproducible_and_row_independent():
    from gemma4_mtp_jax.steps.speculative import accept

    target_logits, q = _mc_problem(seed=4)
    a = _run_accept(accept, target_logits, q, 4096, 1000)
    b = _run_accept(accept, target_logits, q, 4096, 1000)
    c = _run_accept(accept, target_logits, q, 4096, 50000)  # other seeds, same drafts
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    # a row's outcome depends on its own seed and position only, not on the batch around it
    small = _run_accept(accept, target_logits, q, 64, 1000)
    assert np.array_equal(small[0], a[0][:64]) and np.array_equal(small[1], a[1][:64])


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


@pytest.mark.parametrize("family", ["e2b", "b31b"])
def test_sampled_drafts_follow_returned_q(family, engines):
    """accept() is exact only if each draft really is a sample of the q it is given. 2048 rows in the same state
    (one prefilled sequence, seeds 0..2047, temperature 1.3, top-k 8): the first drafts follow q (TVD bound), q is
    the assistant's filtered distribution at that temperature (<= 8 tokens, matching softmax(logits/T) over them),
    and, among rows whose first draft is the most common token, the second drafts follow their (shared) q."""
    from gemma4_mtp_jax.model.sampling import SamplingBatch

    eng = engines(family, K)
    prompt = _prompts(80, [15])[0]
    req, tok = _prefill_only(eng, prompt)
    try:
        B, T, top_k = 2048, 1.3, 8
        sampling = SamplingBatch(np.full(B, T, np.float32), np.full(B, top_k, np.int32), np.ones(B, np.float32),
                                 np.arange(B, dtype=np.uint32))
        slot = eng.kv.seq(req).slot
        drafts, q, hn = _run_draft(eng, K, [req] * B, [tok] * B, [slot] * B, [len(prompt)] * B, sampling)
        drafts, q = np.asarray(drafts), np.asarray(q, np.float64)
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
    assert _tvd(drafts[:, 0], q0) < _tvd_bound(q0, B)
    mode = np.bincount(drafts[:, 0]).argmax()
    rows = np.flatnonzero(drafts[:, 0] == mode)
    assert len(rows) > 300
    q1 = q[rows[0], 1]
    assert np.allclose(q[rows, 1], q1, atol=1e-6)
    assert _tvd(drafts[rows, 1], q1) < _tvd_bound(q1, len(rows))


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
