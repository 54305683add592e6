"""Host overhead of the engine's decode loop: the engine's step time against its compiled program's time alone.

For each batch size B: an engine (plain, or with --spec the speculative one) serves B sequences that never stop
(empty stop ids); once every prompt is prefilled, each `Engine.step()` is timed (host work: rows, page tables,
sampling rows, page growth, dispatch, the one read-back, appending tokens). Then the same compiled program is
called alone on the same inputs (the donated pages threaded through) and timed the same way. Overhead = engine
step - program; issue 12's goal is <= 5 % of the step at B = 1 on the real E2B shape. Weights are random (bf16 at
the real shapes; float32 with --smoke), so acceptance is whatever the random pair gives: the timings do not depend
on it.

    python benchmarks/bench_host_overhead.py --model e2b --batch 1 2 16 [--spec] --context 1024
    python benchmarks/bench_host_overhead.py --smoke [--spec]          # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE  # noqa: E402
from benchmarks.bench_spec import SMOKE_ASSISTANT  # noqa: E402
from benchmarks.common import ASSISTANTS, TARGETS, environment, median_time, random_params, write_json  # noqa: E402
from gemma4_mtp_jax.api import Assistant, Target, abstract_assistant_params, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.config import parse_assistant_config, parse_target_config  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402
from gemma4_mtp_jax.speculative import MAX_STOP_IDS  # noqa: E402


def program_call(engine: Engine):
    """A zero-argument callable running the engine's decode (or speculative) program once on the inputs of its
    running sequences, as `step` would build them, threading the donated state; returns its output."""
    rows = engine._rows(engine.running, [])
    B = engine._bucket(engine.config.batch_buckets(), len(rows))
    tables, sampling = engine._tables(rows, B), engine._sampling(rows, B)
    tokens = np.zeros((B,), np.int32)
    positions = np.full((B,), -1, np.int32)
    for r, row in enumerate(rows):
        tokens[r], positions[r] = row.token, row.position
    if engine.assistant is None:
        fn = engine.steps.compile_decode(B)

        def call():
            engine.pages, out = fn(engine.target.params, engine.pages, tokens, positions, tables, sampling)
            return out
        return call
    slots = np.full((B,), engine.config.max_num_seqs, np.int32)
    slots[: len(rows)] = [row.req.slot for row in rows]
    spec_on = np.arange(B) < len(rows)
    stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)
    remaining = np.full((B,), 1 << 20, np.int32)
    fn = engine.steps.compile_speculative(B)

    def call():
        engine.pages, engine.hidden, out = fn(engine.target.params, engine.steps.draft_params, engine.pages,
                                              engine.hidden, slots, tokens, positions, tables, sampling, spec_on,
                                              stop_ids, remaining)
        return out
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="e2b", choices=sorted(TARGETS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 16])
    ap.add_argument("--spec", action="store_true", help="the speculative engine (the family's assistant)")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence when timing starts")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after 5 warm-up steps)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32 (runs on CPU)")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    name = "smoke" if args.smoke else args.model
    tcfg = parse_target_config(SMOKE if args.smoke else TARGETS[name])
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    target = Target(tcfg, random_params(abstract_target_params(tcfg, dtype), 0), dtype, None, {})
    assistant = None
    if args.spec:
        acfg = parse_assistant_config(SMOKE_ASSISTANT if args.smoke else ASSISTANTS[name])
        assistant = Assistant(acfg, random_params(abstract_assistant_params(acfg, dtype), 1), dtype, None, {})
    context = 48 if args.smoke else args.context
    warmup = 5
    rows = []
    rng = np.random.default_rng(0)
    for B in args.batch:
        config = EngineConfig(max_num_seqs=B, max_model_len=context + (warmup + args.steps + 2) * 17,
                              compile_at_start=False)
        engine = Engine(target, config, assistant=assistant)
        for _ in range(B):
            engine.add_request(rng.integers(3, tcfg.vocab_size, context).tolist(), config.max_model_len - context,
                               stop_ids=frozenset())
        while not all(r.decoding for r in engine.running) or engine.waiting:
            engine.step()
        for _ in range(warmup):
            engine.step()
        step_s = median_time(engine.step, (), repeats=args.steps, warmup=0)
        program_s = median_time(program_call(engine), (), repeats=args.steps, warmup=0)
        row = {"model": name, "spec": args.spec, "batch": B, "context": context, "engine_step_ms": step_s * 1e3,
               "program_ms": program_s * 1e3, "host_overhead_ms": (step_s - program_s) * 1e3,
               "host_overhead_fraction": (step_s - program_s) / step_s}
        rows.append(row)
        print(row, flush=True)
        for req in list(engine.running) + list(engine.waiting):
            engine.cancel(req)
    write_json("bench_host_overhead.json", {"env": env, "rows": rows})
    print(f"\n{'model':6} {'spec':>5} {'B':>3} {'engine step ms':>15} {'program ms':>11} {'host ms':>8} {'host %':>7}")
    for r in rows:
        print(f"{r['model']:6} {str(r['spec']):>5} {r['batch']:3d} {r['engine_step_ms']:15.3f} {r['program_ms']:11.3f} "
              f"{r['host_overhead_ms']:8.3f} {100 * r['host_overhead_fraction']:7.1f}")


if __name__ == "__main__":
    main()
