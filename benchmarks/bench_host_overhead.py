"""Host overhead of the engine's decode loop: the engine's step time against its compiled program's time alone.

For each batch size B: an engine (plain, or with --spec the speculative one) serves B sequences that never stop
(empty stop ids); once every prompt is prefilled, each `Engine.step()` is timed (host work: rows, page tables,
sampling rows, page growth, dispatch, the one read-back, taking tokens), with async scheduling on (the step
dispatched before the previous one is read) and off. Then the same compiled program is called alone on the same
inputs (the donated state threaded through), each call waited for, and pipelined (calls dispatched back to back,
waited for once: the device's own time per call). Host overhead = (engine step - program) / engine step against
either program time; the goal is <= 5 % at B = 1 on the real E2B shape (docs/PERFORMANCE.md), and the pipelined
program time is the strict reference (the synchronised call pays its own launch and input copies). `dispatch_ms` is
how long a call of the program holds the calling thread in a pipelined chain: near zero when the launch is
asynchronous, near the program's time when something makes the host wait (a `lax.cond`, whose predicate XLA's GPU
runtime copies to the host; command-buffer nodes re-recorded because their buffers moved, which XLA logs under
TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1: docs/decisions/0001-command-buffer-update-mode.md).
Weights are random (bf16 at the real shapes; float32 with --smoke), so acceptance is whatever the random pair gives:
the timings do not depend on it.

    python benchmarks/bench_host_overhead.py --model e2b --batch 1 2 16 [--spec] --context 1024
    python benchmarks/bench_host_overhead.py --smoke [--spec]          # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE  # noqa: E402
from benchmarks.bench_spec import SMOKE_ASSISTANT  # noqa: E402
from benchmarks.common import (ASSISTANTS, TARGETS, add_pack_params_arg, environment, median_time, pipelined_time,  # noqa: E402
                               random_params, write_json)
from gemma4_mtp_jax.api import Assistant, Target, abstract_assistant_params, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.model.config import parse_assistant_config, parse_target_config  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402


def program_call(engine: Engine):
    """A zero-argument callable running the engine's decode (or speculative) program once on the inputs of its
    running sequences, as its runner builds them, threading the donated state; returns its packed result."""
    runner, steps = engine.runner, engine.steps
    if runner.in_flight is not None:  # read the engine's last step first: the calls below follow it
        runner.collect(runner.in_flight)
    rows, _ = runner.rows(engine.scheduler.running)
    inputs = runner.step_inputs(rows)
    B, packed = inputs.rows.slot.shape[0], steps.inputs(inputs)
    if engine.assistant is None:
        fn = steps.compile_decode(B)

        def call():
            runner.state, out = fn(steps.program_params, runner.state, packed)
            return out
        return call
    fn = steps.compile_speculative(B)

    def call():
        runner.state, out = fn(steps.program_params, steps.draft_params, runner.state, packed)
        return out
    return call


def dispatch_time(call, n: int) -> float:
    """Median seconds for which call() holds the calling thread, in a chain of n calls waited for once."""
    held = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = call()
        held.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
    return statistics.median(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="e2b", choices=sorted(TARGETS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 16])
    ap.add_argument("--spec", action="store_true", help="the speculative engine (the family's assistant)")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence when timing starts")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after 5 warm-up steps)")
    add_pack_params_arg(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32 (runs on CPU)")
    args = ap.parse_args()
    env = {**environment(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "pack_params": args.pack_params}
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
                              compile_at_start=False, pack_params=args.pack_params)
        engine = Engine(target, config, assistant=assistant)
        for _ in range(B):
            engine.add_request(rng.integers(3, tcfg.vocab_size, context).tolist(), config.max_model_len - context,
                               stop_ids=frozenset())
        while not all(r.decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(warmup):
            engine.step()
        timed = {}
        for mode in (True, False):  # async scheduling on, then off: the same engine, the same sequences
            engine.config.async_scheduling = mode
            for _ in range(2):
                engine.step()
            timed[mode] = median_time(engine.step, (), repeats=args.steps, warmup=0)
        call = program_call(engine)
        program_s = median_time(call, (), repeats=args.steps, warmup=0)
        pipelined_s = pipelined_time(call, args.steps)
        dispatch_s = dispatch_time(call, args.steps)
        row = {"model": name, "spec": args.spec, "batch": B, "context": context, "program_ms": program_s * 1e3,
               "program_pipelined_ms": pipelined_s * 1e3, "dispatch_ms": dispatch_s * 1e3}
        for mode, key in ((True, "async"), (False, "sync")):
            row[f"{key}_step_ms"] = timed[mode] * 1e3
            row[f"{key}_host_overhead_fraction"] = (timed[mode] - program_s) / timed[mode]
            row[f"{key}_over_pipelined_fraction"] = (timed[mode] - pipelined_s) / timed[mode]
        rows.append(row)
        print(row, flush=True)
        for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.cancel(req)
    write_json("bench_host_overhead.json", {"env": env, "rows": rows})
    print(f"\n{'model':6} {'spec':>5} {'B':>3} {'program ms':>11} {'pipelined':>10} {'dispatch':>9} "
          f"{'async step ms':>14} "
          f"{'host %':>7} {'vs pipe %':>9} {'sync step ms':>13} {'host %':>7}")
    for r in rows:
        print(f"{r['model']:6} {str(r['spec']):>5} {r['batch']:3d} {r['program_ms']:11.3f} "
              f"{r['program_pipelined_ms']:10.3f} {r['dispatch_ms']:9.3f} {r['async_step_ms']:14.3f} "
              f"{100 * r['async_host_overhead_fraction']:7.1f} {100 * r['async_over_pipelined_fraction']:9.1f} "
              f"{r['sync_step_ms']:13.3f} {100 * r['sync_host_overhead_fraction']:7.1f}")


if __name__ == "__main__":
    main()
