"""param_pack: the target's vectors and scalars travel to the step programs packed, one array per dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.param_pack import ALIGN, MAX_PACKED_ELEMENTS, ParamPack


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
    # mode -> (kept leaves, packed arrays); kept under "vectors": emb, 3 proj, wide, split (a leaf split by tensor
    # parallelism, which `packable` keeps out); under "all": split only
    for mode, kept, groups in (("none", 12, 0), ("vectors", 6, 2), ("all", 1, 2)):
        pack = ParamPack.plan(tree, lambda path, _: "split" not in path, mode=mode)
        packed = pack.pack(tree)
        assert (len(packed.kept), len(packed.packed), pack.num_arrays) == (kept, groups, kept + groups), mode
        assert sorted(str(a.dtype) for a in packed.packed) == ["bfloat16", "float32"][:groups]
        assert all(s.index % ALIGN == 0 for s in pack.slots if s.group >= 0)
        back = jax.jit(pack.unpack)(packed)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(back)):
            assert a.shape == b.shape and a.dtype == b.dtype, (mode, path)
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))
        abstract = pack.abstract(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree))
        assert [(a.shape, a.dtype) for a in abstract.packed] == [(a.shape, a.dtype) for a in packed.packed]


def test_packed_arrays_are_capped(monkeypatch):
    from gemma4_mtp_jax import param_pack

    monkeypatch.setattr(param_pack, "GROUP_ELEMENTS", 256)
    tree = [jnp.ones((100,), jnp.float32) * i for i in range(5)]  # 128-element aligned slots: two per array
    pack = ParamPack.plan(tree, mode="vectors")
    assert pack.sizes == (228, 228, 100)
    back = pack.unpack(pack.pack(tree))
    for a, b in zip(tree, back):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="pack_params"):
        ParamPack.plan(tree, mode="everything")


def test_packed_parameters_give_the_same_output(tiny_ckpts, jax_models):
    from gemma4_mtp_jax.engine import Engine, EngineConfig

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])
    outputs = {}
    for pack in ("none", "vectors", "all"):
        engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=32, page_size=4, prefill_chunk=8,
                                             min_prefill_bucket=4, compile_at_start=False, pack_params=pack))
        leaves = jax.tree_util.tree_leaves(engine.steps.params)
        assert len(jax.tree_util.tree_leaves(engine.steps.program_params)) == engine.steps.pack.num_arrays
        if pack == "vectors":  # the norms and layer scalars are packed
            assert engine.steps.pack.num_arrays < len(leaves) * 3 // 4
        elif pack == "all":  # one array per dtype
            assert engine.steps.pack.num_arrays == len({a.dtype for a in leaves})
        else:
            assert engine.steps.pack.num_arrays == len(leaves)
        reqs = [engine.add_request(p, 6, stop_ids=frozenset()) for p in ([5, 6, 7], [9, 3, 4, 8, 2])]
        engine.run()
        outputs[pack] = [r.output for r in reqs]
    assert outputs["vectors"] == outputs["all"] == outputs["none"]
