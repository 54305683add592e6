"""Where the engine's host time goes per step at many rows: the demo pair (float32, CPU), B requests that never
stop, adaptive speculation or fixed k, cProfile over N steps after warm-up. On the CPU the device work shows up
as the time spent waiting in the step's read-back; the rest is the host's.

    python lab/probes/engine_host_profile.py --batch 128 --steps 20 [--fixed]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gemma4_mtp_jax.api import load_assistant, load_target  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=128)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--fixed", action="store_true")
args = ap.parse_args()
pair = Path(__file__).resolve().parents[2] / "gemma4_mtp_jax" / "demo_pair"
target, assistant = load_target(str(pair / "target"), "float32"), load_assistant(str(pair / "assistant"), "float32")
cfg = EngineConfig(max_num_seqs=args.batch, max_model_len=512, adaptive_speculation=not args.fixed)
engine = Engine(target, cfg, assistant=assistant)
rng = np.random.default_rng(0)
for _ in range(args.batch):
    engine.add_request(rng.integers(6, 8192, 16).tolist(), 400, stop_ids=frozenset())
for _ in range(12):
    engine.step()
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
for _ in range(args.steps):
    engine.step()
prof.disable()
print(f"{args.steps} steps in {time.perf_counter() - t0:.2f} s; chosen {engine.speculation.chosen}")
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
