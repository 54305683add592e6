"""The paged KV engine (target only): greedy parity with transformers' generate, continuous batching, no
compilation after start-up, in-place KV updates, page accounting, sampling."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

FAMILIES = ["e2b", "a26b", "b31b"]
MAX_NEW = 20
PAGE = 4  # tiny pages: generations cross many page boundaries


def _engine_config(**kw):
    from gemma4_mtp_jax.engine import EngineConfig

    base = dict(max_num_seqs=4, max_model_len=64, page_size=PAGE, prefill_chunk=8, min_prefill_bucket=4)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def engines(tiny_ckpts, jax_models):
    from gemma4_mtp_jax.engine import Engine

    cache = {}

    def get(family):
        if family not in cache:
            target = jax_models.target(tiny_ckpts[family]["target_plain"])
            cache[family] = Engine(target, _engine_config())
        return cache[family]

    return get


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=n).tolist() for n in lengths]


def _hf_greedy(target_dir, prompt, max_new):
    import hf_tiny
    import torch

    model = hf_tiny.load_hf_target(str(target_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, engines, tiny_ckpts):
    """A batch of mixed-length prompts (shorter and longer than the window of 8, and longer than a prefill chunk)
    equals transformers' greedy generate token for token, and each equals its own single run."""
    from gemma4_mtp_jax.generate import generate

    engine = engines(family)
    prompts = _prompts(1, [5, 13, 23])
    batched = generate(engine.target, prompts, MAX_NEW, engine=engine)
    for p, r in zip(prompts, batched):
        want = _hf_greedy(tiny_ckpts[family]["target_plain"], p, MAX_NEW)
        assert r.tokens == want, f"{family}: prompt of {len(p)} tokens"
        assert len(set(want)) > 3, "the reference generation is degenerate; the test would prove little"
        single = generate(engine.target, [p], MAX_NEW, engine=engine)[0]
        assert single.tokens == r.tokens
        assert r.stats["generated_tokens"] == MAX_NEW and r.stats["finish_reason"] == "length"
    assert all(n == 0 for n in engine.pages_in_use().values())


def test_no_compilation_after_startup(engines):
    """A mixed workload (lengths, batch sizes, greedy and sampled, joins and leaves) after start-up compiles nothing."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    from testenv import compilations

    engine = engines("e2b")
    with compilations() as compiles:
        prompts = _prompts(2, [3, 9, 17, 30, 6, 11])
        reqs = []
        for i, p in enumerate(prompts[:3]):
            reqs.append(engine.add_request(p, 5 + i, SamplingParams(temperature=0.9 * (i % 2), seed=i)))
        for _ in range(3):
            engine.step()
        for i, p in enumerate(prompts[3:]):  # join while others run
            reqs.append(engine.add_request(p, 7, SamplingParams(temperature=0.5, top_k=5, top_p=0.9, seed=i)))
        engine.run()
    assert all(r.finished for r in reqs)
    assert compiles == [], f"{len(compiles)} compilations after start-up"


def _pool_shapes(engine) -> set[str]:
    dt = {"float32": "f32", "bfloat16": "bf16"}[engine.cache_dtype.name]
    return {f"{dt}[{','.join(map(str, k.shape))}]" for k, _ in engine.state.pages.values()}


@pytest.mark.parametrize("max_model_len, chunk, smallest", [(48, 256, 16), (2048, 256, 16), (24, 8, 4), (2, 256, 16),
                                                          (100, 100, 16), (300, 1000, 8)])
def test_prefill_buckets_cover_every_chunk_and_no_more(max_model_len, chunk, smallest):
    """Every chunk a sequence can need (1 .. min(chunk, max_model_len - 1) tokens) has a bucket, and no bucket is
    compiled that no chunk could use (a server at max_model_len 48 compiled 128- and 256-token prefills before)."""
    from gemma4_mtp_jax.engine import EngineConfig

    buckets = EngineConfig(max_model_len=max_model_len, prefill_chunk=chunk,
                           min_prefill_bucket=smallest).prefill_buckets()
    largest = min(chunk, max_model_len - 1)
    assert all(any(b >= n for b in buckets) for n in range(1, largest + 1))
    assert buckets == sorted(set(buckets)) and len([b for b in buckets if b >= largest]) == 1, buckets


@pytest.mark.parametrize("family", ["e2b", "b31b"])
def test_each_kind_of_layer_is_traced_once(family, jax_models, tiny_ckpts, monkeypatch):
    """Over the paged state each kind of decoder layer (model/target.py `representative`) is traced once per
    program, every layer calling its kind's one traced function, and so is the assistant's draft step (k calls);
    the engine then writes, bitwise in float32, the tokens and pages (but the null page) of tracing layer by layer
    (in bfloat16 only XLA's excess precision may differ)."""
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.generate import generate
    from gemma4_mtp_jax.model.kv_state import NULL_PAGE, PagedKV
    from gemma4_mtp_jax.model.target import representative

    target = jax_models.target(tiny_ckpts[family]["target_plain"])
    cfg = target.config
    steps = Engine(target, _engine_config(compile_at_start=False)).steps
    jitted, args = steps.decode_program(2, False)
    calls = [e for e in jitted.trace(*args).jaxpr.eqns if e.params.get("name") == "decoder_layer"]
    kinds = {representative(cfg, i) for i in range(cfg.num_layers)}
    assert len(calls) == cfg.num_layers and len({id(e.params["jaxpr"]) for e in calls}) == len(kinds) < len(calls)
    assistant = jax_models.assistant(tiny_ckpts[family]["assistant"])
    spec = Engine(target, _engine_config(compile_at_start=False), assistant=assistant).steps
    jitted, args = spec.speculative_program(2, True)
    steps = [e for e in jitted.trace(*args).jaxpr.eqns if e.params.get("name") == "draft_step"]
    assert len(steps) == spec.k > 1 and len({id(e.params["jaxpr"]) for e in steps}) == 1

    def run():
        engine = Engine(target, _engine_config(compile_at_start=False))  # only what generate runs
        tokens = [r.tokens for r in generate(target, _prompts(3, [5, 11]), 8, engine=engine)]
        return tokens, jax.tree_util.tree_map(np.asarray, engine.state.pages)

    once = run()
    monkeypatch.delattr(PagedKV, "only")  # the layers traced one by one
    by_layer = run()
    assert once[0] == by_layer[0]
    for a, b in zip(jax.tree_util.tree_leaves(once[1]), jax.tree_util.tree_leaves(by_layer[1])):
        live = np.arange(a.shape[1]) != NULL_PAGE  # padding rows race to write the null page: garbage by design
        np.testing.assert_array_equal(a[:, live], b[:, live])


def test_kv_updated_in_place(engines):
    """Decode and prefill programs alias the donated pages to their outputs, and copy no cache-sized array."""
    engine = engines("e2b")
    pages_bytes = sum(a.nbytes for kv in engine.state.pages.values() for a in kv)
    shapes = _pool_shapes(engine)
    for name, compiled in [("decode[4]", engine.steps.compile_decode(4)),
                           ("prefill[1x8]", engine.steps.compile_prefill(1, 8))]:
        assert compiled.memory_analysis().alias_size_in_bytes >= pages_bytes, f"{name}: pages not donated in place"
        copies = []
        for line in compiled.as_text().splitlines():
            m = re.match(r"\s*(?:ROOT\s+)?%\S+ = (\S+?)\{[^}]*\} (\w[\w-]*)\(", line)
            if m and m.group(1) in shapes and m.group(2) == "copy":
                copies.append(line.strip()[:120])
        assert not copies, f"{name} copies a cache-sized array: {copies[:3]}"


def test_step_programs_hold_no_conditional(engines):
    """No step program holds an XLA conditional: on the GPU a conditional's predicate is copied to the host, which
    holds the dispatching thread until the device gets there, so the engine could not dispatch step n+1 while step
    n runs. Greedy and sampled batches run separate variants instead (`sampling.sample`)."""
    engine = engines("e2b")
    steps = engine.steps
    for name, compiled in [("decode[2]", steps.compile_decode(2)), ("decode[2,sampled]", steps.compile_decode(2, True)),
                           ("prefill[1x8]", steps.compile_prefill(1, 8))]:
        text = compiled.as_text()
        assert " conditional(" not in text, f"{name} holds a conditional"
        assert (" sort(" in text) == (name != "decode[2]"), f"{name}: the sampling path is traced only when sampled"


def test_donation_check_can_fail(engines):
    """The in-place checks are not vacuous: the same step compiled without donation has no aliasing, and every
    output (the state's leaves and the result) in an allocation of its own."""
    engine = engines("e2b")
    steps = engine.steps
    params, _, state, packed = steps._abstract_args(2)
    fn = functools.partial(steps._decode_fn, sampled=False, processed=False)
    plain = jax.jit(fn).lower(params, state, packed).compile()
    assert plain.memory_analysis().alias_size_in_bytes == 0
    from testenv import hlo_outputs_of_their_own

    assert len(hlo_outputs_of_their_own(plain.as_text())) == len(jax.tree_util.tree_leaves((state, 0)))


def test_sliding_memory_bounded_by_window(jax_models, tiny_ckpts):
    from gemma4_mtp_jax.model.kv_state import make_layout

    cfg = jax_models.target(tiny_ckpts["e2b"]["target_plain"]).config
    widths = []
    for max_len in (64, 4096, 131072):
        layout = make_layout(cfg, page_size=PAGE, max_model_len=max_len, num_pages={"sliding_attention": 10**6,
                                                                                      "full_attention": 10**6},
                             num_speculative_tokens=4)
        widths.append(layout.table_width("sliding_attention"))
        assert layout.table_width("sliding_attention") * PAGE >= cfg.sliding_window + 4 + 2
    assert len(set(widths)) == 1


def test_async_scheduling_gives_the_synchronous_run(engines):
    """Dispatching step n+1 before reading step n changes nothing but timing: with sequences stopping at a stop id
    mid-batch (their next row, already dispatched, runs as padding and is dropped) and others at max_new_tokens,
    each request's output, finish reason and tokens per event equal the synchronous run's, and every page and slot
    comes back."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    engine = engines("e2b")
    prompts = _prompts(31, [5, 9, 13, 7, 11])
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=3), SamplingParams(), SamplingParams(),
                SamplingParams(temperature=0.7, top_k=20, seed=4)]

    def run(async_scheduling: bool, stop_ids=None):
        engine.config.async_scheduling = async_scheduling
        try:
            reqs = [engine.add_request(p, 10 + i, s, stop_ids) for i, (p, s) in enumerate(zip(prompts, sampling))]
            events = {r.id: [] for r in reqs}
            while engine.has_work:
                for ev in engine.step():
                    events[ev.request.id].append(ev.new_tokens)
        finally:
            engine.config.async_scheduling = True
        assert all(n == 0 for n in engine.pages_in_use().values())
        assert sorted(engine.kv.free_slots) == list(range(engine.config.max_num_seqs))
        return [(r.output, r.finish_reason, [t for e in events[r.id] for t in e]) for r in reqs]

    free_run = run(False, frozenset())
    stops = frozenset({free_run[0][0][3], free_run[2][0][5]})  # two sequences stop early, the others may too
    sync = run(False, stops)
    assert [f for _, f, _ in sync].count("stop") >= 2
    assert run(True, stops) == sync
    assert all(out == toks for out, _, toks in sync), "the events carry exactly the output"


def test_pages_never_leak_and_admission(jax_models, tiny_ckpts):
    """Many requests of mixed lengths through a pool too small for all at once: requests wait for pages, all
    finish, and every page returns. A pool that cannot hold one max_model_len sequence is refused at start-up,
    and requests that can never be served are refused at once."""
    from gemma4_mtp_jax.engine import Engine, RequestError

    target = jax_models.target(tiny_ckpts["b31b"]["target_plain"])
    # Room for ~2 sequences of 40 tokens in the full-layer pool.
    engine = Engine(target, _engine_config(num_pages={"full_attention": 21, "sliding_attention": 30},
                                           max_model_len=48))
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(14):
        p = rng.integers(3, 512, size=int(rng.integers(1, 30))).tolist()
        reqs.append(engine.add_request(p, int(rng.integers(1, 18))))
    cancelled = reqs[5]
    max_running, steps = 0, 0
    while engine.has_work:
        engine.step()
        steps += 1
        max_running = max(max_running, len(engine.scheduler.running))
        if steps == 2:
            engine.cancel(cancelled)
        used = engine.pages_in_use()
        assert used["full_attention"] <= 20 and used["sliding_attention"] <= 29
    assert all(r.finished for r in reqs)
    for r in reqs:
        if r is not cancelled:
            assert len(r.output) == r.max_new_tokens and r.finish_reason == "length"
    assert cancelled.finish_reason == "cancelled"
    assert engine.pages_in_use() == {"full_attention": 0, "sliding_attention": 0}
    assert 1 < max_running <= 4
    with pytest.raises(ValueError, match="cannot hold even one sequence"):
        Engine(target, _engine_config(num_pages={"full_attention": 11, "sliding_attention": 30}, max_model_len=44,
                                      compile_at_start=False))
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request([5] * 40, 20)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request([5, 512], 2)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], 2)
    with pytest.raises(RequestError, match="stop token id 512"):
        engine.add_request([5], 2, stop_ids=frozenset({1, 512}))


def test_preemption_keeps_output_and_pages(jax_models, tiny_ckpts):
    """Pages are taken as sequences grow: four requests whose peak needs (39 full-layer pages) exceed a pool of 19
    run together anyway; when the pool runs dry the newest are preempted and later resume by recomputing their K/V.
    Every output (greedy and seeded sampling) equals the run with pages to spare, and every page comes back."""
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.model.sampling import SamplingParams

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    prompts = _prompts(11, [6, 14, 9, 21])
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(),
                SamplingParams(temperature=1.1, top_k=30, seed=9)]

    def run(num_pages):
        engine = Engine(target, _engine_config(num_pages=num_pages, max_model_len=48, compile_at_start=False))
        reqs = [engine.add_request(p, 24, s) for p, s in zip(prompts, sampling)]
        max_running = 0
        while engine.has_work:
            engine.step()
            max_running = max(max_running, len(engine.scheduler.running))
            assert engine.pages_in_use()["full_attention"] <= engine.kv.pages_total()["full_attention"]
        assert engine.pages_in_use() == {g: 0 for g in engine.kv.allocators}
        assert sorted(engine.kv.free_slots) == list(range(engine.config.max_num_seqs))
        assert all(r.finish_reason == "length" and len(r.output) == 24 for r in reqs)
        return engine, reqs, max_running

    roomy, want, _ = run(None)
    assert roomy.scheduler.num_preemptions == 0
    ring = roomy.layout.table_width("sliding_attention")  # four rings: the sliding pool never preempts
    tight, got, max_running = run({"full_attention": 20, "sliding_attention": 4 * ring + 1})
    assert [r.output for r in got] == [r.output for r in want]
    assert tight.scheduler.num_preemptions == sum(r.num_preemptions for r in got) > 0
    assert got[0].num_preemptions == 0, "the oldest request must never be the one preempted"
    assert max_running == 4, "on-demand pages should let all four start together"
    assert got[3].stats()["preemptions"] == got[3].num_preemptions


def test_long_prompt_prefills_a_budget_per_step(engines):
    """A 40-token prompt arriving while two sequences decode is prefilled one chunk (8 tokens) per step, each step
    still decoding the others, who thus wait at most one chunk per token; with nothing decoding, a prompt
    prefills at once. Every output equals its run alone."""
    from gemma4_mtp_jax.generate import generate

    engine = engines("e2b")
    short, long_ = _prompts(21, [5, 7]), _prompts(22, [40])[0]
    alone = [r.tokens for r in generate(engine.target, short + [long_], 12, engine=engine)]
    engine.kv.reset_prefix_cache()  # the chunk counts below are of prompts prefilled from scratch
    chunks = []
    runner = engine.runner
    real = runner.prefill

    def spy(req, row, budget):
        before = req.prefilled
        out = real(req, row, budget)
        chunks.append((len(engine.scheduler.running) - 1, req.prefilled - before, budget))
        return out

    runner.prefill = spy
    try:
        reqs = [engine.add_request(p, 12) for p in short]
        engine.step()  # nothing decodes yet: both prompts prefill at once
        assert [c[1] for c in chunks] == [5, 7] and all(c[2] is None for c in chunks)
        late = engine.add_request(long_, 12)
        chunks.clear()
        steps = 0
        while not late.decoding:
            before = [len(r.output) for r in reqs]
            engine.step()
            steps += 1
            # With async scheduling a step returns the step before's tokens: the streams' first decode step
            # (dispatched now) shows one step later.
            grew = 0 if steps == 1 and engine.config.async_scheduling else 1
            assert [len(r.output) for r in reqs] == [b + grew for b in before], "the running streams stalled"
        assert [c[1] for c in chunks] == [8] * 5 and steps == 5
        engine.run()
    finally:
        del runner.prefill
    assert [r.output for r in reqs + [late]] == alone
    assert all(n == 0 for n in engine.pages_in_use().values())


def test_kv_cache_bytes_sizes_the_pools(jax_models, tiny_ckpts):
    """kv_cache_bytes: every running sequence's sliding ring and the prefix cache's spare ring, the rest as
    full-layer pages (within the budget); a budget below one max_model_len sequence is refused with the bytes it
    needs; num_pages and kv_cache_bytes together are refused."""
    from gemma4_mtp_jax.engine import Engine

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    roomy = Engine(target, _engine_config(compile_at_start=False))
    per_page = roomy.page_bytes
    assert set(per_page) == {"full_attention", "sliding_attention"}
    ring = roomy.layout.table_width("sliding_attention")
    rings = (5 * ring + 1) * per_page["sliding_attention"]
    budget = rings + 40 * per_page["full_attention"] + 123
    engine = Engine(target, _engine_config(kv_cache_bytes=budget, compile_at_start=False))
    assert engine.kv.pages_total() == {"sliding_attention": 5 * ring, "full_attention": 39}
    uncached = Engine(target, _engine_config(kv_cache_bytes=budget, compile_at_start=False,
                                             enable_prefix_caching=False))
    assert uncached.kv.pages_total()["sliding_attention"] == 4 * ring
    assert budget - per_page["full_attention"] < engine.kv_cache_bytes() <= budget
    assert roomy.kv_cache_bytes() == sum(roomy.layout.pages(g) * per_page[g] for g in per_page)
    # An fp8 cache: a page takes a quarter of float32's bytes, so the same budget holds over 4x the full pages.
    fp8 = Engine(target, _engine_config(kv_cache_bytes=budget, compile_at_start=False, cache_dtype="fp8"))
    assert fp8.page_bytes == {g: b // 4 for g, b in per_page.items()}
    assert fp8.kv.pages_total()["sliding_attention"] == 5 * ring and fp8.kv.pages_total()["full_attention"] >= 4 * 39
    assert budget - fp8.page_bytes["full_attention"] < fp8.kv_cache_bytes() <= budget
    with pytest.raises(ValueError, match="needs at least"):
        Engine(target, _engine_config(kv_cache_bytes=rings + 5 * per_page["full_attention"], compile_at_start=False))
    with pytest.raises(ValueError, match="not both"):
        Engine(target, _engine_config(kv_cache_bytes=budget, num_pages={"full_attention": 40,
                                                                         "sliding_attention": 40}))


def test_default_pools_fit_the_device_memory(jax_models, tiny_ckpts, monkeypatch):
    """Without kv_cache_bytes the pools hold max_num_seqs sequences of max_model_len where the device memory left
    allows (`pool_memory_left`), else they are sized to that memory as kv_cache_bytes would size them; memory
    below the sliding rings is refused with the bytes needed. On a device without a memory limit (CPU) nothing
    changes."""
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.engine import memory as engine_mod

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    roomy = Engine(target, _engine_config(compile_at_start=False))
    per_page = roomy.page_bytes
    ring = roomy.layout.table_width("sliding_attention")
    left = (5 * ring + 1) * per_page["sliding_attention"] + 40 * per_page["full_attention"] + 123
    monkeypatch.setattr(engine_mod, "pool_memory_left", lambda devices, params: left)
    fitted = Engine(target, _engine_config(compile_at_start=False))
    assert fitted.kv.pages_total() == Engine(target, _engine_config(kv_cache_bytes=left,
                                                                  compile_at_start=False)).kv.pages_total()
    monkeypatch.setattr(engine_mod, "pool_memory_left", lambda devices, params: roomy.kv_cache_bytes())
    assert Engine(target, _engine_config(compile_at_start=False)).kv.pages_total() == roomy.kv.pages_total()
    monkeypatch.setattr(engine_mod, "pool_memory_left", lambda devices, params: 5 * per_page["full_attention"])
    with pytest.raises(ValueError, match="the device memory left for the KV cache=.* needs at least"):
        Engine(target, _engine_config(compile_at_start=False))


def test_compile_all_compiles_each_program_as_soon_as_it_is_lowered(engines, monkeypatch):
    """ProgramSet.compile lowers one program at a time, step programs first, and hands each to a compile thread at
    once: a compilation runs while later programs are lowered. Every program is stored and reported once."""
    import threading

    from gemma4_mtp_jax.programs import program_set as step_mod

    programs = engines("e2b").programs
    steps = programs.steps
    events, lowered, stored = [], threading.Event(), {}

    def fake_programs(batch_buckets, prefill_buckets, round_sizes=None):
        names = [f"prefill[1x{t}]" for t in prefill_buckets] + [f"decode[{b}]" for b in batch_buckets]

        class Jitted:
            def __init__(self, name):
                self.name = name

            def lower(self, *args):
                events.append(("lower", self.name))
                if self.name == names[len(prefill_buckets) - 1]:  # lowered last: a compilation runs meanwhile
                    assert lowered.wait(30), "no compilation started before the last lowering"
                return self.name
        return [(n, lambda n=n: (Jitted(n), ()), lambda c, n=n: stored.__setitem__(n, c)) for n in names]

    def fake_compile(low, autotune):
        lowered.set()
        return f"compiled {low}"

    monkeypatch.setattr(steps, "programs", fake_programs)
    monkeypatch.setattr(step_mod, "compile_lowered", fake_compile)
    reported = []
    times = programs.compile([2, 4], [8, 16], progress=lambda name, s: reported.append(name), threads=2)
    order = [name for kind, name in events]
    assert order == ["decode[2]", "decode[4]", "prefill[1x8]", "prefill[1x16]"]
    assert sorted(reported) == sorted(order) == sorted(times) and stored == {n: f"compiled {n}" for n in order}


def test_compile_all_lowers_nothing_once_stopped(engines, monkeypatch):
    """`stop` (Engine.close during a background compile): no program is lowered after it is set; those already
    compiling are kept."""
    import threading

    from gemma4_mtp_jax.programs import program_set as step_mod

    programs, stop, lowered = engines("e2b").programs, threading.Event(), []
    steps = programs.steps

    class Jitted:
        def __init__(self, name):
            self.name = name

        def lower(self, *args):
            lowered.append(self.name)
            stop.set()
            return self.name

    monkeypatch.setattr(steps, "programs", lambda batch, prefill, round_sizes=None: [
        (n, lambda n=n: (Jitted(n), ()), lambda c: None) for n in ("decode[4]", "decode[2]", "prefill[1x8]")])
    monkeypatch.setattr(step_mod, "compile_lowered", lambda low, autotune: f"compiled {low}")
    times = programs.compile([2, 4], [8], stop=stop)
    assert lowered == ["decode[4]"] and list(times) == ["decode[4]"]


def test_compile_in_background_serves_within_the_compiled_buckets(engines, jax_models, tiny_ckpts, monkeypatch):
    """compile_in_background: the engine is back once the smallest batch bucket's and prefill bucket's programs
    are compiled. Until the others are, it runs at most that batch and prefills in chunks of that bucket, never
    compiling on its own thread; the tokens are those of an engine that compiled everything first, and once the
    background is done it batches as wide as max_num_seqs.

    Where XLA autotunes (the GPU; here said so), the three first programs compile without autotuning, and the
    background, once the other buckets' are done, replaces them with tuned ones, which serve the same tokens.
    Until the last replacement lands the engine counts them untuned (what /health's programs_final reads), even
    once every bucket's program is compiled."""
    import threading
    import time

    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.programs import program_set as step_mod

    real, gate, tuned_gate, calls = step_mod.compile_lowered, threading.Event(), threading.Event(), []

    def gated(lowered, autotune):
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("the engine compiled a program on its own thread")
        calls.append(autotune)
        # The four start-up programs go through; the other buckets' wait for `gate`, the tuned replacements
        # of the first four for `tuned_gate`.
        if len(calls) > 4:
            assert (gate if len(calls) <= 8 else tuned_gate).wait(300)
        return real(lowered, autotune)

    monkeypatch.setattr(step_mod, "compile_lowered", gated)
    monkeypatch.setattr(step_mod, "quick_compiles", lambda: True)
    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    engine = Engine(target, _engine_config(compile_in_background=True))  # batch buckets [2, 4], prefill [4, 8]
    first = {"decode[2]": engine.steps.decode[(2, False, False)], "prefill[1x4]": engine.steps.prefill[(1, 4)]}
    try:
        assert engine.programs.ready() == (4, 8) and engine.stats()["programs_untuned"] == 4
        assert calls == [False] * 4 and engine.programs.untuned == {"decode[2]", "decode[2,sampled]",
                                                                    "decode[2,processed]", "prefill[1x4]"}
        prompts = _prompts(11, [3, 9, 20, 5])

        def serve(eng):
            reqs = [eng.add_request(p, MAX_NEW) for p in prompts]
            widest = 0
            while eng.has_work:
                eng.step()
                widest = max(widest, len(eng.scheduler.running))
            return [r.output for r in reqs], widest

        early, widest = serve(engine)
        assert widest == 2 and engine.programs.ready() == (4, 8)
        gate.set()
        deadline = time.monotonic() + 300
        while len(calls) < 9 and time.monotonic() < deadline:  # every bucket compiled, the replacements begun
            time.sleep(0.01)
        assert engine.programs.ready() == (8, 8) and engine.stats()["programs_untuned"] == 4
        tuned_gate.set()
        assert engine.programs.wait(300) and engine.programs.ready() == (8, 8)
        assert engine.stats()["programs_untuned"] == 0
        assert calls == [False] * 4 + [True] * 8 and engine.programs.untuned == set()
        assert engine.steps.decode[(2, False, False)] is not first["decode[2]"]
        assert engine.steps.prefill[(1, 4)] is not first["prefill[1x4]"]
        late, widest = serve(engine)
        assert widest == 4
        reference, _ = serve(engines("e2b"))
        assert early == late == reference
    finally:
        gate.set()
        tuned_gate.set()
        engine.close()


def test_programs_are_listed_costliest_first(engines):
    """compile_all starts programs in this order: the processed step programs, sampling's, then the greedy ones,
    larger buckets first, then prefill, longer chunks first (the order of their compile times on the H200:
    docs/decisions/0013-compile-in-background.md)."""
    import re

    names = [name for name, *_ in engines("e2b").steps.programs([2, 4], [8, 16])]
    steps = [(re.search(r",(\w+)\]$", n).group(1) if "," in n else "", int(re.search(r"\[(\d+)", n).group(1)))
             for n in names if not n.startswith("prefill")]
    assert steps == [("processed", 4), ("processed", 2), ("sampled", 4), ("sampled", 2), ("", 4), ("", 2)]
    assert [n for n in names if n.startswith("prefill")] == ["prefill[1x16]", "prefill[1x8]"]


def test_out_of_device_memory_at_start_up_is_explained(jax_models, tiny_ckpts, monkeypatch):
    """A device out of memory while the engine places its weights, allocates its pools or compiles (XLA's
    autotuner allocates too) is said in the engine's terms: what takes the memory and which settings help."""
    import jax

    from gemma4_mtp_jax.engine import DeviceMemoryError, Engine
    from gemma4_mtp_jax.programs.arrays import ProgramArrays
    from gemma4_mtp_jax.programs.program_set import ProgramSet

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Not enough PA budget: pa_allocated=1B")

    monkeypatch.setattr(ProgramSet, "compile", exhausted)
    with pytest.raises(DeviceMemoryError, match=r"compiling the step programs.*the weights take .* GB and the KV "
                                                r"pools .* GB \(max_num_seqs=4 sequences of max_model_len=64.*"
                                                r"--kv-cache-memory.*Not enough PA budget"):
        Engine(target, _engine_config())
    monkeypatch.setattr(ProgramArrays, "init_state", exhausted)
    with pytest.raises(DeviceMemoryError, match="allocating the KV pools"):
        Engine(target, _engine_config(compile_at_start=False))
    monkeypatch.setattr(ProgramArrays, "init_state", lambda self: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError("INTERNAL: something else")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):  # other runtime errors pass through
        Engine(target, _engine_config(compile_at_start=False))


def test_pool_memory_left_counts_weights_and_reserve():
    """Each device's allocator limit less what it holds, less the weights still in host memory (split over the
    devices) and the reserve (twice the largest weight + 1 GiB); None without a memory limit."""
    import jax.numpy as jnp

    from gemma4_mtp_jax.engine import pool_memory_left

    class Device:  # an accelerator none of this test's arrays live on (the suite runs on CPUs and on GPUs)
        platform, process_index = "accelerator", jax.process_index()

        def __init__(self, limit, used):
            self.stats = {"bytes_limit": limit, "bytes_in_use": used}

        def memory_stats(self):
            return self.stats

    GiB = 1 << 30
    host = {"w": np.zeros((1024, 1024), np.float32), "v": np.zeros(256, np.float32)}  # 4 MiB + 1 KiB
    elsewhere = jnp.zeros(512, jnp.float32)  # on this machine's default device: still to be placed
    reserve = 2 * (4 << 20) + GiB
    assert pool_memory_left([Device(10 * GiB, 2 * GiB)], host) == 8 * GiB - (4 << 20) - 1024 - reserve
    two = [Device(10 * GiB, 3 * GiB), Device(10 * GiB, 2 * GiB)]
    assert pool_memory_left(two, (host, elsewhere)) == 2 * (7 * GiB - ((4 << 20) + 1024 + 2048) // 2 - reserve)
    assert pool_memory_left([Device(GiB, GiB)], host) == 0
    # Shapes alone (an engine compiling before the weights load, compile_ahead) count as the weights to come.
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
    assert pool_memory_left([Device(10 * GiB, 2 * GiB)], shapes) == pool_memory_left([Device(10 * GiB, 2 * GiB)], host)

    class CPU:
        platform, process_index = "cpu", jax.process_index()

        def memory_stats(self):
            return None

    assert pool_memory_left([CPU()], host) is None


def test_pool_memory_left_where_the_allocator_reports_nothing(monkeypatch):
    """XLA's VMM allocator reports no memory_stats: the limit is the GPU's memory times JAX's fraction, and the
    weights already on the device count as what it holds (nothing else is known)."""
    from gemma4_mtp_jax import xla_env
    from gemma4_mtp_jax.engine import memory as engine_mod
    from gemma4_mtp_jax.engine import pool_memory_left

    GiB = 1 << 30

    class Device:
        platform, process_index, local_hardware_id = "gpu", jax.process_index(), 0

        def memory_stats(self):
            return None

    monkeypatch.setattr(xla_env, "_cuda_total_memory", lambda ordinal: 100 * GiB)
    monkeypatch.setenv(xla_env.MEM_FRACTION_ENV, "0.5")
    assert xla_env.allocator_memory(Device()) == (50 * GiB, None)
    monkeypatch.delenv(xla_env.MEM_FRACTION_ENV)
    assert xla_env.allocator_memory(Device()) == (int(100 * GiB * xla_env.JAX_DEFAULT_MEM_FRACTION), None)
    monkeypatch.setattr(xla_env, "_cuda_total_memory", lambda ordinal: None)  # no CUDA driver
    assert xla_env.allocator_memory(Device()) is None and pool_memory_left([Device()], {}) is None

    # The pool: the weights on the device (on this machine's default device, which the fake device pretends to
    # be) count as the allocator's use; those in host memory as still to come.
    on_device = jax.numpy.zeros((1024, 1024), jax.numpy.float32)  # 4 MiB
    monkeypatch.setattr(Device, "platform", on_device.devices().pop().platform)
    monkeypatch.setattr(engine_mod, "allocator_memory", lambda device: (50 * GiB, None))
    host = np.zeros(256, np.float32)
    reserve = 2 * (4 << 20) + GiB
    assert pool_memory_left([Device()], {"w": on_device, "v": host}) == 50 * GiB - (4 << 20) - 1024 - reserve
    assert pool_memory_left([Device(), Device()], on_device) == 2 * (50 * GiB - (2 << 20) - reserve)


def test_stop_on_eos(engines, tiny_ckpts):
    """Generation stops at (and includes) a stop id; the rest of max_new_tokens is not generated."""
    from gemma4_mtp_jax.generate import generate

    engine = engines("a26b")
    prompt = _prompts(4, [9])[0]
    free = generate(engine.target, [prompt], MAX_NEW, engine=engine)[0].tokens
    stop = free[6]
    first = free.index(stop)
    out = generate(engine.target, [prompt], MAX_NEW, engine=engine, stop_ids=frozenset([stop]))[0]
    assert out.tokens == free[: first + 1] and out.stats["finish_reason"] == "stop"


def test_seeded_sampling_reproducible(engines):
    from gemma4_mtp_jax.generate import generate
    from gemma4_mtp_jax.model.sampling import SamplingParams

    engine = engines("e2b")
    prompts = _prompts(5, [7, 12])
    sp = [SamplingParams(temperature=1.0, top_p=0.95, seed=11), SamplingParams(temperature=0.8, top_k=20, seed=12)]
    a = generate(engine.target, prompts, 12, sp, engine=engine)
    b = generate(engine.target, prompts[::-1], 12, sp[::-1], engine=engine)  # other order, other rows
    c = generate(engine.target, prompts[:1], 12, sp[:1], engine=engine)
    assert a[0].tokens == b[1].tokens == c[0].tokens and a[1].tokens == b[0].tokens
    d = generate(engine.target, prompts[:1], 12, [SamplingParams(temperature=1.0, top_p=0.95, seed=99)], engine=engine)
    greedy = generate(engine.target, prompts[:1], 12, engine=engine)
    assert d[0].tokens != a[0].tokens or a[0].tokens != greedy[0].tokens  # the seed matters (or sampling did)


def _numpy_filter(logits, top_k, top_p):
    out = np.full_like(logits, -np.inf)
    for b in range(logits.shape[0]):
        order = np.argsort(-logits[b], kind="stable")
        keep = order if top_k[b] <= 0 else order[: top_k[b]]
        lg = logits[b, keep]
        p = np.exp(lg - lg.max())
        p /= p.sum()
        before = np.cumsum(p) - p
        keep = keep[(before < top_p[b]) | (np.arange(len(keep)) == 0)]
        out[b, keep] = logits[b, keep]
    return out


def test_top_k_top_p_masks_match_reference():
    from gemma4_mtp_jax.model.sampling import filter_logits

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 300)).astype(np.float32) * 3
    top_k = np.array([0, 1, 5, 40, 0, 300], np.int32)
    top_p = np.array([1.0, 0.5, 0.9, 0.3, 0.05, 0.999], np.float32)
    # ties cut by top-k and by top-p: the lower token id goes first
    logits[4, :] = -5.0
    logits[4, [7, 3, 250, 9]] = 2.0
    logits[5, :] = np.repeat(np.arange(60, dtype=np.float32), 5)[::-1] / 10
    top_k[4], top_p[4], top_p[5] = 3, 1.0, 0.1
    ties = np.array([[0.0] * 300], np.float32)
    logits, top_k, top_p = np.concatenate([logits, ties]), np.append(top_k, 0), np.append(top_p, 0.021)
    got = np.asarray(filter_logits(logits, top_k, top_p))
    want = _numpy_filter(logits, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
    assert np.flatnonzero(np.isfinite(got[4])).tolist() == [3, 7, 9]
    assert np.flatnonzero(np.isfinite(got[6])).tolist() == list(range(7))  # 300 equal: 7 reach mass 0.021


def test_sampling_distribution_follows_temperature():
    """Sampled tokens follow softmax(logits / T): a chi-square-style check on a 4-token vocabulary."""
    import jax.numpy as jnp

    from gemma4_mtp_jax.model.sampling import SamplingBatch, sample

    logits = jnp.tile(jnp.array([[2.0, 1.0, 0.0, -1.0]]), (4000, 1))
    n = logits.shape[0]
    params = SamplingBatch(np.full(n, 0.7, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                           np.arange(n, dtype=np.uint32))
    toks = np.asarray(sample(logits, params, np.zeros(n, np.int32)))
    freq = np.bincount(toks, minlength=4) / n
    p = np.asarray(jax.nn.softmax(logits[0] / 0.7))
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n)


# ------------------------------------------------------------------------------------------- failure isolation
class _ExplodingSampling:
    """Wraps a request's SamplingParams: its batch row cannot be built."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def row(self):
        raise OverflowError("injected: a sampling value that does not fit its row")


class _ExplodingOutput(list):
    """A request's output that cannot take new tokens (the host's part of reading a step)."""

    def __iadd__(self, tokens):
        raise RuntimeError("injected: taking its tokens failed")


class _ExplodingPages(list):
    """A request's page list whose length (read when its page-table row is built) raises."""

    def __len__(self):
        raise RuntimeError("injected: page table row")


def _inject(engine, fault, victim, monkeypatch):
    if fault.startswith("sampling-row"):
        victim.sampling = _ExplodingSampling(victim.sampling)
    elif fault == "taking-tokens":
        victim.output = _ExplodingOutput(victim.output)
    elif fault == "page-table-row":
        pages = engine.kv.seq(victim).pages
        g = sorted(pages)[0]
        pages[g] = _ExplodingPages(pages[g])
    elif fault == "page-allocation":  # the victim's second KV group: its first group's pages must come back
        g = sorted(engine.kv.allocators)[-1]
        alloc = engine.kv.allocators[g]
        real, calls = alloc.allocate, []

        def allocate(n):
            calls.append(n)
            if len(calls) == 2:  # the second request admitted: the victim
                raise RuntimeError("injected: allocation failed")
            return real(n)

        monkeypatch.setattr(alloc, "allocate", allocate)


# (fault, the step before which it is injected: 0 = before the victim's prefill)
FAULTS = [("sampling-row-prefill", 0), ("sampling-row-decode", 3), ("page-table-row", 3), ("taking-tokens", 2),
          ("page-allocation", 0)]


@pytest.mark.parametrize("fault,at_step", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_in_one_request_fails_it_alone(engines, monkeypatch, fault, at_step):
    """A fault in one request's part of a running batch (its sampling row, page-table row, taking its tokens, or
    page allocation) ends that request alone with "error"; the others' tokens equal an undisturbed run, every page and
    slot comes back, and the engine keeps serving with unchanged output."""
    from gemma4_mtp_jax.model.sampling import SamplingParams

    engine = engines("e2b")
    prompts = _prompts(7, [5, 9, 13, 7])
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=3),
                SamplingParams(temperature=0.7, top_k=20, seed=4), SamplingParams()]

    def run(inject: bool):
        reqs = [engine.add_request(p, 12, s) for p, s in zip(prompts, sampling)]
        victim, events = reqs[1], []
        for step in range(100):  # 13 steps do it; more means pages leaked and requests wait for them forever
            if not engine.has_work:
                break
            if inject and step == at_step:
                _inject(engine, fault, victim, monkeypatch)
            events += [e for e in engine.step() if e.request is victim]
        monkeypatch.undo()
        assert not engine.has_work, "the engine stopped making progress"
        return reqs, events

    try:
        _check_fault_isolation(engine, run)
    finally:  # leave the shared engine empty whatever happened
        for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.cancel(req)


def _check_fault_isolation(engine, run):
    undisturbed, _ = run(False)
    assert all(r.finish_reason == "length" for r in undisturbed)
    disturbed, victim_events = run(True)
    victim = disturbed[1]
    assert victim.finish_reason == "error" and "injected" in victim.error, victim.error
    assert [e.finished for e in victim_events].count(True) == 1 and victim_events[-1].finished
    assert victim_events[-1].new_tokens == []
    for i in (0, 2, 3):
        assert disturbed[i].output == undisturbed[i].output and disturbed[i].finish_reason == "length", f"request {i}"
    assert all(n == 0 for n in engine.pages_in_use().values()), engine.pages_in_use()
    assert sorted(engine.kv.free_slots) == list(range(engine.config.max_num_seqs))
    assert not engine.scheduler.running and not engine.scheduler.waiting
    again, _ = run(False)
    assert [r.output for r in again] == [r.output for r in undisturbed]


def test_compile_falls_back_when_xla_refuses_an_option(monkeypatch, caplog):
    """step.compiler_options() names an XLA option of recent GPU builds; an XLA that refuses it still compiles the
    program (without it), says so once, and stops asking."""
    from gemma4_mtp_jax.programs import compiled as step

    monkeypatch.setattr(step, "compiler_options", lambda: {"xla_gpu_command_buffer_update_mode": "NO_SUCH_MODE"})
    monkeypatch.setattr(step, "_options_rejected", [])
    lowered = jax.jit(lambda x: x * 2).lower(np.float32(3))
    with caplog.at_level("WARNING", logger="gemma4_mtp_jax.programs.compiled"):
        assert float(step.compile_lowered(lowered)(np.float32(3))) == 6.0
        assert float(step.compile_lowered(lowered)(np.float32(4))) == 8.0
    assert len(step._options_rejected) == 1 and "NO_SUCH_MODE" in step._options_rejected[0]
    assert sum("compiling without" in r.message for r in caplog.records) == 1


def test_this_xla_takes_the_untuned_options(monkeypatch):
    """The untuned programs' options (step.UNTUNED) are ones this XLA accepts: a refused option would compile the
    program tuned after all, and every program after it without compiler_options() (XLA once refused the
    string 'false' for a bool option, and the server's first programs compiled tuned, slower to start)."""
    from gemma4_mtp_jax.programs import compiled as step

    monkeypatch.setattr(step, "_options_rejected", [])
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    lowered = jax.jit(lambda x: x @ x).lower(a)
    np.testing.assert_allclose(np.asarray(step.compile_lowered(lowered, autotune=False)(a)), a @ a)
    assert step._options_rejected == []


def test_step_inputs_and_result_move_in_one_array(engines):
    """Each program takes its per-row host inputs as one int32 array, donated, and returns its packed result over
    that array's first columns: on the GPU, two command-buffer nodes (the write into the state's staging buffer
    and the result's write), not one per reader or per temporary, follow the one buffer that moves each call
    (input_pack.py). Every output aliases a donated parameter, so no output has an allocation XLA could share
    with temporaries."""
    from gemma4_mtp_jax.programs.input_pack import packed_width
    from testenv import hlo_outputs_of_their_own, hlo_parameter_users

    engine = engines("e2b")
    steps = engine.steps
    for name, compiled, (batch, tokens) in [("decode[2]", steps.compile_decode(2), (2, None)),
                                            ("decode[2,sampled]", steps.compile_decode(2, True), (2, None)),
                                            ("prefill[1x8]", steps.compile_prefill(1, 8), (1, 8))]:
        text = compiled.as_text()
        shape = f"s32[{batch},{packed_width(steps._abstract_inputs(batch, tokens))}]"
        users = hlo_parameter_users(text, shape)
        staged = [u for u in users if re.search(rf"= s32\[{steps.arrays.input_capacity}\]", u)]
        returned = [u for u in users if re.search(rf"= {re.escape(shape)}", u)]
        assert len(users) == 2 and len(staged) == 1 and len(returned) == 1, \
            f"{name}: the packed inputs {shape} are read by {len(users)} instructions: {users}"
        assert not hlo_outputs_of_their_own(text), f"{name}: outputs {hlo_outputs_of_their_own(text)} alias nothing"


def test_prompt_logprobs_are_the_models(tiny_ckpts, jax_models):
    """An engine with prompt_logprobs: a request asking for them gets, for each prompt token after the first, its
    logprob under the target's own distribution given the tokens before it (the dense reference forward's
    log-softmax, float32) and the top alternatives there, over several prefill chunks; a repeat of the same prompt
    gets them too (it computes its pages rather than taking cached ones); an engine without them refuses the
    request, naming the setting."""
    from gemma4_mtp_jax import target_forward
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.engine.request import RequestError
    from gemma4_mtp_jax.model.sampling import SamplingParams

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    engine = Engine(target, _engine_config(prompt_logprobs=True, compile_at_start=False))
    prompt = _prompts(21, [19])[0]
    reqs = [engine.add_request(prompt, 2, SamplingParams(prompt_logprobs=3, logprobs=1)) for _ in range(2)]
    engine.run()
    want = np.asarray(jax.nn.log_softmax(target_forward(target, np.asarray([prompt], np.int32)).logits[0], -1))
    for req in reqs:
        assert len(req.prompt_logprobs) == len(prompt) - 1
        for i, lp in enumerate(req.prompt_logprobs):
            assert lp.logprob == pytest.approx(want[i, prompt[i + 1]], abs=1e-4)
            top = np.argsort(-want[i], kind="stable")[:3]
            assert [t for t, _ in lp.top] == top.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], want[i, top], atol=1e-4)
        assert req.logprobs[0].logprob == pytest.approx(want[-1, req.output[0]], abs=1e-4)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        Engine(target, _engine_config(compile_at_start=False)).add_request(prompt, 2, SamplingParams(prompt_logprobs=0))
