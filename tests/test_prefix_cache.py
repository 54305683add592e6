"""Prefix caching: the reference-counted page allocator with its cache of full pages, and the engine sharing cached
pages between requests. Outputs with the cache equal outputs without it (greedy, seeded sampling, speculative),
also for a shared prefix many times longer than the sliding window; every page is freed exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_mtp_jax.engine.allocator import OutOfPages, PageAllocator

PAGE = 4


# ------------------------------------------------------------------------------------------------- the allocator
def test_refcounts_cache_and_lru_eviction():
    a = PageAllocator(5)  # pages 1..4
    p = a.allocate(3)
    assert p == [1, 2, 3] and a.num_free == 1 and a.num_used == 3
    a.share([p[0]])
    assert a.shared(p[0]) and not a.shared(p[1])
    a.free([p[0]])
    assert a.num_used == 3, "one holder left"
    a.register("k1", p[0])
    a.register("k2", p[1])
    a.register("k1", p[2])  # a key already cached keeps its page
    assert a.lookup("k1") == p[0] and a.lookup("k2") == p[1] and a.num_cached == 2
    a.free([p[1]])  # cached, nobody holds it: evictable, still findable
    a.free([p[0]])
    a.free([p[2]])  # not cached: free
    assert a.num_used == 0 and a.num_free == 4 and a.evictable([p[0], p[1], p[2]]) == 2
    got = a.allocate(2)  # free pages first, then the least recently released cached page
    assert sorted(got) == [3, 4] and a.lookup("k1") == p[0]
    assert a.allocate(1) == [p[1]] and a.lookup("k2") is None, "k2's page was released first: evicted first"
    a.share([p[0]])  # a cache hit revives the other
    assert a.num_free == 0 and a.num_used == 4
    with pytest.raises(OutOfPages):
        a.allocate(1)
    a.free([p[0]])
    a.clear_cache()
    assert a.lookup("k1") is None and a.num_free == 1 and a.num_cached == 0


def test_double_free_and_bad_calls_raise():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.free([p])
    with pytest.raises(ValueError, match="double free"):
        a.free([p])
    with pytest.raises(ValueError, match="neither held nor cached"):
        a.share([p])
    with pytest.raises(ValueError, match="registered but not held"):
        a.register("k", p)


def test_random_operations_keep_every_page_in_exactly_one_state():
    rng = np.random.default_rng(0)
    a = PageAllocator(17)
    holders: list[int] = []  # one entry per holder
    for step in range(3000):
        op = rng.integers(5)
        if op == 0 and a.num_free:
            holders += a.allocate(int(rng.integers(1, a.num_free + 1)))
        elif op == 1 and holders:
            a.free([holders.pop(int(rng.integers(len(holders))))])
        elif op == 2 and holders:
            p = holders[int(rng.integers(len(holders)))]
            a.register(int(rng.integers(40)), p)
        elif op == 3:
            p = a.lookup(int(rng.integers(40)))
            if p is not None:
                a.share([p])
                holders.append(p)
        elif op == 4 and rng.random() < 0.01:
            a.clear_cache()
        held = set(holders)
        assert a.num_used == len(held)
        assert a.num_free + a.num_used == a.capacity, step
        for key, page in list(a._page_of.items()):
            assert a._key_of[page] == key


# ------------------------------------------------------------------------------------------------- the engine
def _config(**kw):
    from gemma4_mtp_jax.engine import EngineConfig

    base = dict(max_num_seqs=4, max_model_len=96, page_size=PAGE, prefill_chunk=8, min_prefill_bucket=4,
                compile_at_start=False)
    base.update(kw)
    return EngineConfig(**base)


def _workload(seed: int):
    """Requests in two waves: one prompt alone (it fills the cache), then prompts sharing its prefix (44 tokens,
    five sliding windows of the tiny models), a multi-turn follow-up (prompt + answer + new tokens), the same
    prompt again, and one unrelated prompt; greedy and seeded sampling mixed."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 400, size=44).tolist()
    first = prefix + rng.integers(3, 400, size=5).tolist()
    second = [prefix + rng.integers(3, 400, size=n).tolist() for n in (1, 6, 11)]
    other = rng.integers(3, 400, size=17).tolist()
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=3), SamplingParams(),
                SamplingParams(temperature=1.2, top_k=40, seed=8)]
    return first, second, other, sampling


def _run(engine, seed: int, max_new: int = 14):
    first, second, other, sampling = _workload(seed)
    a = engine.add_request(first, max_new)
    engine.run()
    follow_up = first + a.output + [7, 9, 11]
    reqs = [engine.add_request(p, max_new, s) for p, s in zip(second + [first, follow_up, other],
                                                              sampling + sampling[:2] + [sampling[1]])]
    engine.run()
    return [a] + reqs


def _assert_all_pages_back(engine):
    assert engine.pages_in_use() == {g: 0 for g in engine.kv.allocators}
    for alloc in engine.kv.allocators.values():
        assert alloc.num_free == alloc.capacity


def test_a_released_prefix_is_evicted_from_its_end(tiny_ckpts, jax_models):
    """A finished sequence's pages go back last page first, so eviction takes its cached prefix from the end: the
    first pages, which every later lookup needs before the others, stay findable longest."""
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.engine.kv_cache import page_keys

    engine = Engine(jax_models.target(tiny_ckpts["e2b"]["target_plain"]), _config())
    req = engine.add_request(list(range(3, 3 + 10 * PAGE)), 2)
    engine.run()
    alloc = engine.kv.allocators["full_attention"]
    keys = page_keys(req.prompt + req.output, PAGE, (req.num_tokens - 1) // PAGE)
    assert len(keys) == 10 and all(alloc.lookup(k) is not None for k in keys)
    taken = alloc.allocate(alloc.num_free - alloc.num_cached + 1)  # every free page, then one cached page
    assert alloc.lookup(keys[0]) is not None and alloc.lookup(keys[-1]) is None
    alloc.free(taken)


@pytest.mark.parametrize("family", ["e2b", "b31b"])
def test_outputs_equal_with_and_without_the_cache(family, tiny_ckpts, jax_models):
    from gemma4_mtp_jax.engine import Engine

    target = jax_models.target(tiny_ckpts[family]["target_plain"])
    runs = {}
    for on in (False, True):
        engine = Engine(target, _config(enable_prefix_caching=on))
        reqs = _run(engine, seed=5)
        _assert_all_pages_back(engine)
        runs[on] = (engine, reqs)
    (off, want), (on, got) = runs[False], runs[True]
    assert [r.output for r in got] == [r.output for r in want]
    assert off.kv.hits == 0 and off.kv.queries == 0
    # The second wave's three shared-prefix prompts, the repeat and the follow-up each find whole pages.
    prefix_pages = 44 // PAGE
    assert on.kv.hits >= 3 * prefix_pages * PAGE + 2 * 12 * PAGE
    assert on.kv.queries == sum(len(r.prompt) for r in got)


def test_speculative_outputs_and_acceptance_equal_with_and_without_the_cache(tiny_ckpts, jax_models):
    """With the assistant: the drafter reads the cached pages too (its window of committed keys and every full
    page), so the drafts and each round's accepted count must not change."""
    from gemma4_mtp_jax.engine import Engine

    p = tiny_ckpts["e2b"]
    target, assistant = jax_models.target(p["target"]), jax_models.assistant(p["assistant"])
    runs = {}
    for on in (False, True):
        engine = Engine(target, _config(enable_prefix_caching=on, num_speculative_tokens=3), assistant=assistant)
        reqs = _run(engine, seed=6)
        _assert_all_pages_back(engine)
        runs[on] = (engine, reqs)
    (_, want), (on, got) = runs[False], runs[True]
    assert [r.output for r in got] == [r.output for r in want]
    greedy = [i for i, r in enumerate(got) if r.sampling.temperature == 0]
    assert [got[i].accepted_per_round for i in greedy] == [want[i].accepted_per_round for i in greedy]
    assert on.kv.hits > 0


def test_cached_pages_survive_preemption_and_eviction(tiny_ckpts, jax_models):
    """A full-layer pool too small for the workload: sequences are preempted and cached pages evicted to make
    room, and outputs still equal the roomy run without the cache; every page comes back exactly once."""
    from gemma4_mtp_jax.engine import Engine

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    roomy = Engine(target, _config(enable_prefix_caching=False))
    want = _run(roomy, seed=7, max_new=20)
    ring = roomy.layout.table_width("sliding_attention")
    tight = Engine(target, _config(num_pages={"full_attention": 26, "sliding_attention": 4 * ring + 1}))
    got = _run(tight, seed=7, max_new=20)
    assert [r.output for r in got] == [r.output for r in want]
    assert tight.scheduler.num_preemptions > 0 and tight.kv.hits > 0
    _assert_all_pages_back(tight)


def test_a_prefix_window_survives_a_longer_hit_in_a_default_pool(tiny_ckpts, jax_models):
    """One sequence at a time, the default pools: a prompt, the same prompt again (a hit to its last page, whose
    window starts later than the shared prefix's), then the shared prefix with another suffix. The third must
    still find the prefix's window: the sliding pool keeps a spare ring for the cache."""
    from gemma4_mtp_jax.engine import Engine

    engine = Engine(jax_models.target(tiny_ckpts["e2b"]["target_plain"]), _config(max_num_seqs=1))
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 400, size=11 * PAGE).tolist()
    first = prefix + rng.integers(3, 400, size=2 * PAGE + 1).tolist()
    hits = []
    for prompt in (first, first, prefix + rng.integers(3, 400, size=3).tolist()):
        before = engine.kv.hits
        engine.add_request(prompt, 6, stop_ids=frozenset())
        engine.run()
        hits.append(engine.kv.hits - before)
    assert hits == [0, 13 * PAGE, 11 * PAGE]
    _assert_all_pages_back(engine)


def test_siblings_share_their_prompt_and_penalties_survive_preemption(tiny_ckpts, jax_models):
    """n > 1: choices added `after` the first wait until its prompt is prefilled, then find its full pages in the
    cache (the prompt is prefilled once); seeded choices differ from each other, greedy ones are identical. A
    penalized request (its history counted on the device) takes no cached pages, and its output survives
    preemption: the tight pool's outputs equal the roomy run's without the cache."""
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.model.sampling import SamplingParams

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    engine = Engine(target, _config())
    prompt = np.random.default_rng(3).integers(3, 400, size=30).tolist()
    first = engine.add_request(prompt, 10, SamplingParams(temperature=1.0, seed=1))
    sampled = [engine.add_request(prompt, 10, SamplingParams(temperature=1.0, seed=s), after=first) for s in (2, 3)]
    greedy = [engine.add_request(prompt, 10, after=first) for _ in range(2)]
    penalized = engine.add_request(prompt, 10, SamplingParams(presence_penalty=1.5, repetition_penalty=1.5),
                                   after=first)
    engine.run()
    assert engine.kv.hits == 4 * ((len(prompt) - 1) // PAGE) * PAGE, "each sibling finds the prompt's full pages"
    assert len({tuple(r.output) for r in [first] + sampled}) == 3 and greedy[0].output == greedy[1].output
    assert penalized.output != greedy[0].output
    _assert_all_pages_back(engine)

    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 400, size=n).tolist() for n in (9, 21, 14, 25)]
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), SamplingParams(repetition_penalty=1.4),
              SamplingParams(frequency_penalty=-0.5, logprobs=1), SamplingParams(presence_penalty=0.8, seed=5,
                                                                                  temperature=0.9)]
    outputs = {}
    ring = engine.layout.table_width("sliding_attention")
    for name, cfg in [("roomy", _config(enable_prefix_caching=False)),
                      ("tight", _config(num_pages={"full_attention": 26, "sliding_attention": 4 * ring + 1}))]:
        eng = Engine(target, cfg)
        reqs = [eng.add_request(p, 20, s) for p, s in zip(prompts, params)]
        eng.run()
        outputs[name] = [r.output for r in reqs]
        _assert_all_pages_back(eng)
    assert eng.scheduler.num_preemptions > 0
    assert outputs["tight"] == outputs["roomy"]
