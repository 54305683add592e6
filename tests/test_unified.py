"""The unified 12B family ("u12b" of hf_tiny.py: Gemma4UnifiedForConditionalGeneration and its
Gemma4UnifiedAssistantForCausalLM) served by one speculative engine: greedy speculative output equals transformers'
plain greedy generate under continuous batching, every round's accepted count equals transformers' own drafting
loop, the prefix cache changes neither, sampled rounds are exact where they can be checked exactly (top-k 1) and
reproducible, the processed programs (penalties, logprobs) give the non-speculative tokens and transformers'
logprobs; and, without an engine, the paged forward over an fp8 K/V cache stays near the float32 cache's.

The model functions of this family are tested with the others' (test_parity_target.py, test_parity_assistant.py:
parametrized over hf_tiny.FAMILIES); tensor parallelism in test_tensor_parallel.py. Here one engine (2 slots, one
batch bucket, one prefill bucket, k = 4) is built for the whole module: an engine's compiled programs are the
CPU suite's cost, in time and in the memory mappings a process may hold.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
import pytest

import hf_tiny

FAMILY = "u12b"
K = 4
MAX_NEW = 24
LENGTHS = [5, 13, 24, 30]  # shorter and longer than the window (8) and the prefill chunk (8)


def _prompts(seed: int, lengths) -> list[list[int]]:
    """Random text prompts: below the media token ids, which transformers' multimodal classes take for media
    placeholders wherever they appear (embedded as the pad token)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, min(hf_tiny.MEDIA_TOKEN_IDS.values()), size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(tiny_ckpts, jax_models):
    from gemma4_mtp_jax.engine import Engine, EngineConfig

    p = tiny_ckpts[FAMILY]
    cfg = EngineConfig(max_num_seqs=2, max_model_len=96, page_size=4, prefill_chunk=8, min_prefill_bucket=8,
                       num_speculative_tokens=K)
    eng = Engine(jax_models.target(p["target"]), cfg, assistant=jax_models.assistant(p["assistant"]))
    assert eng.config.batch_buckets() == [2] and eng.config.prefill_buckets() == [8]
    yield eng
    eng.close()


@contextlib.contextmanager
def _torch_one_thread():
    """torch on one thread for the tiny reference models: on the suite's 2 shared cores, its default (one per core)
    makes each call wait on the other's thread (a drafting round 0.4 s instead of 17 ms, measured)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@functools.lru_cache(maxsize=None)
def _hf_logits(target_dir: str, tokens: tuple[int, ...]) -> np.ndarray:
    """transformers' logits [T, V] of the multimodal target on one sequence (float32)."""
    import torch

    model = hf_tiny.load_hf_target(target_dir)
    with torch.inference_mode(), _torch_one_thread():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def _hf_greedy(target_dir, prompt, max_new) -> list[int]:
    """transformers' plain greedy generate (no assistant) of the multimodal target."""
    import torch

    model = hf_tiny.load_hf_target(str(target_dir))
    with torch.inference_mode(), _torch_one_thread():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def _hf_rounds(p: dict, prompt: list[int], max_new: int) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding with transformers' classes and its drafting: each round, the target on the P
    committed tokens, then the assistant's K steps from (its greedy token at P, its hidden at P - 1) over that K/V
    (hf_tiny.hf_draft_steps: exactly transformers' generator after a prefill, i.e. committed keys only,
    convention 2), then the target's argmax on [t, d_1..d_K]. Returns (output, accepted per round)."""
    target_dir = str(p["target"])
    out = [int(_hf_logits(target_dir, tuple(prompt))[-1].argmax())]
    rounds = []
    while len(out) < max_new:
        seq = list(prompt) + out
        P = len(seq) - 1
        with _torch_one_thread():
            steps = hf_tiny.hf_draft_steps(p["target"], p["assistant"], np.asarray([seq[:P]]), K)
        assert steps[0]["token"] == seq[P], "the bonus token is the target's greedy token at P"
        drafts = [s["draft"] for s in steps]
        verify = _hf_logits(target_dir, tuple(seq + drafts))[P:P + K + 1].argmax(-1)
        n = 0
        while n < K and drafts[n] == verify[n]:
            n += 1
        out += drafts[:n] + [int(verify[n])]
        rounds.append(n)
    return out[:max_new], rounds


_SERVED = {}


def _served(engine, tiny_ckpts):
    """The greedy workload, served once for the module: the LENGTHS prompts and a speculative=False request (2
    slots: requests wait, join and leave), compilations counted while serving. Returns (prompts, requests,
    the non-speculative request, compilations)."""
    from testenv import compilations

    if "run" not in _SERVED:
        prompts = _prompts(120, LENGTHS)
        off = _prompts(121, [11])[0]
        with compilations() as compiles:
            reqs = [engine.add_request(q, MAX_NEW) for q in prompts]
            plain = engine.add_request(off, MAX_NEW, speculative=False)
            engine.run()
        _SERVED["run"] = (prompts, reqs, plain, compiles)
    return _SERVED["run"]


def test_greedy_speculative_equals_plain_transformers(engine, tiny_ckpts):
    """Every greedy output of the speculative engine (4 prompts of 5..30 tokens and a non-speculative request
    through 2 slots) equals transformers' plain greedy generate of the multimodal 12B-family target token for
    token; the rounds mix 0, partial and full acceptance; nothing compiles while serving; every page and slot comes
    back."""
    prompts, reqs, plain, compiles = _served(engine, tiny_ckpts)
    target_dir = tiny_ckpts[FAMILY]["target"]
    for q, r in zip(prompts + [plain.prompt], reqs + [plain]):
        assert r.output == _hf_greedy(target_dir, q, MAX_NEW), f"prompt of {len(q)} tokens"
        assert r.finish_reason == "length"
    assert plain.accepted_per_round == [] and plain.num_drafted == 0
    hist = np.bincount([n for r in reqs for n in r.accepted_per_round], minlength=K + 1)
    assert hist[0] > 0 and hist[K] > 0 and hist[1:K].sum() > 0, f"acceptance histogram {hist.tolist()}"
    assert len({t for r in reqs for t in r.output}) > 20, "degenerate outputs: the test would prove little"
    assert compiles == [], f"{len(compiles)} compilations while serving"
    assert all(n == 0 for n in engine.pages_in_use().values()), engine.pages_in_use()
    assert sorted(engine.kv.free_slots) == list(range(engine.config.max_num_seqs)) and not engine.scheduler.running


def test_rounds_equal_transformers_drafting_loop(engine, tiny_ckpts):
    """Round by round, the engine accepts as many drafts as transformers' own drafter and target do from the same
    committed tokens (`_hf_rounds`), and emits the same tokens: the drafts agree up to the first rejection and
    both reject there."""
    prompts, reqs, _, _ = _served(engine, tiny_ckpts)
    for q, r in zip(prompts, reqs):
        out, rounds = _hf_rounds(tiny_ckpts[FAMILY], q, MAX_NEW)
        assert r.output == out, f"prompt of {len(q)} tokens"
        assert r.accepted_per_round == rounds, f"prompt of {len(q)} tokens: accepted per round differs"


def test_prefix_cache_keeps_outputs_and_acceptance(engine, tiny_ckpts):
    """The longest prompt (30 tokens) twice more: the first repeat puts its pages in the cache (the workload's
    later requests took the pool's pages back), the second takes its 7 full pages from it (the target's pages, and
    the window of them the drafter reads); both repeats' outputs and every round's accepted count are the first
    run's."""
    prompts, reqs, _, _ = _served(engine, tiny_ckpts)
    again = []
    for _ in range(2):
        hits = engine.kv.hits
        again.append(engine.add_request(prompts[-1], MAX_NEW))
        engine.run()
    assert engine.kv.hits - hits == 7 * engine.config.page_size, engine.kv.hits - hits
    for r in again:
        assert r.output == reqs[-1].output
        assert r.accepted_per_round == reqs[-1].accepted_per_round


def test_sampled_rounds(engine, tiny_ckpts):
    """Sampling through the speculative programs: top-k 1 at temperature 1 is greedy exactly (p and q one-hot:
    the same tokens and accepted counts as the greedy run); seeded requests give the same tokens alone and beside
    another request, and sampled drafts get accepted."""
    from gemma4_mtp_jax.generate import generate
    from gemma4_mtp_jax.model.sampling import SamplingParams

    prompts, reqs, _, _ = _served(engine, tiny_ckpts)
    one_hot = generate(engine.target, prompts[:2], MAX_NEW, SamplingParams(temperature=1.0, top_k=1, seed=3),
                       engine=engine)
    for r, g in zip(reqs[:2], one_hot):
        assert g.tokens == r.output and g.stats["accepted_per_round"] == r.accepted_per_round
    sp = [SamplingParams(temperature=0.8, top_p=0.95, seed=21), SamplingParams(temperature=1.2, top_k=30, seed=22)]
    both = generate(engine.target, prompts[1:3], MAX_NEW, sp, engine=engine)
    alone = generate(engine.target, prompts[2:3], MAX_NEW, sp[1:], engine=engine)
    assert both[1].tokens == alone[0].tokens
    assert both[1].stats["accepted_per_round"] == alone[0].stats["accepted_per_round"]
    assert all(len(r.tokens) == MAX_NEW and all(0 <= t < hf_tiny.VOCAB for t in r.tokens) for r in both)
    assert sum(r.stats["accepted"] for r in both) > 0, "no sampled draft was accepted"


def test_processed_requests_and_logprobs(engine, tiny_ckpts):
    """The processed programs: greedy requests with a presence or a repetition penalty (and logprobs) emit,
    speculatively, the tokens and logprobs of the same requests run without speculation (decode steps), and drafts
    still get accepted; a greedy request's logprobs are transformers' log-softmax at each emitted position
    (<= 1e-4), its top alternatives in transformers' order."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    prompts = _prompts(122, [9, 17])
    params = [SamplingParams(presence_penalty=0.5, logprobs=3), SamplingParams(repetition_penalty=1.3, logprobs=0)]
    spec = [engine.add_request(q, MAX_NEW, pp) for q, pp in zip(prompts, params)]
    engine.run()
    plain = [engine.add_request(q, MAX_NEW, pp, speculative=False) for q, pp in zip(prompts, params)]
    engine.run()
    for a, b in zip(spec, plain):
        assert a.output == b.output
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert sum(r.num_accepted for r in spec) > 0, "no draft accepted: the test would prove little"

    logged = engine.add_request(prompts[1], MAX_NEW, SamplingParams(logprobs=4))
    engine.run()
    logits = _hf_logits(str(tiny_ckpts[FAMILY]["target"]), tuple(prompts[1] + logged.output))
    want = jax.nn.log_softmax(logits[len(prompts[1]) - 1:-1].astype(np.float64), axis=-1)
    assert len(logged.logprobs) == MAX_NEW and logged.num_accepted > 0
    for j, (tok, lp) in enumerate(zip(logged.output, logged.logprobs)):
        assert lp.logprob == pytest.approx(float(want[j, tok]), abs=1e-4), j
        assert [t for t, _ in lp.top] == np.argsort(-want[j], kind="stable")[:4].tolist(), j
    assert spec[1].output != logged.output, "the repetition penalty changed nothing: the test would prove little"
    assert all(n == 0 for n in engine.pages_in_use().values())


def _chunked_paged_logits(target, cache_dtype, tokens: list[int], chunk: int = 8) -> np.ndarray:
    """The target's logits at every position of `tokens` but the first chunk, computed by the programs' paged
    forward over a one-sequence cache in `cache_dtype` (a float8 one with the static scales of `kv_cache_scales`),
    `chunk` tokens a forward: each forward writes its chunk's K/V, then reads every page before it back."""
    from gemma4_mtp_jax.model.kv_state import init_pages, kv_cache_scales, make_layout
    from gemma4_mtp_jax.steps.forward import StepSpec, forward_paged, lm_logits

    cfg = target.config
    layout = make_layout(cfg, page_size=4, max_model_len=len(tokens), num_pages={"sliding_attention": 64,
                                                                                 "full_attention": 64},
                         prefill_chunk=chunk, scales=kv_cache_scales(cfg, target.params, cache_dtype))
    spec = StepSpec(target, layout)

    @jax.jit
    def forward(params, pages, toks, positions, tables):
        h, pages = forward_paged(spec, params, pages, toks, positions, tables)
        return lm_logits(target, params, h), pages

    pages = init_pages(cfg, layout, cache_dtype)
    tables = {g: np.arange(1, w + 1, dtype=np.int32)[None] for g, w in layout.pages_per_seq}  # page 0: the null page
    rows = []
    for s in range(0, len(tokens), chunk):
        toks = np.asarray([tokens[s:s + chunk]], np.int32)
        positions = np.arange(s, s + toks.shape[1], dtype=np.int32)[None]
        logits, pages = forward(target.params, pages, toks, positions, tables)
        if s:
            rows.append(np.asarray(logits[0], np.float32))
    return np.concatenate(rows)


# Measured on `_prompts(123, [48])`: KL 0.024 nats, top-1 0.875 (the other families, in test_speculative.py: KL
# 0.05-0.11, top-1 0.56-0.82; the bounds below are theirs).
FP8_KL, FP8_TOP1 = 0.2, 0.5


def test_fp8_kv_cache_keeps_the_target_logits(tiny_ckpts, jax_models):
    """The 12B family's K/V in a float8 cache, each owning layer's K and V scaled by a power of two from its weights
    (its k_eq_v full layer's V is its un-normed K projection, v-normed, bounded as any V; the scales are far from
    1.0): 40 positions of logits, the sliding rings wrapping, stay within KL FP8_KL and top-1 FP8_TOP1 of the
    float32 cache's, and those are transformers' logits (<= 1e-4): the programs' paged forward of this family."""
    import jax.numpy as jnp

    from gemma4_mtp_jax.model.kv_state import kv_cache_scales
    from testenv import kl_and_top1

    target = jax_models.target(tiny_ckpts[FAMILY]["target"])
    scales = kv_cache_scales(target.config, target.params, jnp.float8_e4m3fn)
    assert set(scales) == set(range(target.config.num_layers)), scales  # every layer owns its K/V
    assert all(2.0**-8 <= s <= 2.0**-4 for pair in scales.values() for s in pair), scales
    tokens = _prompts(123, [48])[0]
    exact = _chunked_paged_logits(target, jnp.float32, tokens)
    hf_tiny.assert_close("paged float32 logits vs transformers", exact,
                         _hf_logits(str(tiny_ckpts[FAMILY]["target"]), tuple(tokens))[8:], 1e-4)
    kl, top1 = kl_and_top1(exact, _chunked_paged_logits(target, jnp.float8_e4m3fn, tokens))
    print(f"fp8 KV cache vs float32: KL {kl:.4f} nats, top-1 {top1:.3f}")
    assert kl <= FP8_KL and top1 >= FP8_TOP1, f"KL {kl:.4g}, top-1 {top1:.3f}"
