"""The whole step matrix in one command: models x batch sizes x k, with the roofline, one JSON and plots.

For each model, `bench_spec.py` runs in its own process (one JAX process on the GPU at a time): the decode step
(k = 0) at every batch size, the verify step and the speculative step at every batch size and k, against the HBM
roofline measured in that process; its weights are made once and all its programs compile concurrently before the
first is timed. The rows are merged into `bench_all.json`; with matplotlib installed, two plots go
beside it: `bench_all_decode.png` (decode step time and share of the copy roofline vs batch, per model, both
synchronised — every call waited for — and pipelined — calls back to back, as the async engine runs them) and
`bench_all_spec.png` (speculative step / decode step vs k, pipelined, per model and batch). A run that fails or
times out is recorded and the others go on.

    python benchmarks/bench_all.py --models e2b e4b 26b 31b --batch 1 2 16 64 --k 2 4 8
    python benchmarks/bench_all.py --smoke       # tiny shapes, CPU

Beside the matrix (`--hf-models`, default E2B and 31B): transformers' own `generate` at batch 1, greedy, eager
PyTorch, on the same shapes and context, where torch and transformers are installed, against this stack's own
`generate` timed the same way (bench_hf_eager.py --impl transformers / ours, one process each): the whole loop
against the whole loop, per token after the first. The decode program's pipelined time at the smallest batch
stands beside them, labelled, for scale only.

The whole matrix takes longer than one 600 s device call. `--merge OLD.json [...]` keeps the model runs of earlier
bench_all.json files that succeeded, runs only the models left, and writes the union (plots included): call it
again with the JSONs carried until nothing is left to run. Every row's ratios still come
from one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_hf_eager import JSON_NAMES  # noqa: E402
from benchmarks.common import TARGETS, environment  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(script: str, cmd_args: list[str], json_name: str, timeout: float) -> dict:
    """One benchmark process (its own JAX or torch process on the GPU); returns {rc, seconds, rows[, error]}."""
    cmd = [sys.executable, os.path.join(HERE, script), *cmd_args]
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env={**os.environ, "OUT": out}, capture_output=True, text=True,
                                  timeout=timeout)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = 124, f"timed out after {timeout} s"
        record = {"rc": rc, "seconds": time.perf_counter() - t0, "rows": []}
        path = os.path.join(out, json_name)
        if os.path.exists(path):  # a process cut short leaves the rows it measured (kept, and run again by --merge)
            with open(path) as f:
                child = json.load(f)
            record["rows"], record["env"] = child["rows"], child.get("env")  # env: the machine that measured
        if rc != 0:
            record["error"] = tail
    return record


def run_spec(model: str | None, batch: list[int], ks: list[int], args) -> dict:
    """One bench_spec.py process: {kind "spec", model, k (the list), rc, seconds, rows[, error]}."""
    cmd = ["--k", *map(str, ks), "--batch", *map(str, batch), "--context", str(args.context),
           "--repeats", str(args.repeats), "--tensor-parallel-size", str(args.tensor_parallel_size)]
    cmd += ["--smoke"] if model is None else ["--models", model]
    return {"kind": "spec", "model": model or "smoke", "k": ks,
            **_run("bench_spec.py", cmd, "bench_spec.json", args.timeout)}


GENERATE_KINDS = {"hf_eager": "transformers", "ours_generate": "ours"}  # run kind -> bench_hf_eager.py --impl


def run_generate(kind: str, model: str | None, args) -> dict:
    """One bench_hf_eager.py process (transformers' generate or ours, batch 1): {kind, model, rc, ...}."""
    impl = GENERATE_KINDS[kind]
    cmd = ["--impl", impl] + (["--smoke"] if model is None else ["--models", model, "--context", str(args.context)])
    return {"kind": kind, "model": model or "smoke", **_run("bench_hf_eager.py", cmd, JSON_NAMES[impl], args.timeout)}


def _kept_runs(paths: list[str]) -> list[dict]:
    """The runs of earlier bench_all.json files that succeeded (exit 0, rows written), the first file's run of a
    model winning: a run that exits 0 measured every batch size and k it was asked for."""
    runs, seen = [], set()
    for path in paths:
        with open(path) as f:
            for rec in json.load(f)["runs"]:
                key = (rec.get("kind", "spec"), rec["model"])
                if rec["rc"] == 0 and rec["rows"] and key not in seen:
                    seen.add(key)
                    runs.append(rec)
    return runs


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """The two PNGs (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    models = sorted({r["model"] for r in rows})
    color = {m: f"C{i}" for i, m in enumerate(models)}
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in models:
        dec = {}
        for r in rows:
            if r["model"] == m:
                dec.setdefault(r["batch"], []).append(r)
        bs = sorted(dec)
        # A MoE row without `experts_touched` holds the all-experts roofline, which the sparse step no longer reads.
        share = not TARGETS.get(m, {}).get("enable_moe_block") or all("experts_touched" in dec[b][0] for b in bs)
        for key, style in (("decode_ms", "-"), ("decode_pipelined_ms", "--")):
            ms = [min(x[key] for x in dec[b]) for b in bs]
            kind = "pipelined" if "pipelined" in key else "synchronised"
            ax1.plot(bs, ms, style, marker="o", color=color[m], label=f"{m} {kind}")
            if share:
                ax2.plot(bs, [max(x["decode_roofline_ms"] for x in dec[b]) / t for b, t in zip(bs, ms)], style,
                         marker="o", color=color[m], label=f"{m} {kind}")
    for ax, title in ((ax1, "decode step (ms)"), (ax2, "share of the HBM copy roofline")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_title(title)
        ax.legend(fontsize=7)
    paths.append(os.path.join(out_dir, "bench_all_decode.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "os^vDP"
    for m in models:
        for i, b in enumerate(sorted({r["batch"] for r in rows if r["model"] == m})):
            pts = sorted((r["k"], r["spec_over_decode"], r["spec_over_decode_pipelined"]) for r in rows
                         if r["model"] == m and r["batch"] == b)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "-", marker=markers[i % len(markers)],
                    color=color[m], label=f"{m} B={b}")
    ax.set_xlabel("k (drafts per round)")
    ax.set_title("speculative step / decode step (pipelined)")
    ax.legend(fontsize=6, ncol=2)
    paths.append(os.path.join(out_dir, "bench_all_spec.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["e2b", "e4b", "12b", "26b", "31b"], choices=sorted(TARGETS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 16, 64])
    ap.add_argument("--k", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per bench_spec.py process")
    ap.add_argument("--out", default=None, help="directory of bench_all.json and the plots (default: $OUT or .)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="OLD_JSON",
                    help="earlier bench_all.json files: their successful model runs are kept, not run again")
    ap.add_argument("--hf-models", nargs="*", default=["e2b", "31b"], choices=sorted(TARGETS),
                    help="beside the matrix: transformers' own generate at batch 1 against ours (bench_hf_eager.py; "
                         "needs torch and transformers >= 5.24); the flag alone, with no model, skips it")
    args = ap.parse_args()
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    batch = [2] if args.smoke else args.batch
    runs = _kept_runs(args.merge) if args.merge else []
    done = {(rec.get("kind", "spec"), rec["model"]) for rec in runs}
    todo = [("spec", m) for m in ([None] if args.smoke else args.models)]
    todo += [(kind, m) for m in ([None] if args.smoke else args.hf_models) for kind in GENERATE_KINDS]
    for kind, model in todo:
        if (kind, model or "smoke") in done:
            print(f"[{kind} {model or 'smoke'}] kept from {' '.join(args.merge)}", flush=True)
            continue
        rec = run_spec(model, batch, args.k, args) if kind == "spec" else run_generate(kind, model, args)
        print(f"[{kind} {rec['model']}] rc={rec['rc']} in {rec['seconds']:.0f}s, {len(rec['rows'])} rows", flush=True)
        runs.append(rec)
    rows = [r for rec in runs if rec.get("kind", "spec") == "spec" for r in rec["rows"]]
    hf_rows = [r for rec in runs if rec.get("kind") == "hf_eager" for r in rec["rows"]]
    our_rows = {r["model"]: r for rec in runs if rec.get("kind") == "ours_generate" for r in rec["rows"]}
    pngs = plot(rows, out_dir) if rows else []
    with open(os.path.join(out_dir, "bench_all.json"), "w") as f:
        json.dump({"env": environment(), "config": vars(args), "runs": runs, "plots": pngs}, f, indent=1)
    print(f"\n{'model':6} {'k':>2} {'B':>3} {'decode ms':>9} {'roof%':>6} {'verify ms':>9} {'spec ms':>8} "
          f"{'spec/dec':>8} {'pipelined: decode':>17} {'roof%':>6} {'gemv%':>6} {'spec':>7} {'spec/dec':>8}")
    for r in rows:
        print(f"{r['model']:6} {r['k']:2d} {r['batch']:3d} {r['decode_ms']:9.3f} "
              f"{100 * r['decode_roofline_fraction']:6.1f} {r['verify_ms']:9.3f} {r['spec_ms']:8.3f} "
              f"{r['spec_over_decode']:8.2f} {r['decode_pipelined_ms']:17.3f} "
              f"{100 * r['decode_roofline_ms'] / r['decode_pipelined_ms']:6.1f} "
              f"{100 * r.get('decode_roofline_gemv_ms', float('nan')) / r['decode_pipelined_ms']:6.1f} "
              f"{r['spec_pipelined_ms']:7.3f} "
              f"{r['spec_over_decode_pipelined']:8.2f}")
    if hf_rows:
        print("\ngenerate at batch 1, greedy, ms per token after the first (bench_hf_eager.py): transformers' against "
              "this stack's, both the whole loop;\nbeside them, for scale only, this stack's decode program alone "
              "(pipelined, the smallest batch measured)")
        print(f"{'model':6} {'ctx':>6} {'transformers':>12}  {'attention':9} {'ours generate':>13} {'ratio':>6} "
              f"{'program B':>9} {'program ms':>10}")
        for h in hf_rows:
            ours = our_rows.get(h["model"], {}).get("ms_per_token", float("nan"))
            step = sorted((r["batch"], r["decode_pipelined_ms"]) for r in rows if r["model"] == h["model"])
            b, ms = step[0] if step else (0, float("nan"))
            print(f"{h['model']:6} {h['context']:6d} {h['ms_per_token']:12.2f}  {h['attn_implementation']:9} "
                  f"{ours:13.2f} {h['ms_per_token'] / ours:6.1f} {b:9d} {ms:10.3f}")
    failed = [f"{rec.get('kind', 'spec')} {rec['model']}: rc {rec['rc']}" for rec in runs if rec["rc"] != 0]
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
