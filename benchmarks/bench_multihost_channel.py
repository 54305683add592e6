"""How fast process 0 of a multi-process server can hand a program call to the other processes: JAX's distributed
key-value store (what engine/multihost.py uses) against a device broadcast (multihost_utils.broadcast_one_to_all),
for payloads of the sizes a step's packed host inputs take.

Each round: process 0 sends a payload, process 1 receives it and answers with a one-byte acknowledgement through the
store; the round trip is timed on process 0 (median), half of it is the one-way latency a follower adds before it
can dispatch. `kv_set` is process 0's own cost per call (the store lives in process 0's coordinator). The payloads
are a program call as `encode_call` writes it: page tables, tokens and sampling rows of B rows (small integers), or
for the largest one grammar masks.

    python benchmarks/bench_multihost_channel.py                # two CPU processes on localhost (gloo)
    python benchmarks/bench_multihost_channel.py --coordinator-address HOST:PORT --process-id I   # one per host
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = (1 << 10, 16 << 10, 64 << 10, 1 << 20)  # bytes of host inputs per call
ROUNDS = 100


def _payload(size: int) -> np.ndarray:
    """`size` bytes of int32 shaped as step inputs are: page ids and token ids, and -1 padding."""
    rng = np.random.default_rng(size)
    a = np.full(size // 4, -1, np.int32)
    a[: len(a) // 2] = rng.integers(0, 4096, len(a) // 2)
    return a


def run(process_id: int, coordinator: str, rounds: int) -> None:
    import jax

    from gemma4_mtp_jax.engine import distributed
    from gemma4_mtp_jax.engine.multihost import _client, decode_call, encode_call
    from gemma4_mtp_jax.model.sampling import SamplingBatch
    from gemma4_mtp_jax.steps.device_state import StepInputs, StepRows
    from jax.experimental import multihost_utils

    distributed.initialize(coordinator, 2, process_id)
    client, leader = _client(), process_id == 0
    rows = []
    for size in SIZES:
        inputs = StepInputs(StepRows.stack([], 2, slot=0), {"full": _payload(size).reshape(2, -1)},
                            SamplingBatch.from_rows([], 2), None)
        data = encode_call("step", inputs, sampled=False, processed=False, k=2)
        client.wait_at_barrier(f"bench/{size}", 60_000)
        times, sets = [], []
        for i in range(rounds):
            t0 = time.perf_counter()
            if leader:
                client.key_value_set_bytes(f"bench/{size}/{i}", data)
                sets.append(time.perf_counter() - t0)
                client.blocking_key_value_get(f"bench/{size}/ack/{i}", 60_000)
            else:
                decode_call(client.blocking_key_value_get_bytes(f"bench/{size}/{i}", 60_000))
                client.key_value_set(f"bench/{size}/ack/{i}", "1")
            times.append(time.perf_counter() - t0)
        x = _payload(size)
        multihost_utils.broadcast_one_to_all(x)  # compiled once
        bcast = []
        for i in range(rounds):
            t0 = time.perf_counter()
            np.asarray(multihost_utils.broadcast_one_to_all(x))
            bcast.append(time.perf_counter() - t0)
        if leader:
            row = {"bytes": size, "encoded_bytes": len(data), "kv_one_way_us": 0.5e6 * float(np.median(times)),
                   "kv_set_us": 1e6 * float(np.median(sets)), "broadcast_us": 1e6 * float(np.median(bcast))}
            rows.append(row)
            print(row, flush=True)
    if leader:
        print(f"\njax {jax.__version__} on {jax.devices()[0].platform}, {jax.process_count()} processes")
        print(f"{'bytes':>8} {'encoded':>8} {'kv one-way us':>14} {'kv set us':>10} {'broadcast us':>13}")
        for r in rows:
            print(f"{r['bytes']:8d} {r['encoded_bytes']:8d} {r['kv_one_way_us']:14.0f} {r['kv_set_us']:10.0f} "
                  f"{r['broadcast_us']:13.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0 (default: two local "
                                                                   "processes on a free port)")
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args()
    if args.coordinator_address is not None:
        run(args.process_id, args.coordinator_address, args.rounds)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, "--coordinator-address", f"127.0.0.1:{port}",
                               "--process-id", str(i), "--rounds", str(args.rounds)], env=env) for i in range(2)]
    raise SystemExit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
