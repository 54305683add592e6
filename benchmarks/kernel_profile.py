"""Where a step's device time goes: every kernel a few calls launched, from a jax.profiler trace (CUPTI).

A trace runs the programs with XLA's command buffers off (one launch per kernel), so the gaps between kernels are
overstated and the wall time of a traced step means little; each kernel's own duration is what the GPU spent in it.
`profile_calls` traces `calls` invocations of `call()` and returns, per call, the kernels by name (count and
microseconds), grouped into kinds by name (`KINDS`), and the sum: the device-busy time of one step, to set beside
the untraced step time (the rest is launch gaps and fixed costs between kernels).

    from benchmarks.kernel_profile import profile_calls, print_profile
    prof = profile_calls(lambda: step(...), calls=5)
"""

from __future__ import annotations

import collections
import glob
import re
import shutil
import tempfile
from typing import Callable

import jax

# First match wins; names are the kernels' own (XLA fusion names, cuBLAS/cuDNN/nvjet symbols, Pallas kernel names).
KINDS = (
    ("moe_grouped_matmul", re.compile(r"grouped_matmul")),
    ("attention_kernel", re.compile(r"attention|ragged_paged|flash|fmha", re.I)),
    ("centroid_head", re.compile(r"centroid", re.I)),
    ("gemm", re.compile(r"gemm|cublas|nvjet|xmma|cutlass|sm90_|ampere_|dot", re.I)),
    ("reduce_fusion", re.compile(r"reduce|softmax|norm", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|dynamic.update.slice|scatter|gather", re.I)),
    ("fusion", re.compile(r"fusion", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def _device_events(xplane_path: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of every kernel on a GPU stream, in trace order."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # derived lines ("XLA Ops", "XLA Modules") repeat the stream's events
            for ev in line.events:
                events.append((ev.start_ns, ev.name, ev.duration_ns / 1e3))
    events.sort()
    return [(name, us) for _, name, us in events]


def profile_calls(call: Callable[[], object], calls: int = 5) -> dict:
    """Trace `calls` calls of call() (each waited for; call() returns something to wait on) after one untraced
    warm-up call. Returns per-call figures: kernels, busy_us, by_kind {kind: us}, top [(name, count, us)] (every
    kernel, costliest first), and sequence [(name, us)]: the first traced call's kernels in launch order, which
    shows where each part of a step (a draft step, the verify) starts and ends."""
    jax.block_until_ready(call())
    log_dir = tempfile.mkdtemp(prefix="kernel_profile_")
    with jax.profiler.trace(log_dir):
        for _ in range(calls):
            jax.block_until_ready(call())
    try:
        paths = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError(f"kernel_profile: jax.profiler wrote no .xplane.pb under {log_dir}")
        events = _device_events(paths[0])
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_kind: dict[str, float] = collections.Counter()
    for name, us in events:
        per_name[name][0] += 1
        per_name[name][1] += us
        by_kind[kind_of(name)] += us
    top = sorted(((n, c / calls, us / calls) for n, (c, us) in per_name.items()), key=lambda r: -r[2])
    return {"calls": calls, "kernels": len(events) / calls, "busy_us": sum(us for _, us in events) / calls,
            "by_kind": {k: v / calls for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "by_kind_count": dict(collections.Counter(kind_of(n) for n, _ in events)), "top": top,
            "sequence": events[:len(events) // calls]}


def print_profile(label: str, prof: dict, step_us: float | None = None, top: int = 15) -> None:
    head = f"[{label}] {prof['kernels']:.0f} kernels/step, device busy {prof['busy_us']:.0f} us"
    if step_us:
        head += f" of a {step_us:.0f} us step ({prof['busy_us'] / step_us:.0%})"
    print(head, flush=True)
    calls = prof["calls"]
    for kind, us in prof["by_kind"].items():
        print(f"    {kind:20} {us:9.1f} us  ({prof['by_kind_count'].get(kind, 0) / calls:.0f} kernels)", flush=True)
    for name, count, us in prof["top"][:top]:
        print(f"    {us:9.1f} us {count:6.1f}x  {name[:110]}", flush=True)
