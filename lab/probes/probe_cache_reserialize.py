"""Probe: does a step program that JAX's persistent compilation cache gave back still run after the executable
cache (executable_cache.py) stores and loads it? NOT a test.

    python lab/probes/probe_cache_reserialize.py

On the CPU (JAX 0.10.2) it does not: the copy loads, then fails when run ("NOT_FOUND: Function
negate_power_fusion not found"), so `executable_cache.compile_for_cache` keeps such programs out of the cache
there (a small jitted function alone does not show it; the demo pair's programs do). On the H200 (JAX 0.11.2,
run 121) the copies run and give the same tokens, so the GPU stores them. With JAX's persistent cache on, three
engines of the demo pair, each with its own state:
1. compiles its programs (fresh), executable cache A;
2. compiles them again (hits in JAX's cache), executable cache B, which stores what the backend allows;
3. loads from B what 2 stored and generates: its tokens must equal 1's.
Prints what 3 loaded and whether its tokens are equal; exits 1 if generating fails or differs.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from gemma4_mtp_jax.api import load_assistant, load_target  # noqa: E402
from gemma4_mtp_jax.demo import demo_pair  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402
from gemma4_mtp_jax.generate import generate  # noqa: E402
from gemma4_mtp_jax.step import enable_compilation_cache  # noqa: E402

PROMPTS = [[5, 9, 13, 200, 7], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]


def main() -> int:
    enable_compilation_cache(tempfile.mkdtemp())
    tdir, adir = demo_pair()
    target, assistant = load_target(tdir), load_assistant(adir)

    def engine(cache_dir: str) -> Engine:
        return Engine(target, EngineConfig(max_num_seqs=2, max_model_len=64, page_size=16, prefill_chunk=16,
                                           executable_cache_dir=cache_dir, num_speculative_tokens=2),
                      assistant=assistant)

    def tokens(eng: Engine) -> list[list[int]]:
        return [r.tokens for r in generate(target, PROMPTS, 12, engine=eng)]

    want = tokens(engine(tempfile.mkdtemp()))
    b = tempfile.mkdtemp()
    engine(b)
    third = engine(b)
    print(f"{jax.default_backend()}: the third engine loaded {len(third.steps.restored)} of "
          f"{len(third.compile_times)} programs from what the second (JAX-cache hits) stored")
    try:
        same = tokens(third) == want
    except Exception as e:  # noqa: BLE001 - the point of the probe
        print(f"{jax.default_backend()}: generating with them FAILS: {type(e).__name__}: {str(e)[:200]}")
        return 1
    print(f"{jax.default_backend()}: tokens equal to the first engine's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
