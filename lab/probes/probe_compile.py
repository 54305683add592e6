"""Where one step program's XLA compilation goes: the demo pair's engine (as the server builds it), one program
lowered, then compiled alone with the engine's compile options, timed.

Run it with XLA's scoped timers on to see the compiler's passes and phases (they log at verbosity 1):

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=1 python lab/probes/probe_compile.py 2> compile.log
    grep -aE " time: [0-9.]+ (s|min)" compile.log      # each phase and pass, with its seconds

    python lab/probes/probe_compile.py --program 'decode[2]' --engine plain   # any program of `--list`
    python lab/probes/probe_compile.py --family e2b --program 'prefill[1x256]'  # real shapes, no weights

One process per program, all started at once, times what compiling the programs in separate processes would take
(lab/runs/gpu_run110.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.compile_all import FAMILIES, load_family  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402
from gemma4_mtp_jax.server.cli import DEFAULT_MAX_MODEL_LEN_CAP, build_parser  # noqa: E402
from gemma4_mtp_jax.step import compile_lowered, enable_compilation_cache  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--program", nargs="+", default=None,
                    help="programs' names, compiled one after another in this process (default: the last step "
                         "program of --list)")
    ap.add_argument("--engine", choices=["speculative", "plain"], default="speculative")
    ap.add_argument("--family", choices=FAMILIES, default="demo",
                    help="the demo pair (its weights) or a real family's shapes (no weights)")
    ap.add_argument("--list", action="store_true", help="list the engine's programs and exit")
    ap.add_argument("--compilation-cache-dir", default="none",
                    help="JAX's persistent compilation cache (and with it XLA's per-fusion autotuning cache) in this "
                         "directory; 'none' (default): off")
    args = ap.parse_args()
    enable_compilation_cache(args.compilation_cache_dir)

    t_start = time.perf_counter()
    d = build_parser().parse_args([])
    target, assistant, max_positions = load_family(args.family)
    config = EngineConfig(max_num_seqs=d.max_num_seqs, page_size=d.page_size, prefill_chunk=d.prefill_chunk,
                          max_model_len=min(max_positions, DEFAULT_MAX_MODEL_LEN_CAP), compile_at_start=False)
    engine = Engine(target, config, assistant=assistant if args.engine == "speculative" else None)
    progs = engine.steps.programs(config.batch_buckets(), config.prefill_buckets())
    names = [name for name, _, _ in progs]
    if args.list:
        print("\n".join(names))
        return 0
    builds = dict((n, b) for n, b, _ in progs)
    for name in args.program or [[n for n in names if not n.startswith("prefill")][-1]]:
        t0 = time.perf_counter()
        jitted, abstract = builds[name]()
        lowered = jitted.lower(*abstract)
        t1 = time.perf_counter()
        compiled = compile_lowered(lowered)
        t2 = time.perf_counter()
        text = compiled.as_text()
        print(f"{name}: started {t0 - t_start:.2f} s after the process, traced and lowered in {t1 - t0:.2f} s, "
              f"compiled in {t2 - t1:.2f} s; optimized HLO {text.count('fusion(')} fusions, "
              f"{text.count('custom-call(')} custom calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
