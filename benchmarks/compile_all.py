"""Compile every program the engine builds at the server's default flags, for the demo pair and the five real
Gemma 4 shapes, plain and speculative; report the program count and compile times per family.

The real shapes need no weights: programs are compiled ahead of time from the parameters' shapes, so the
families compile in minutes on one GPU (the KV pools are planned as the engine plans them, not allocated). The
persistent compilation cache stays off: every figure is a cold compile.

    python benchmarks/compile_all.py                      # demo e2b e4b 12b 26b 31b, on the GPU
    python benchmarks/compile_all.py --families demo      # any subset; runs on the CPU too
    python benchmarks/compile_all.py --families e2b --engines speculative --executable-cache-dir DIR  # twice

Exit status 1 if any program fails to compile. JSON to $OUT/compile_all.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import ASSISTANTS, TARGETS, environment, write_json  # noqa: E402
from gemma4_mtp_jax.api import (Assistant, Target, abstract_assistant_params, abstract_target_params,  # noqa: E402
                                load_assistant, load_target)
from gemma4_mtp_jax.model.config import parse_assistant_config, parse_target_config  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402
from gemma4_mtp_jax.server.cli import _max_position_embeddings  # noqa: E402
from gemma4_mtp_jax.server.flags import DEFAULT_MAX_MODEL_LEN_CAP, build_parser  # noqa: E402

FAMILIES = ["demo", "e2b", "e4b", "12b", "26b", "31b"]
REAL_MAX_POSITIONS = 131072  # every released Gemma 4 text config allows at least this; the server caps it


def load_family(name: str) -> tuple[Target, Assistant, int]:
    """(target, assistant, max_position_embeddings): the demo pair from disk, real shapes as abstract params."""
    if name == "demo":
        from gemma4_mtp_jax.weights.demo import demo_pair

        tdir, adir = demo_pair()
        target = load_target(tdir)
        return target, load_assistant(adir), _max_position_embeddings(tdir)
    dtype = jnp.bfloat16
    tcfg = parse_target_config(TARGETS[name], f"benchmarks/common.py TARGETS[{name!r}]")
    acfg = parse_assistant_config(ASSISTANTS[name], f"benchmarks/common.py ASSISTANTS[{name!r}]")
    target = Target(tcfg, abstract_target_params(tcfg, dtype), dtype, None, {})
    assistant = Assistant(acfg, abstract_assistant_params(acfg, dtype), dtype, None, {})
    return target, assistant, REAL_MAX_POSITIONS


def compile_family(name: str, log, engines: list[str], args: argparse.Namespace) -> dict:
    defaults = build_parser().parse_args([])
    target, assistant, mpe = load_family(name)
    config = dict(max_num_seqs=args.max_num_seqs or defaults.max_num_seqs,
                  max_model_len=args.max_model_len or min(mpe, DEFAULT_MAX_MODEL_LEN_CAP),
                  page_size=defaults.page_size, prefill_chunk=defaults.prefill_chunk,
                  attention_impl=defaults.attention_impl, executable_cache_dir=args.executable_cache_dir)
    out = {"family": name, "engine_config": config, "engines": {}}
    for mode, pair in (("speculative", assistant), ("plain", None)):
        if mode not in engines:
            continue
        t0 = time.perf_counter()

        def progress(prog: str, seconds: float) -> None:
            log(f"[{name}/{mode}] compiled {prog} in {seconds:.1f}s")

        try:
            engine = Engine(target, EngineConfig(**config), progress=progress, assistant=pair)
        except Exception as e:  # noqa: BLE001 - report and carry on with the other families
            log(f"[{name}/{mode}] FAILED: {type(e).__name__}: {str(e)[:2000]}")
            traceback.print_exc()
            out["engines"][mode] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
            continue
        wall = time.perf_counter() - t0
        out["engines"][mode] = {"ok": True, "programs": len(engine.compile_times), "wall_s": round(wall, 2),
                                "loaded_from_executable_cache": len(engine.programs.restored),
                                "per_program_s": {k: round(v, 2) for k, v in engine.compile_times.items()},
                                "k": engine.k}
        log(f"[{name}/{mode}] {len(engine.compile_times)} programs ({len(engine.programs.restored)} loaded from the "
            f"executable cache) in {wall:.1f}s wall")
        del engine
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    ap.add_argument("--engines", nargs="+", default=["speculative", "plain"], choices=["speculative", "plain"])
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the server's")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the server's cap")
    ap.add_argument("--executable-cache-dir", default=None,
                    help="load programs from / store them in this executable cache (run twice: fill, then load)")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, flush=True)

    env = environment()
    log(f"JAX {env['jax']} on {env['devices']}")
    results = [compile_family(f, log, args.engines, args) for f in args.families]
    write_json("compile_all.json", {"environment": env, "families": results})
    print(f"\n{'family':8} {'engine':12} {'programs':>8} {'wall s':>8} {'slowest program':>28}")
    ok = True
    for r in results:
        for mode, e in r["engines"].items():
            if not e["ok"]:
                ok = False
                print(f"{r['family']:8} {mode:12} FAILED: {e['error'][:120]}")
                continue
            slow = max(e["per_program_s"].items(), key=lambda kv: kv[1])
            print(f"{r['family']:8} {mode:12} {e['programs']:>8} {e['wall_s']:>8.1f} {slow[0]:>20} {slow[1]:6.1f}s")
    print("all programs compiled" if ok else "SOME PROGRAMS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
