"""The executable cache (executable_cache.py): an engine started again with the same configuration loads every
program from disk without lowering one and generates the same tokens; anything that shapes a program (the
configuration, the package's code) misses; a bad entry is compiled again."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_server_support import jax_cache_settings

PROMPTS = [[5, 9, 13, 200, 7], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]


def _config(cache_dir, **kw):
    from gemma4_mtp_jax.engine import EngineConfig

    base = dict(max_num_seqs=2, max_model_len=48, page_size=4, prefill_chunk=8, min_prefill_bucket=8,
                executable_cache_dir=str(cache_dir), num_speculative_tokens=2)
    base.update(kw)
    return EngineConfig(**base)


def _tokens(engine) -> list[list[int]]:
    from gemma4_mtp_jax.generate import generate

    return [r.tokens for r in generate(engine.target, PROMPTS, 10, engine=engine)]


@contextlib.contextmanager
def _jax_cache_off():
    import jax
    from jax._src import compilation_cache

    restore = jax_cache_settings()
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        restore()


@pytest.fixture(autouse=True)
def no_jax_cache():
    """JAX's persistent compilation cache off for each test here (an in-process server of another module may have
    left it on): a program it gave back is not stored on the CPU, which these tests would read as a miss."""
    with _jax_cache_off():
        yield


class _NoLowering:
    """A jitted function of the steps, callable but not to be lowered (the cache holds its program)."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, *args):
        return self.jitted(*args)

    def lower(self, *args):
        raise AssertionError("a program was lowered although the cache holds it")


@pytest.fixture(scope="module")
def pair(tiny_ckpts, jax_models):
    p = tiny_ckpts["e2b"]
    return jax_models.target(p["target"]), jax_models.assistant(p["assistant"])


@dataclasses.dataclass
class FirstStart:
    """An engine's first start with an empty executable cache: the cache's directory once written, the programs'
    names, those it restored, and the engine's tokens for PROMPTS."""

    directory: Path
    names: list[str]
    restored: list[str]
    tokens: list[list[int]]

    def copy(self, to: Path) -> Path:
        """The cache's entries copied to `to` (a test's own: loads and writes there touch no other test's)."""
        shutil.copytree(self.directory, to)
        return to


def _first_start(pair, directory: Path, **kw) -> FirstStart:
    from gemma4_mtp_jax.engine import Engine

    target, assistant = pair
    with _jax_cache_off():  # a module fixture comes before no_jax_cache
        first = Engine(target, _config(directory, **kw), assistant=assistant)
        return FirstStart(directory, sorted(first.compile_times), list(first.programs.restored), _tokens(first))


@pytest.fixture(scope="module")
def first_start(pair, tmp_path_factory) -> FirstStart:
    """The first start of `_config`'s engine (two batch rows), shared by the tests that need its cache or tokens
    (each engine compiles its four programs: ~20 s of the CPU suite)."""
    return _first_start(pair, tmp_path_factory.mktemp("first_start"))


@pytest.fixture(scope="module")
def first_start_1(pair, tmp_path_factory) -> FirstStart:
    """The first start of `_config`'s engine with one batch row (the tests whose engines start again and again)."""
    return _first_start(pair, tmp_path_factory.mktemp("first_start_1"), max_num_seqs=1, min_batch_bucket=1)


def test_a_restart_loads_every_program_without_lowering(pair, first_start, tmp_path, monkeypatch):
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.programs.compiled import CompiledSteps

    target, assistant = pair
    names = first_start.names
    assert first_start.restored == [] and len(list(first_start.directory.glob("*.jaxexec"))) == len(names)
    want = first_start.tokens
    tmp_path = first_start.copy(tmp_path / "cache")

    real_jit = CompiledSteps._jit
    monkeypatch.setattr(CompiledSteps, "_jit", lambda self, *a: _NoLowering(real_jit(self, *a)))
    again = Engine(target, _config(tmp_path), assistant=assistant)
    assert sorted(again.programs.restored) == sorted(again.compile_times) == names
    assert _tokens(again) == want


def test_programs_compiled_ahead_from_shapes_are_the_engines(pair, first_start, tiny_ckpts, tmp_path, monkeypatch):
    """compile_ahead, given the checkpoints' shapes alone (api.target_shapes: only the JSON files read; no pools
    allocated), compiles the programs an engine compiles first and stores them. An engine built after loading the
    weights lowers none of them, whether it is handed them (compiled_ahead) or finds them in the cache, and
    generates the tokens of an engine that compiled its own."""
    from gemma4_mtp_jax.api import assistant_shapes, target_shapes
    from gemma4_mtp_jax.engine import Engine, compile_ahead
    from gemma4_mtp_jax.model.runtime import shapes_only
    from gemma4_mtp_jax.programs.compiled import CompiledSteps

    target, assistant = pair
    want = first_start.tokens  # an engine that compiled its own
    p = tiny_ckpts["e2b"]
    shapes = target_shapes(p["target"], "float32"), assistant_shapes(p["assistant"], "float32")
    assert shapes_only(shapes[0].params) and shapes_only(shapes[1].params)
    ahead = compile_ahead(shapes[0], _config(tmp_path / "ahead"), shapes[1])
    # prefill and the speculative round's three variants (greedy, sampled, processed)
    assert len(ahead) == 4 and len(list((tmp_path / "ahead").glob("*.jaxexec"))) == 4
    assert compile_ahead(shapes[0], _config(None, executable_cache_dir=None), shapes[1]) == {}  # nowhere to keep them

    real_jit = CompiledSteps._jit
    monkeypatch.setattr(CompiledSteps, "_jit", lambda self, *a: _NoLowering(real_jit(self, *a)))
    handed = Engine(target, _config(tmp_path / "elsewhere"), assistant=assistant, compiled_ahead=ahead)
    assert sorted(handed.programs.restored) == sorted(handed.compile_times) and len(handed.compile_times) == 4
    assert _tokens(handed) == want
    found = Engine(target, _config(tmp_path / "ahead"), assistant=assistant)
    assert sorted(found.programs.restored) == sorted(found.compile_times) and len(found.compile_times) == 4
    assert _tokens(found) == want


def test_fp8_programs_from_shapes_never_serve_weights(pair, tiny_ckpts, tmp_path):
    """An fp8 cache's scales come from the weights. Built from shapes alone (a compile-only tool), an engine's
    layout holds SHAPES_ONLY_SCALE for every layer instead and differs from the loaded engine's in nothing else;
    the programs' static description (the executable cache's key) differs with it, so a program compiled from
    shapes is never found for weights; compile_ahead compiles none (compile-only tools may still lower them)."""
    import dataclasses

    from gemma4_mtp_jax.api import assistant_shapes, target_shapes
    from gemma4_mtp_jax.engine import Engine, compile_ahead
    from gemma4_mtp_jax.model.kv_state import SHAPES_ONLY_SCALE

    target, assistant = pair
    p = tiny_ckpts["e2b"]
    shapes = target_shapes(p["target"], "float32"), assistant_shapes(p["assistant"], "float32")
    config = _config(tmp_path, cache_dtype="fp8", compile_at_start=False)
    from_shapes = Engine(shapes[0], config, assistant=shapes[1])
    loaded = Engine(target, config, assistant=assistant)
    assert set(from_shapes.layout.kv_scales().values()) == {(SHAPES_ONLY_SCALE, SHAPES_ONLY_SCALE)}
    real = loaded.layout.kv_scales()
    assert real.keys() == from_shapes.layout.kv_scales().keys()
    assert all(s == 2.0 ** round(np.log2(s)) for pair_ in real.values() for s in pair_), real
    assert dataclasses.replace(from_shapes.layout, scales=loaded.layout.scales) == loaded.layout
    assert from_shapes.steps.static_description() != loaded.steps.static_description()
    assert compile_ahead(shapes[0], config, shapes[1]) == {} and not list(tmp_path.glob("*.jaxexec"))
    jitted, args = from_shapes.steps.speculative_program(2, False)
    assert "f8E4M3FN" in jitted.lower(*args).as_text()  # compile-only tools still lower them


def test_untuned_programs_compiled_ahead_are_replaced_and_only_tuned_ones_stored(pair, tiny_ckpts, tmp_path,
                                                                                monkeypatch):
    """Where XLA autotunes (the GPU; here said so) and the engine compiles in the background, compile_ahead
    compiles the first programs without autotuning and stores none of them. The engine handed them serves with them
    until its background thread has compiled their tuned versions, which it stores for the next start."""
    from gemma4_mtp_jax.api import assistant_shapes, target_shapes
    from gemma4_mtp_jax.engine import Engine, compile_ahead
    from gemma4_mtp_jax.programs import program_set

    monkeypatch.setattr(program_set, "quick_compiles", lambda: True)
    target, assistant = pair
    p = tiny_ckpts["e2b"]
    shapes = target_shapes(p["target"], "float32"), assistant_shapes(p["assistant"], "float32")
    config = _config(tmp_path, compile_in_background=True, max_num_seqs=1, min_batch_bucket=1)
    ahead = compile_ahead(shapes[0], config, shapes[1])
    assert len(ahead) == 4 and list(tmp_path.glob("*.jaxexec")) == []
    engine = Engine(target, config, assistant=assistant, compiled_ahead=ahead)
    try:
        assert len(engine.programs.untuned) == 4
        assert engine.programs.wait(300) and engine.programs.untuned == set()
        assert len(list(tmp_path.glob("*.jaxexec"))) == 4 and all(engine.programs.by_key[k] is not ahead[k] for k in ahead)
    finally:
        engine.close()


def test_a_program_from_jax_persistent_cache_stored_only_where_it_runs(pair, tmp_path):
    """With JAX's persistent compilation cache on, an engine compiling programs already in it gets them back from
    it; on the CPU such an executable, serialized and loaded, fails when run ("Function ... not found"), so the
    executable cache does not store it there. Wherever it is stored, an engine loading it generates the tokens of a
    fresh compile (docs/decisions/0012-executable-cache.md)."""
    import jax

    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.programs.compiled import enable_compilation_cache

    target, assistant = pair
    enable_compilation_cache(str(tmp_path / "jax"))  # until the fixture turns it off again
    want = _tokens(Engine(target, _config(tmp_path / "fresh"), assistant=assistant))
    Engine(target, _config(tmp_path / "hits"), assistant=assistant)  # every program a hit in JAX's cache
    again = Engine(target, _config(tmp_path / "hits"), assistant=assistant)
    if jax.default_backend() == "cpu":
        assert again.programs.restored == []
    assert _tokens(again) == want


def test_what_shapes_a_program_misses(pair, first_start_1, tmp_path, monkeypatch):
    from gemma4_mtp_jax.programs import executable_cache
    from gemma4_mtp_jax.engine import Engine

    target, assistant = pair
    tmp_path = first_start_1.copy(tmp_path / "cache")  # the first start's programs
    entries = len(list(tmp_path.glob("*.jaxexec")))
    assert entries == len(first_start_1.names)
    longer = Engine(target, _config(tmp_path, max_num_seqs=1, min_batch_bucket=1, max_model_len=40),
                    assistant=assistant)
    assert longer.programs.restored == []  # another page-table width: every program differs
    plain = Engine(target, _config(tmp_path, max_num_seqs=1, min_batch_bucket=1, num_speculative_tokens=None),
                   assistant=None)
    assert plain.programs.restored == []
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited code")
    edited = Engine(target, _config(tmp_path, max_num_seqs=1, min_batch_bucket=1), assistant=assistant)
    assert edited.programs.restored == []
    assert len(list(tmp_path.glob("*.jaxexec"))) == entries + len(longer.compile_times) + len(
        plain.compile_times) + len(edited.compile_times)


def test_a_bad_entry_is_compiled_again(pair, first_start_1, tmp_path, caplog):
    from gemma4_mtp_jax.engine import Engine

    target, assistant = pair
    tmp_path = first_start_1.copy(tmp_path / "cache")  # the first start's programs
    want = first_start_1.tokens
    for entry in tmp_path.glob("*.jaxexec"):
        entry.write_bytes(b"not an executable")
    again = Engine(target, _config(tmp_path, max_num_seqs=1, min_batch_bucket=1), assistant=assistant)
    assert again.programs.restored == [] and "does not load" in caplog.text
    assert _tokens(again) == want
    third = Engine(target, _config(tmp_path, max_num_seqs=1, min_batch_bucket=1), assistant=assistant)
    assert sorted(third.programs.restored) == sorted(third.compile_times)  # rewritten by the second start


def test_the_least_recently_used_entries_go_past_the_size_limit(tmp_path):
    """Stores beyond max_bytes remove the entries used longest ago (a load is a use), never the one just
    written; a miss loads nothing."""
    import os

    import jax
    import jax.numpy as jnp

    from gemma4_mtp_jax.programs.executable_cache import ExecutableCache

    x = jnp.zeros(4, jnp.float32)
    compiled = jax.jit(lambda a: a + 1).lower(x).compile()
    args, out_like = (x,), x
    cache = ExecutableCache(tmp_path, max_bytes=1 << 40)
    for i, key in enumerate("abc"):
        assert cache.store(key, compiled, args, out_like)
        os.utime(tmp_path / f"{key}.jaxexec", (1000 + i, 1000 + i))  # a, then b, then c: c the newest
    size = (tmp_path / "a.jaxexec").stat().st_size
    assert cache.load("a", args, out_like) is not None  # a is now the most recently used
    assert cache.load("missing", args, out_like) is None
    cache.max_bytes = 2 * size
    assert cache.store("d", compiled, args, out_like)
    assert sorted(p.stem for p in tmp_path.glob("*.jaxexec")) == ["a", "d"]  # b and c were used longest ago
    cache.max_bytes = size // 2  # too small even for one: the entry just written stays
    assert cache.store("e", compiled, args, out_like)
    assert sorted(p.stem for p in tmp_path.glob("*.jaxexec")) == ["e"]
    assert jnp.array_equal(cache.load("e", args, out_like)(x), x + 1)


def test_a_read_only_cache_loads_and_never_fails(tmp_path, monkeypatch):
    """An entry that cannot be touched (a read-only directory) still loads, and one that cannot be removed after
    a failed load costs a compilation, not the start-up."""
    import os

    import jax
    import jax.numpy as jnp

    from gemma4_mtp_jax.programs.executable_cache import ExecutableCache

    x = jnp.zeros(4, jnp.float32)
    cache = ExecutableCache(tmp_path)
    assert cache.store("k", jax.jit(lambda a: a * 2).lower(x).compile(), (x,), x)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "utime", refuse)
    monkeypatch.setattr(type(tmp_path), "unlink", refuse)
    assert jnp.array_equal(cache.load("k", (x,), x)(x), x * 2)
    (tmp_path / "bad.jaxexec").write_bytes(b"not an executable")
    assert cache.load("bad", (x,), x) is None and (tmp_path / "bad.jaxexec").exists()
    monkeypatch.setattr("tempfile.mkstemp", refuse)
    assert not cache.store("k2", jax.jit(lambda a: a * 3).lower(x).compile(), (x,), x)


def test_an_engine_whose_cache_cannot_be_created_compiles(tmp_path, caplog):
    """A cache directory that cannot be created (a read-only home) costs its use, with a warning, not the start:
    the engine then compiles every program."""
    from gemma4_mtp_jax.programs.executable_cache import ExecutableCache

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert ExecutableCache.open(str(blocker / "cache")) is None
    assert any("cannot be used" in r.message for r in caplog.records)
    assert ExecutableCache.open(None) is None
    assert ExecutableCache.open(str(tmp_path / "ok")).directory == tmp_path / "ok"
