"""Where a compiled step's host time goes: how long a call of the E2B decode program (B = 1, random bf16 weights; with
--spec the speculative program, k = 4) holds the calling thread, synchronised and pipelined, with its per-step inputs
fresh from the host (numpy arrays, as the engine passes them: new device buffers every call) or already on the
device (placed before the timing, one copy per call: the program takes its inputs donated and returns its result in
them).

XLA records a program's kernels into command buffers (CUDA graphs); a kernel node is re-recorded when a buffer it
reads or writes has moved since the last run (`xla_gpu_command_buffer_update_mode` governs the temporaries), and a
`lax.cond` predicate is copied to the host. Run it under XLA_FLAGS variants (lab/runs/gpu_run33.sh) and, with
TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1, XLA logs each update ("Updated N commands in T us").

    python lab/probes/probe_dispatch.py --context 1024 --repeats 40 [--spec]
    python lab/probes/probe_dispatch.py --smoke
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_decode import SMOKE, random_pages  # noqa: E402
from benchmarks.bench_spec import SMOKE_ASSISTANT  # noqa: E402
from benchmarks.common import (ASSISTANTS, TARGETS, environment, fresh_inputs, layout_for,  # noqa: E402
                               random_params)
from benchmarks.common import add_pack_params_arg, write_json  # noqa: E402
from gemma4_mtp_jax.api import Assistant, Target, abstract_assistant_params, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.config import parse_assistant_config, parse_target_config  # noqa: E402
from gemma4_mtp_jax.speculative import AssistantDrafter  # noqa: E402
from gemma4_mtp_jax.step import CompiledSteps, compiler_options  # noqa: E402


def measure(call, repeats: int) -> dict:
    """ms per call: synchronised (total and the time the call held the thread) and pipelined (the same two)."""
    for _ in range(3):
        jax.block_until_ready(call())
    sync, sync_held = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        sync.append(time.perf_counter() - t0)
        sync_held.append(t1 - t0)
    chains, held = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            t1 = time.perf_counter()
            out = call()
            held.append(time.perf_counter() - t1)
        jax.block_until_ready(out)
        chains.append((time.perf_counter() - t0) / repeats)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"sync_ms": ms(sync), "sync_held_ms": ms(sync_held), "pipelined_ms": ms(chains),
            "pipelined_held_ms": ms(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--tag", default="", help="a name for this run's XLA_FLAGS variant (in the JSON's file name)")
    ap.add_argument("--spec", action="store_true", help="the speculative program (E2B's assistant, k = 4)")
    add_pack_params_arg(ap)
    ap.add_argument("--options", nargs="*", default=[], metavar="NAME=VALUE",
                    help="XLA options for this program on top of the steps' own (step.compiler_options), e.g. "
                         "xla_gpu_command_buffer_update_mode=SKIP_PROFILED or xla_dump_to=DIR")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32 (runs on CPU)")
    args = ap.parse_args()
    options = dict(option.split("=", 1) for option in args.options)
    env = {**environment(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "pack_params": args.pack_params,
           "options": options}
    print(env, flush=True)
    cfg = parse_target_config(SMOKE if args.smoke else TARGETS["e2b"])
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    context = 48 if args.smoke else args.context
    target = Target(cfg, random_params(abstract_target_params(cfg, dtype), 0), dtype, None, {})
    drafter, k, acfg = None, 0, None
    if args.spec:
        acfg = parse_assistant_config(SMOKE_ASSISTANT if args.smoke else ASSISTANTS["e2b"])
        drafter = AssistantDrafter(Assistant(acfg, random_params(abstract_assistant_params(acfg, dtype), 1), dtype,
                                             None, {}))
        k = 4
    layout = layout_for(cfg, 1, page_size=16, max_model_len=context + 16, num_speculative_tokens=k,
                        assistant_window=acfg.text.sliding_window if acfg else 0)
    steps = CompiledSteps(target, layout, dtype, "auto", drafter=drafter, k=k, pack_params=args.pack_params)
    t0 = time.perf_counter()
    lowered = steps._lower_speculative(1, False) if args.spec else steps._lower_decode(1, False)
    program = lowered.compile(compiler_options={**compiler_options(), **options})
    compile_s = time.perf_counter() - t0

    def fn(params, state, inputs):  # decode's call; the speculative program also takes the drafter's parameters
        return program(params, steps.draft_params, state, inputs) if args.spec else program(params, state, inputs)

    hidden = jnp.zeros((steps.num_slots + 1, cfg.hidden_size), dtype) if args.spec else None
    box = [steps.init_state(random_pages(cfg, layout, dtype), hidden)]
    tables = {g: np.arange(1, 1 + w, dtype=np.int32)[None] for g, w in layout.pages_per_seq}
    host = fresh_inputs(np.array([5], np.int32), np.array([context - 8], np.int32), tables, steps.num_slots)
    placed = iter([jax.device_put(host) for _ in range(4 * args.repeats + 3)])  # one per call of `measure`
    rows = {}
    for name, inputs in (("host_inputs", lambda: host), ("device_inputs", lambda: next(placed))):
        def call(inputs=inputs):
            box[0], out = fn(steps.program_params, box[0], inputs())
            return out
        rows[name] = measure(call, args.repeats)
        print(name, {k: round(v, 3) for k, v in rows[name].items()}, flush=True)
    # The parameters into a program that does nothing with them: what passing the weight arrays costs, as the
    # tree (every array) and as the programs take them (param_pack.py).
    for name, params in (("trivial_program_param_tree", steps.params),
                         ("trivial_program_packed_params", steps.program_params)):
        trivial = jax.jit(lambda params, x: x + 1, keep_unused=True).lower(params, np.float32(0)).compile()
        rows[name] = measure(lambda: trivial(params, np.float32(0)), args.repeats)
        print(f"{name} ({len(jax.tree_util.tree_leaves(params))} arrays)",
              {k: round(v, 3) for k, v in rows[name].items()}, flush=True)
    # Which of the program's buffers move between calls (each move re-records the command-buffer nodes using it):
    # the device addresses of the state's leaves and of the output (the inputs' buffer, new each call) over a few
    # pipelined calls.
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(box[0])[0]]
    seen: dict[str, set[int]] = {}
    for _ in range(6):
        box[0], out = fn(steps.program_params, box[0], host)
        for name, leaf in zip(names + ["inputs and result"], jax.tree_util.tree_leaves(box[0]) + [out]):
            seen.setdefault(name, set()).add(leaf.unsafe_buffer_pointer())
    jax.block_until_ready(out)
    moved = {name: len(ptrs) for name, ptrs in seen.items() if len(ptrs) > 1}
    print(f"buffers that moved over 6 calls: {moved or 'none'} (of {len(seen)})", flush=True)
    write_json(f"probe_dispatch{'_spec' if args.spec else ''}{'_' + args.tag if args.tag else ''}.json",
               {"env": env, "compile_s": compile_s, "context": context, "moved": moved, **rows})


if __name__ == "__main__":
    main()
