"""param_pack: the target's vectors and scalars travel to the step programs packed, one array per dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.param_pack import MAX_PACKED_ELEMENTS, ParamPack


def _tree():
    rng = np.random.default_rng(0)
    return {"emb": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
            "layers": [{"norm": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16),
                        "scalar": jnp.asarray(rng.normal(), jnp.float32),
                        "proj": jnp.asarray(rng.normal(size=(4, 4)), jnp.bfloat16)} for _ in range(3)],
            "wide": jnp.zeros((MAX_PACKED_ELEMENTS + 1,), jnp.float32),
            "split": jnp.arange(6, dtype=jnp.float32)}


def test_pack_round_trips_inside_a_program():
    tree = _tree()
    pack = ParamPack.plan(tree, lambda path, _: "split" not in path)  # e.g. a leaf split by tensor parallelism
    packed = pack.pack(tree)
    # kept: emb, 3 proj, wide, split; packed: one bf16 group (norms) and one float32 group (scalars)
    assert len(packed.kept) == 6 and len(packed.packed) == 2 and pack.num_arrays == 8
    assert sorted(str(a.dtype) for a in packed.packed) == ["bfloat16", "float32"]
    back = jax.jit(pack.unpack)(packed)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(back)):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))
    abstract = pack.abstract(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree))
    assert [(a.shape, a.dtype) for a in abstract.packed] == [(a.shape, a.dtype) for a in packed.packed]


def test_packed_parameters_give_the_same_output(tiny_ckpts, jax_models):
    from gemma4_mtp_jax.engine import Engine, EngineConfig

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    outputs = {}
    for pack in (False, True):
        engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=32, page_size=4, prefill_chunk=8,
                                             min_prefill_bucket=4, compile_at_start=False, pack_params=pack))
        leaves = jax.tree_util.tree_leaves(engine.steps.params)
        assert len(jax.tree_util.tree_leaves(engine.steps.program_params)) == engine.steps.pack.num_arrays
        if pack:  # the norms and layer scalars are packed
            assert engine.steps.pack.num_arrays < len(leaves) * 3 // 4
        else:
            assert engine.steps.pack.num_arrays == len(leaves)
        reqs = [engine.add_request(p, 6, stop_ids=frozenset()) for p in ([5, 6, 7], [9, 3, 4, 8, 2])]
        engine.run()
        outputs[pack] = [r.output for r in reqs]
    assert outputs[True] == outputs[False]
