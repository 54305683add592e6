"""The GPU's programs on any machine: engines whose programs take every Pallas kernel their shapes allow, run in
interpret mode off the GPU (`attention_impl="pallas"`, `device_budget.pallas_kernels`), give transformers' greedy
tokens, plain and speculative. On the CPU, the kernel tests check each kernel alone; this is where the kernels'
contracts meet the engine's (page tables, rings, padding rows, the draft loop's reads of the target's pages)."""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny

PROMPT_LENGTHS = [5, 13, 22]  # shorter and longer than the window (8) and a prefill chunk (8)
MAX_NEW = 16
# The kernels the tiny e2b programs can take in float32 (the feed-forward block kernel takes 2-byte dtypes only; e2b
# has no experts), as (module, the function that launches the kernel).
KERNELS = [("paged_attention", "_paged_attention_pallas"), ("attention_inputs", "_attention_inputs_pallas"),
           ("split_k", "_add_normed_pallas"), ("centroid_head", "centroid_argmax")]


def test_kernel_choice_follows_pallas_kernels():
    """Outside the setting, off the GPU, "auto" keeps XLA's math; inside, it takes the kernels, interpreted; the
    setting ends with its block."""
    from gemma4_mtp_jax.kernels.device_budget import kernels_chosen, kernels_interpreted, on_gpu, pallas_kernels

    assert (kernels_chosen(), kernels_interpreted()) == (on_gpu(), False)
    with pallas_kernels():
        assert (kernels_chosen(), kernels_interpreted()) == (True, not on_gpu())
    assert (kernels_chosen(), kernels_interpreted()) == (on_gpu(), False)


def test_engines_with_the_kernels_give_transformers_tokens(tiny_ckpts, jax_models, monkeypatch):
    """e2b (centroid head, KV-shared layers, sliding rings), float32: a plain and a speculative (k = 4) engine with
    the Pallas kernels, three prompts batched, equal transformers' greedy generate token for token; every kernel
    the shapes allow was traced into their programs (counted at tracing), so the XLA path cannot pass for them."""
    import importlib

    import torch

    from gemma4_mtp_jax.engine import Engine, EngineConfig
    from gemma4_mtp_jax.generate import generate

    traced = {name: 0 for _, name in KERNELS}
    for module, name in KERNELS:
        mod = importlib.import_module(f"gemma4_mtp_jax.kernels.{module}")
        launch = getattr(mod, name)

        def counted(*args, _launch=launch, _name=name, **kwargs):
            traced[_name] += 1
            return _launch(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)

    paths = tiny_ckpts["e2b"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, hf_tiny.VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    model = hf_tiny.load_hf_target(str(paths["target"]))
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    target = jax_models.target(paths["target"])
    for k in (None, 4):
        cfg = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=4, prefill_chunk=8, min_prefill_bucket=8,
                           attention_impl="pallas", num_speculative_tokens=k)
        engine = Engine(target, cfg, assistant=jax_models.assistant(paths["assistant"]) if k else None)
        results = generate(target, prompts, MAX_NEW, engine=engine)  # 3 prompts on 2 slots: one joins later
        assert [r.tokens for r in results] == want, f"k={k}: the kernels' engine differs from transformers"
        if k:
            assert sum(r.stats["accepted"] for r in results) > 0, "no draft accepted: the draft loop proved little"
    assert len({t for w in want for t in w}) > 8, "degenerate references: the test would prove little"
    untraced = [name for name, n in traced.items() if n == 0]
    assert not untraced, f"these kernels never entered the engines' programs: {untraced}"
