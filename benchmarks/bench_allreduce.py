"""The all-reduce a tensor-parallel layer pays: psum of a [B, H] activation over N devices (bf16), for the hidden
sizes of 26B-A4B and 31B. Attention and the MLP each end in one per layer.

Inside a step the all-reduces run back to back with the layers' kernels, so what one costs there is measured as
one program of `--chain` dependent psums, timed per call (median of repeats after warm-up) and divided by the chain.
A single psum per call (`--chain 1`) also pays the program's launch and the host's wait, several times more on two
H200s (128-146 us per call at `--chain 1`).

    python benchmarks/bench_allreduce.py --devices 2 --batch 2 16
    python benchmarks/bench_allreduce.py --smoke      # CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, median_time, write_json  # noqa: E402
from gemma4_mtp_jax.model.sharding import AXIS, Placement  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=None, help="devices in the all-reduce (default: all)")
    ap.add_argument("--batch", nargs="+", type=int, default=[2, 16])
    ap.add_argument("--hidden", nargs="+", type=int, default=[2816, 5376])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--chain", type=int, default=100, help="dependent psums per program (per-psum time = call / chain)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    n = args.devices or len(jax.devices())
    placement = Placement.over(jax.devices()[:n])
    rows = []
    for H in ([64] if args.smoke else args.hidden):
        for B in args.batch:
            x = jax.device_put(jnp.ones((n * B, H), jnp.bfloat16),
                               jax.sharding.NamedSharding(placement.mesh, P(AXIS)))  # one [B, H] partial per device

            def chain(a):  # each psum needs the one before; scaled by 1/n so the values stay the same
                return jax.lax.fori_loop(0, args.chain, lambda _, v: jax.lax.psum(v, AXIS) * (1.0 / n), a)

            f = jax.jit(jax.shard_map(chain, mesh=placement.mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                      check_vma=False))
            t = median_time(f, (x,), repeats=10 if args.smoke else args.repeats) / args.chain
            row = {"devices": n, "batch": B, "hidden": H, "chain": args.chain, "us": t * 1e6}
            rows.append(row)
            print(row, flush=True)
    write_json("bench_allreduce.json", {"env": env, "rows": rows})
    print(f"\n{'N':>3} {'B':>4} {'H':>6} {'us':>8}")
    for r in rows:
        print(f"{r['devices']:3d} {r['batch']:4d} {r['hidden']:6d} {r['us']:8.1f}")


if __name__ == "__main__":
    main()
