"""param_pack: the target's leaves travel to the step programs stacked as rows of a few arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.programs.param_pack import MAX_LEAF_ELEMENTS, ParamPack


def _tree():
    rng = np.random.default_rng(0)
    return {"emb": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
            "layers": [{"norm": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16),
                        "scalar": jnp.asarray(rng.normal(), jnp.float32),
                        "proj": jnp.asarray(rng.normal(size=(4, 4)), jnp.bfloat16),
                        "experts": jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.bfloat16),
                        # an fp8 projection and its float32 scale (weights/quantize.py)
                        "fp8": jnp.asarray(rng.normal(size=(4, 4)) * 100, jnp.float8_e4m3fn),
                        "fp8_scale": jnp.asarray(rng.random(4), jnp.float32)} for _ in range(3)],
            "wide": jax.ShapeDtypeStruct((MAX_LEAF_ELEMENTS + 1,), jnp.float32),
            "split": jnp.arange(6, dtype=jnp.float32)}


def _round_trip(pack, tree):
    back = jax.jit(pack.unpack)(pack.pack(tree))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(back)):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))


def test_pack_round_trips_inside_a_program():
    tree = _tree()
    small = {k: v for k, v in tree.items() if k != "wide"}
    # kept: split (refused by `packable`, e.g. a leaf split by tensor parallelism) and wide (too large);
    # packed, one array per (dtype, row width): f32 width 4 (emb, fp8 scales), bf16 width 4 (norms, projs, experts),
    # fp8 width 4, f32 width 1 (scalars)
    pack = ParamPack.plan(tree, lambda path, _: "split" not in path)
    assert pack.num_arrays == 2 + 4
    assert sorted((str(dt), rows, w) for dt, rows, w in pack.groups) == [
        ("bfloat16", 3 * (1 + 4 + 6), 4), ("float32", 3, 1), ("float32", 8 + 3, 4), ("float8_e4m3fn", 3 * 4, 4)]
    small_pack = ParamPack.plan(small, lambda path, _: "split" not in path)
    _round_trip(small_pack, small)
    abstract = small_pack.abstract(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), small))
    assert [(a.shape, a.dtype) for a in abstract.packed] == [(a.shape, a.dtype)
                                                             for a in small_pack.pack(small).packed]
    off = ParamPack.plan(small, enabled=False)
    assert off.num_arrays == len(jax.tree_util.tree_leaves(small)) and not off.groups
    _round_trip(off, small)


def test_packed_arrays_are_capped(monkeypatch):
    from gemma4_mtp_jax.programs import param_pack

    monkeypatch.setattr(param_pack, "GROUP_ELEMENTS", 256)
    tree = [jnp.ones((50, 2), jnp.float32) * i for i in range(5)]  # 100 elements each: two per array
    pack = ParamPack.plan(tree)
    assert [rows for _, rows, _ in pack.groups] == [100, 100, 50]
    _round_trip(pack, tree)


def test_packed_parameters_give_the_same_output(tiny_ckpts, jax_models):
    """The engine's outputs are the same with the parameters packed and unpacked. Whether XLA reads each weight in
    place or copies its slice first depends on which matmul kernel it picks, so it is counted at the real bf16
    shapes on the GPU (`benchmarks/kernel_count.py --pack-params`), not here: at these tiny float32 shapes the
    GPU may pick other kernels. (The GPU suite once failed an earlier version of this test that also
    compared kernel counts; the run was cut before pytest printed which assertion failed.)"""
    from gemma4_mtp_jax.api import load_target
    from gemma4_mtp_jax.engine import Engine, EngineConfig

    path = tiny_ckpts["e2b"]["target_plain"]
    # Packed, the weights come from host memory, as `serve --pack-params` loads them: only the packed arrays and
    # the leaves kept separate reach the device.
    targets = {False: jax_models.target(path), True: load_target(str(path), "float32", on_host=True)}
    assert all(isinstance(a, np.ndarray) for a in jax.tree_util.tree_leaves(targets[True].params))
    outputs = {}
    for pack in (False, True):
        engine = Engine(targets[pack], EngineConfig(max_num_seqs=2, max_model_len=32, page_size=4, prefill_chunk=8,
                                             min_prefill_bucket=4, compile_at_start=False, pack_params=pack))
        steps = engine.steps
        leaves = jax.tree_util.tree_leaves(steps.params)
        assert len(jax.tree_util.tree_leaves(steps.program_params)) == steps.arrays.pack.num_arrays
        assert steps.arrays.pack.num_arrays < len(leaves) // 4 if pack else steps.arrays.pack.num_arrays == len(leaves)
        assert all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(steps.program_params))
        reqs = [engine.add_request(p, 6, stop_ids=frozenset()) for p in ([5, 6, 7], [9, 3, 4, 8, 2])]
        engine.run()
        outputs[pack] = [r.output for r in reqs]
    assert outputs[True] == outputs[False]
