"""Speculative step vs plain decode at real Gemma 4 shapes (random weights: bf16, or fp8 with --quantization), in one
run.

For each model and batch size, over a context of --context tokens per sequence (K/V random): the decode step
(1 token), the verify step (the target's forward on k+1 tokens + logits), and the whole speculative step (k
draft steps of the assistant, verify, acceptance, bookkeeping: one program). Reports the ratio
speculative / decode and the projected speedup at a mean acceptance length L (tokens per round):
L * t_decode / t_spec. Acceptance itself is not measured here (random weights accept nothing); the step's
time does not depend on it (shapes never do). L is each model family's own at that k, measured or stated by a
peer (common.ACCEPTANCE_LENGTHS, its source in each row's `acceptance_length_source`), or --acceptance-length for
every row; a family and k with none known get no projection. Without one, the ratio speculative / decode is
itself the L at which speculation breaks even.

    python benchmarks/bench_spec.py --models e2b 31b --batch 1 16 --k 4
    python benchmarks/bench_spec.py --models e2b --batch 1 2 16 64 --k 2 4 8   # one process, every program
                                                                               # compiled before any is timed
    python benchmarks/bench_spec.py --models demo --batch 1 8 32 --context 512   # projected at its measured L
    python benchmarks/bench_spec.py --models e2b --batch 2 16 --sampled   # the sampling programs (T = 1, top-p;
                                                                           # --top-k 64 for Gemma 3's default)
    python benchmarks/bench_spec.py --models 31b --batch 2 16 --quantization none fp8 --kv-cache-dtype fp8
                                          # each format in turn: spec / decode of fp8 beside bf16's
    python benchmarks/bench_spec.py --models e2b --batch 1 16 --k 4 --processed   # also the processed decode and
                                          # speculative programs (penalties + top logprobs) and a structured-output
                                          # round (draft, verify, accept with grammar masks)
    python benchmarks/bench_spec.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE, bytes_per_step, experts_touched, random_pages  # noqa: E402
from benchmarks.common import (ASSISTANTS, TARGETS, acceptance_length, add_format_args,  # noqa: E402
                               compile_concurrently, copy_bandwidth, environment, fresh_inputs, gemv_bandwidth,
                               layout_for, lower_program, pipelined_time, random_params, write_json)
from benchmarks.kernel_profile import print_profile, profile_calls  # noqa: E402
from gemma4_mtp_jax.api import (  # noqa: E402
    Assistant,
    Target,
    abstract_assistant_params,
    abstract_target_params,
    load_assistant,
    load_target,
)
from gemma4_mtp_jax.engine.config import EngineConfig  # noqa: E402
from gemma4_mtp_jax.model.config import parse_assistant_config, parse_target_config  # noqa: E402
from gemma4_mtp_jax.model.kv_state import kv_cache_scales  # noqa: E402
from gemma4_mtp_jax.model.sharding import Placement, check_tensor_parallel, mesh_context  # noqa: E402
from gemma4_mtp_jax.steps.forward import StepSpec, forward_paged, lm_logits  # noqa: E402
from gemma4_mtp_jax.model.sampling import MAX_TOP_LOGPROBS, SamplingParams  # noqa: E402
from gemma4_mtp_jax.steps.speculative import AssistantDrafter  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps, placement_for  # noqa: E402

SMOKE_ASSISTANT = dict(model_type="gemma4_assistant", backbone_hidden_size=64, use_ordered_embeddings=True,
                       num_centroids=16, centroid_intermediate_top_k=4,
                       text_config=dict(model_type="gemma4_text", vocab_size=512, hidden_size=32,
                                        intermediate_size=64, num_hidden_layers=4,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        global_head_dim=32, sliding_window=32, num_kv_shared_layers=4,
                                        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0))


def timed(fn, state, rest, repeats, warmup=3):
    """Seconds per call of fn(*state, *rest) -> (*state, out), the donated state threaded through, two ways:
    synchronised (median of `repeats` calls, each waited for) and pipelined (`repeats` calls dispatched back to
    back and waited for once, as the engine's async scheduling runs them; the median of 3 such chains, per call).
    A synchronised call pays in series what a pipelined one overlaps with the previous call's kernels: the input
    copies, the launch, and the host round trip of each `lax.cond` predicate. Returns (sync, pipelined, state)."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        res = fn(*state, *rest)
        state, out = res[:-1], res[-1]
        jax.block_until_ready(out)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    box = [state]

    def call():
        res = fn(*box[0], *rest)
        box[0] = res[:-1]
        return res[-1]

    return statistics.median(times), pipelined_time(call, repeats), box[0]


def processing_params(sampling: SamplingParams | None) -> SamplingParams:
    """A request that takes the processed programs: `sampling`'s (greedy: None) with presence and frequency
    penalties and logprobs with the most top alternatives a processed program returns."""
    return dataclasses.replace(sampling or SamplingParams(), presence_penalty=0.5, frequency_penalty=0.5,
                               logprobs=MAX_TOP_LOGPROBS)


def timed_masked_round(steps: CompiledSteps, programs: tuple, state, draft_in: np.ndarray,
                       accept_in: Callable[[], np.ndarray], repeats: int, warmup: int = 3) -> tuple[dict, Any]:
    """A structured-output round as Runner._masked_round runs it: the draft program, the verify's forward (its
    logits kept on the device), the host reading the drafts, the accept's inputs packed (`accept_in()`: grammar
    masks at the k+1 positions), the accept; `programs`: those three compiled; `draft_in`: the draft's (and the
    verify's) packed inputs. Synchronised, each round waited for: the median seconds of a round and of the part
    until the drafts are on the host. Then the accept program alone (`timed`, on the last round's drafts and
    logits). Returns ({name: ms}, state)."""
    draft, verify, accept = programs
    rounds, drafts_read = [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        state, drafted, q, q_ids = draft(steps.program_params, steps.draft_params, state, draft_in)
        state, h_all, logits = verify(steps.program_params, state, draft_in, drafted)
        np.asarray(drafted)[:, :steps.k]  # the host waits for the drafts alone; the forward runs on
        t_drafts = time.perf_counter()
        state, out = accept(state, accept_in(), drafted, q, q_ids, h_all, logits)
        jax.block_until_ready(out)
        if i >= warmup:
            rounds.append(time.perf_counter() - t0)
            drafts_read.append(t_drafts - t0)
    t, tp, (state,) = timed(accept, (state,), (accept_in(), drafted, q, q_ids, h_all, logits), repeats)
    return {"masked_round_ms": statistics.median(rounds) * 1e3,
            "masked_drafts_read_ms": statistics.median(drafts_read) * 1e3,
            "masked_accept_ms": t * 1e3, "masked_accept_pipelined_ms": tp * 1e3}, state


def processed_rounds(row: dict, compiled: dict, steps: CompiledSteps, state, case: tuple,
                     sampling: SamplingParams | None, processing: SamplingParams, repeats: int) -> Any:
    """--processed's columns of a row of B rows at k = steps.k whose spec_ms is measured: the processed speculative
    program (every row `processing`'s) and the masked round of structured output (timed_masked_round; the rows
    `sampling`'s, all-allow masks), the state threaded through. case: the row's (tokens, lengths, tables).
    Returns the state."""
    tokens, P, tables = case
    B, k, V = len(tokens), steps.k, steps.target.config.vocab_size
    spec_p, row["compile_spec_processed_s"] = compiled[("spec_processed", B, k)]
    spec_p_in = (fresh_inputs(tokens, P, tables, steps.num_slots, processing, (V, 1)),)
    t, tp, (state,) = timed(lambda s, *r: spec_p(steps.program_params, steps.draft_params, s, *r), (state,),
                            spec_p_in, repeats)
    row["spec_processed_ms"], row["spec_processed_pipelined_ms"] = t * 1e3, tp * 1e3
    row["spec_processed_over_spec"] = row["spec_processed_ms"] / row["spec_ms"]
    programs = []
    for key in ("draft", "masked_verify", "accept"):
        program, row[f"compile_{key}_s"] = compiled[(key, B, k)]
        programs.append(program)
    masked, state = timed_masked_round(
        steps, tuple(programs), state, fresh_inputs(tokens, P, tables, steps.num_slots, sampling),
        lambda: fresh_inputs(tokens, P, tables, steps.num_slots, sampling, (V, k + 1)), repeats)
    row.update(masked)
    row["masked_over_spec"] = row["masked_round_ms"] / row["spec_ms"]
    return state


def profiled(fn, state, rest, label: str, step_s: float):
    """Trace a few calls of fn(*state, *rest) -> (*state, out) (kernel_profile.py), the donated state threaded
    through as in `timed`; prints the kernels. Returns (profile, state)."""
    box = [state]

    def call():
        res = fn(*box[0], *rest)
        box[0] = res[:-1]
        return res[-1]

    prof = profile_calls(call)
    print_profile(label, prof, step_s * 1e6, top=25)
    return prof, box[0]


def bench_model(name: str, args, bw: float, gemv_bw: float, quantization: str, kv_name: str) -> Iterator[dict]:
    """Rows of the decode step at each batch size, and of the verify and speculative steps at each batch size and
    k, all of one model and format (target weights `quantization`, K/V cache `kv_name`) in this process: the weights
    made once, every program compiled before the first is timed (compile_concurrently). --processed: also the
    processed decode and speculative programs and the masked round (processed_rounds). Yields each row as soon as
    it is measured."""
    ks = args.k
    fmt = dict(quantization=quantization, quantization_assistant=args.quantization_assistant)
    t0 = time.perf_counter()
    if name == "demo":  # the trained pair shipped in the package, in its own dtype
        from gemma4_mtp_jax.weights.demo import demo_pair

        t_dir, a_dir = demo_pair()
        target = load_target(t_dir, quantization=quantization)
        assistant = load_assistant(a_dir, quantization=args.quantization_assistant)
        tcfg, acfg, dtype = target.config, assistant.config, target.dtype
    else:
        tcfg = parse_target_config(SMOKE if name == "smoke" else TARGETS[name])
        acfg = parse_assistant_config(SMOKE_ASSISTANT if name == "smoke" else ASSISTANTS[name])
        dtype = jnp.float32 if name == "smoke" else jnp.bfloat16
        target = Target(tcfg, random_params(abstract_target_params(tcfg, dtype), 0, quantization), dtype, None, {})
        assistant = Assistant(acfg, random_params(abstract_assistant_params(acfg, dtype), 1,
                                                  args.quantization_assistant), dtype, None, {})
    print(f"[{name}] {fmt} weights in {time.perf_counter() - t0:.1f}s", flush=True)
    cache_dtype = EngineConfig(cache_dtype=kv_name).kv_cache_dtype(dtype)
    fmt["kv_cache_dtype"] = str(cache_dtype)
    context = 64 if name == "smoke" else args.context
    max_b = max(args.batch)
    # One layout for every k: its sliding rings sized for the largest (a ring only holds more than a smaller k
    # needs; what a step reads does not change).
    layout = layout_for(tcfg, max_b, page_size=args.page_size, max_model_len=context + 16,
                        num_speculative_tokens=max(ks), assistant_window=acfg.text.sliding_window,
                        scales=kv_cache_scales(tcfg, target.params, cache_dtype))
    placement = None
    if args.tensor_parallel_size > 1:
        check_tensor_parallel(tcfg, args.tensor_parallel_size)
        # The speculative programs' placement for every program here (the assistant's pages whole on every device):
        # the pages and parameters pass from one program to the next with the shardings each was compiled for.
        placement = placement_for(Placement.over(jax.devices()[:args.tensor_parallel_size]),
                                  AssistantDrafter(assistant), tcfg)
    plain = CompiledSteps(target, layout, cache_dtype, "auto", placement=placement, max_batch=max_b,
                          pack_params=args.pack_params)
    params = plain.params  # on the programs' devices (split under tensor parallelism)
    # The speculative programs take the same placed parameters (not a second copy), and the whole weights made on
    # the first device go: under tensor parallelism they and two sets of shards would not fit one GPU (31B, TP=2).
    target = plain.target = dataclasses.replace(target, params=params)
    # --processed: structured programs too (the masked round's), the staging buffer then sized for k+1 masks as a
    # server with structured output sizes it.
    steps = {k: CompiledSteps(target, layout, cache_dtype, "auto", drafter=AssistantDrafter(assistant), k=k,
                              num_slots=max_b, placement=placement, pack_params=args.pack_params,
                              structured=args.processed) for k in ks}
    pages = random_pages(tcfg, layout, cache_dtype)
    hidden = jax.random.normal(jax.random.PRNGKey(3), (max_b + 1, tcfg.hidden_size), jnp.float32).astype(dtype)
    rng = np.random.default_rng(0)

    def verify(params, pages, tokens, positions, tables):
        h, pages = forward_paged(StepSpec(target, layout), params, pages, tokens, positions, tables)
        return pages, jnp.argmax(lm_logits(target, params, h), -1)

    def verify_lowering(B, k, tables):
        tokens = jax.ShapeDtypeStruct((B, k + 1), jnp.int32)
        with mesh_context(placement):  # attention splits by heads under tensor parallelism
            return jax.jit(verify, donate_argnums=(1,), out_shardings=(steps[k].arrays.page_shardings(), None)
                           if placement else None).lower(params, pages, tokens, tokens, tables)

    cases = {}  # B -> (tokens, lengths, tables)
    lowerings = {}
    for B in args.batch:
        tables = {}
        for g, w in layout.pages_per_seq:
            tables[g] = rng.permutation(np.arange(1, layout.pages(g)))[: B * w].reshape(B, w).astype(np.int32)
        cases[B] = (rng.integers(0, tcfg.vocab_size, B).astype(np.int32), np.full(B, context - max(ks) - 2, np.int32),
                    tables)
        lowerings[("decode", B, 0)] = lambda B=B: lower_program(plain.decode_program(B, args.sampled))
        for k in ks:
            lowerings[("verify", B, k)] = functools.partial(verify_lowering, B, k, tables)
            lowerings[("speculative", B, k)] = functools.partial(lower_program,
                                                                 steps[k].speculative_program(B, args.sampled))
            if args.processed:
                st = steps[k]
                for key, program in (("spec_processed", st.speculative_program(B, True, True, k)),
                                     ("draft", st.draft_program(B)), ("masked_verify", st.verify_program(B)),
                                     ("accept", st.accept_program(B))):
                    lowerings[(key, B, k)] = functools.partial(lower_program, program)
        if args.processed:
            lowerings[("decode_processed", B, 0)] = lambda B=B: lower_program(plain.decode_program(B, True, True))
    t0 = time.perf_counter()
    compiled = compile_concurrently(lowerings)
    print(f"[{name}] {len(compiled)} programs compiled in {time.perf_counter() - t0:.1f}s", flush=True)

    sampling = SamplingParams(temperature=1.0, top_k=args.top_k, top_p=0.95, seed=7) if args.sampled else None
    processing = processing_params(sampling)
    V = tcfg.vocab_size
    for B in args.batch:
        tokens, P, tables = cases[B]
        dec, t_compile = compiled[("decode", B, 0)]
        dec_fn = lambda s, *r: dec(plain.program_params, s, *r)  # noqa: E731
        dec_in = (fresh_inputs(tokens, P, tables, plain.num_slots, sampling),)
        t, tp, (state,) = timed(dec_fn, (plain.arrays.init_state(pages),), dec_in, args.repeats)
        decode = {"compile_decode_s": t_compile, "decode_ms": t * 1e3, "decode_pipelined_ms": tp * 1e3}
        if args.profile:
            decode["decode_profile"], (state,) = profiled(dec_fn, (state,), dec_in, f"{name} B={B} decode", t)
        if args.processed:
            dec_p, decode["compile_decode_processed_s"] = compiled[("decode_processed", B, 0)]
            dec_p_in = (fresh_inputs(tokens, P, tables, plain.num_slots, processing, (V, 1)),)
            t, tp, (state,) = timed(lambda s, *r: dec_p(plain.program_params, s, *r), (state,), dec_p_in,
                                    args.repeats)
            decode["decode_processed_ms"], decode["decode_processed_pipelined_ms"] = t * 1e3, tp * 1e3
            decode["decode_processed_over_decode"] = decode["decode_processed_ms"] / decode["decode_ms"]
        pages = state.pages
        touched = None
        if tcfg.enable_moe_block:  # MoE: the roofline counts the experts this step's routing actually read
            touched = decode["experts_touched"] = experts_touched(target, tokens, int(P[0]))
        need = bytes_per_step(tcfg, target.params, B, context, experts_touched=touched,
                              kv_bytes=jnp.dtype(cache_dtype).itemsize)
        decode["decode_roofline_ms"] = need["total"] / bw * 1e3
        decode["decode_roofline_fraction"] = decode["decode_roofline_ms"] / decode["decode_ms"]
        decode["decode_roofline_gemv_ms"] = need["total"] / gemv_bw * 1e3
        for k in ks:
            row = {"model": name, **fmt, "tp": args.tensor_parallel_size, "batch": B, "k": k, "context": context,
                   "sampled": args.sampled, "top_k": args.top_k if args.sampled else None, **decode}
            vt = np.tile(tokens[:, None], (1, k + 1))
            vp = P[:, None] + np.arange(k + 1)[None, :].astype(np.int32)
            ver, row["compile_verify_s"] = compiled[("verify", B, k)]
            ver_fn = lambda p, *r: ver(params, p, *r)  # noqa: E731
            t, tp, (pages,) = timed(ver_fn, (pages,), (vt, vp, tables), args.repeats)
            row["verify_ms"], row["verify_pipelined_ms"] = t * 1e3, tp * 1e3
            if args.profile:
                row["verify_profile"], (pages,) = profiled(ver_fn, (pages,), (vt, vp, tables),
                                                           f"{name} B={B} k={k} verify", t)

            st = steps[k]
            spec, row["compile_spec_s"] = compiled[("speculative", B, k)]
            spec_fn = lambda s, *r: spec(st.program_params, st.draft_params, s, *r)  # noqa: E731
            spec_in = (fresh_inputs(tokens, P, tables, st.num_slots, sampling),)
            t, tp, (state,) = timed(spec_fn, (st.arrays.init_state(pages, hidden),), spec_in, args.repeats)
            if args.profile:
                row["spec_profile"], (state,) = profiled(spec_fn, (state,), spec_in,
                                                         f"{name} B={B} k={k} speculative", t)
            row["spec_ms"], row["spec_pipelined_ms"] = t * 1e3, tp * 1e3
            if args.processed:
                state = processed_rounds(row, compiled, st, state, cases[B], sampling, processing, args.repeats)
            pages, hidden = state.pages, state.hidden
            row["spec_over_decode"] = row["spec_ms"] / row["decode_ms"]
            row["spec_over_decode_pipelined"] = row["spec_pipelined_ms"] / row["decode_pipelined_ms"]
            row["verify_over_decode"] = row["verify_ms"] / row["decode_ms"]
            row["draft_ms_est"] = row["spec_ms"] - row["verify_ms"]
            if args.acceptance_length is not None:
                L, source = args.acceptance_length, "given: --acceptance-length"
            else:
                L, source = acceptance_length(name, k)
            row["acceptance_length"], row["acceptance_length_source"] = L, source
            row["projected_speedup"] = None if L is None else L * row["decode_ms"] / row["spec_ms"]
            print(row, flush=True)
            yield row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["e2b", "31b"], choices=sorted(TARGETS) + ["demo"],
                    help="real shapes with random weights, or 'demo': the trained pair shipped in the package")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--k", nargs="+", type=int, default=[4], help="drafts per round; several: one row per k")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--acceptance-length", type=float, default=None,
                    help="mean tokens per round for every row's projected speedup (default: each model's own at "
                         "that k, from common.ACCEPTANCE_LENGTHS; none known: no projection)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="split the target over the first N devices (sharding.py)")
    ap.add_argument("--pack-params", action="store_true",
                    help="the step programs take the target's weights packed, as `serve --pack-params` runs them")
    ap.add_argument("--profile", action="store_true",
                    help="also trace the decode, verify and speculative steps and list their kernels "
                         "(kernel_profile.py)")
    ap.add_argument("--sampled", action="store_true",
                    help="the programs' sampling variants, every row at temperature 1, top-p 0.95 (the verify "
                         "column stays the greedy forward)")
    ap.add_argument("--top-k", type=int, default=0,
                    help="with --sampled, every row's top_k (0 = off, the default; Gemma 3's generation_config "
                         "sets 64)")
    ap.add_argument("--processed", action="store_true",
                    help="also the processed decode and speculative programs (every row with presence and frequency "
                         "penalties and the most top logprobs) and the masked round of structured output (draft, "
                         "verify, the host reading the drafts, accept with all-allow grammar masks)")
    ap.add_argument("--smoke", action="store_true")
    add_format_args(ap)
    ap.add_argument("--quantization-assistant", default="none", choices=["none", "fp8"],
                    help="the assistant's weights (default: none, its checkpoint dtype's)")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    bw = copy_bandwidth(0.05 if args.smoke else 2.0)
    gemv_bw = gemv_bandwidth(0.05 if args.smoke else 2.0)
    print(f"copy bandwidth (read+write): {bw / 1e12:.3f} TB/s; matrix-vector read {gemv_bw / 1e12:.3f} TB/s",
          flush=True)
    rows = []
    for name in (["smoke"] if args.smoke else args.models):
        for quantization, kv_name in itertools.product(args.quantization, args.kv_cache_dtype):
            for row in bench_model(name, args, bw, gemv_bw, quantization, kv_name):
                rows.append(row)  # written row by row: a process cut short still leaves what it measured
                write_json("bench_spec.json", {"env": env, "copy_TBps": bw / 1e12, "gemv_TBps": gemv_bw / 1e12,
                                               "rows": rows})
            gc.collect()
    print(f"\ncopy bandwidth {bw / 1e12:.3f} TB/s; speedup = L x decode / spec (synchronised), L each model's own "
          f"at k (sources below); '-': no L known")
    processed = (f" {'dec proc':>8} {'/dec':>5} {'spec proc':>9} {'/spec':>5} {'masked':>8} {'/spec':>5} "
                 f"{'accept':>8}") if args.processed else ""
    print(f"{'model':6} {'weights':7} {'kv':13} {'k':>2} {'B':>3} {'ctx':>6} {'decode':>8} {'roof%':>6} {'verify':>8} {'spec':>8} {'draft~':>8} "
          f"{'spec/dec':>8} {'L':>5} {'speedup':>8} {'dec pipe':>8} {'spec pipe':>9} {'ratio':>6}{processed}")
    for r in rows:
        L, speedup = r["acceptance_length"], r["projected_speedup"]
        print(f"{r['model']:6} {r['quantization']:7} {r['kv_cache_dtype']:13} {r['k']:2d} {r['batch']:3d} {r['context']:6d} {r['decode_ms']:8.3f} "
              f"{100 * r['decode_roofline_fraction']:6.1f} {r['verify_ms']:8.3f} {r['spec_ms']:8.3f} "
              f"{r['draft_ms_est']:8.3f} {r['spec_over_decode']:8.2f} {'-' if L is None else f'{L:.2f}':>5} "
              f"{'-' if speedup is None else f'{speedup:.2f}':>8} "
              f"{r['decode_pipelined_ms']:8.3f} {r['spec_pipelined_ms']:9.3f} {r['spec_over_decode_pipelined']:6.2f}"
              + (f" {r['decode_processed_ms']:8.3f} {r['decode_processed_over_decode']:5.2f} "
                 f"{r['spec_processed_ms']:9.3f} {r['spec_processed_over_spec']:5.2f} {r['masked_round_ms']:8.3f} "
                 f"{r['masked_over_spec']:5.2f} {r['masked_accept_ms']:8.3f}" if args.processed else ""))
    print("L sources:")
    for model, k, source in sorted({(r["model"], r["k"], r["acceptance_length_source"]) for r in rows}):
        print(f"  {model} k={k}: {source}")


if __name__ == "__main__":
    main()
