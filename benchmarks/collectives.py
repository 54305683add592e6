"""Collectives per step of a tensor-parallel engine, counted in the optimized HLO of its decode, verify and
speculative programs, with their sizes and where in the model they come from.

Under tensor parallelism a decode step's collectives cost latency, not bandwidth (each moves a few hundred KB at
most), so their number sets what splitting a model over N devices gains. This builds the engine's own programs
(an `Engine` of parameter shapes alone, nothing compiled at start: `engine.steps`, the programs/ layer) for N
devices and walks each program's optimized HLO as kernel_count.py does (loops once per trip count, of a
conditional's branches the one with the most collectives), counting all-reduce, all-gather, reduce-scatter,
collective-permute and all-to-all. Each is attributed by its op metadata (the JAX name stack) to
- `layers`: the target's decoder layers (goal: at most 2 all-reduces per layer: attention's and the MLP's),
- `target`: the rest of the target's forward (embedding lookups, per-layer inputs, final norm, LM head),
- `draft`: the assistant's draft steps (goal: none),
- `step`: the program around them (sampling, acceptance, bookkeeping).
Bytes: the size of each collective's result on one device (an all-gather's gathered array).

Programs: decode (greedy; `decode_sampled`: a batch with a sampled row), speculative (the round: k draft steps,
the verify, acceptance; `speculative_sampled`), and the round in the three programs a batch with a grammar runs:
draft (the k draft steps alone), verify (the target's verify forward and its logits, whole on every device for the
host-timed masks), accept (the processed sampling and acceptance).

    python benchmarks/collectives.py --models 31b 26b --tp 2 4 --batch 2 16                  # real shapes
    python benchmarks/collectives.py --ckpt TARGET_DIR --assistant ASSISTANT_DIR --tp 2       # a checkpoint's shapes
    python tests/hf_tiny.py /tmp/tiny && python benchmarks/collectives.py --tp 2 --context 64 $(for f in e2b a26b \
        b31b u12b; do echo --ckpt /tmp/tiny/$f/target --assistant /tmp/tiny/$f/assistant; done)   # the tests' families
    python benchmarks/collectives.py --models e2b --tp 2 --programs speculative --dump-hlo /tmp/hlo

Runs on the CPU (JAX_PLATFORMS=cpu: the script asks XLA for 8 host devices) or on N GPUs. What the CPU counts is
the SPMD partitioner's work, which both backends share; the GPU's pipeline may still combine or convert some
collectives (async starts, reduce-scatter from all-reduce + slice), so a GPU run is the word on the GPU.
JSON to $OUT/collectives.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

# On the CPU, N devices for an engine split over N: set before JAX starts (the host platform only; a GPU run's
# devices are its GPUs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import TARGETS, environment, lower_program, write_json  # noqa: E402
from benchmarks.kernel_count import _scope, load_model, tally  # noqa: E402
from gemma4_mtp_jax.api import Assistant, Target, assistant_shapes, target_shapes  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
PARTS = ("layers", "target", "draft", "step")
PROGRAMS = ("decode", "decode_sampled", "speculative", "speculative_sampled", "draft", "verify", "accept")
# An async collective counts at its start; its done and any update launch nothing more.
_COLLECTIVE = re.compile(r"= (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2}


def _bytes(result: str, kind: str, start: bool) -> int:
    """Bytes of a collective's result type on one device: every array of a tuple (a combined collective), but of
    an async all-gather's or permute's start ((operand, result, ...)) the result alone."""
    arrays = []
    for dtype, dims in _ARRAY.findall(result):
        itemsize = _ITEMSIZE.get(dtype) or int(re.match(r"[a-z]+(\d+)", dtype).group(1)) // 8  # f32, s32, f8e4m3fn
        arrays.append(itemsize * math.prod(int(d) for d in dims.split(",") if d))
    if start and kind in ("all-gather", "collective-permute") and len(arrays) > 1:
        return arrays[1]
    return sum(arrays)


def part_of(op_name: str) -> str:
    """Which part of the step a collective belongs to (see the module docstring), from its JAX name stack: the
    draft steps are traced as `draft_step`, the target's layers as `decoder_layer` (or, traced inline, under
    `Gemma4Target/layers_<i>`). A collective XLA combined from several names is the draft's if any is."""
    if "draft_step" in op_name:
        return "draft"
    if "decoder_layer" in op_name or re.search(r"Gemma4Target/layers_\d+/", op_name):
        return "layers"
    return "target" if "Gemma4Target" in op_name else "step"


def collectives(text: str, scope_depth: int = 4) -> collections.Counter:
    """(part, kind, scope, bytes) -> how many of that collective one execution of the module runs (HLO text)."""
    def key(opcode: str, line: str, comps: dict[str, list[str]]):
        m = _COLLECTIVE.search(line)
        if m is None or not opcode.startswith(m.group(2)):
            return None
        name = _OP_NAME.search(line)
        return (part_of(name.group(1) if name else ""), m.group(2), _scope(line, comps, scope_depth),
                _bytes(m.group(1), m.group(2), bool(m.group(3))))

    return tally(text, key, "max", syncs=False)


def summarize(text: str, target_layers: int, k: int) -> dict:
    """A program's collectives: by kind, by part (count, bytes, by kind), all-reduces per target layer, the draft
    steps' collectives (all, and per step), and each distinct collective with its scope and size."""
    counts = collectives(text)
    by_part: dict[str, dict] = {p: {"count": 0, "bytes": 0, "by_kind": {}} for p in PARTS}
    by_kind: collections.Counter = collections.Counter()
    for (part, kind, _, nbytes), n in counts.items():
        entry = by_part[part]
        entry["count"] += n
        entry["bytes"] += n * nbytes
        entry["by_kind"][kind] = entry["by_kind"].get(kind, 0) + n
        by_kind[kind] += n
    draft = by_part["draft"]["count"]
    return {"collectives": sum(by_kind.values()), "bytes": sum(p["bytes"] for p in by_part.values()),
            "by_kind": dict(by_kind), "parts": by_part,
            "all_reduces_per_target_layer": round(by_part["layers"]["by_kind"].get("all-reduce", 0) / target_layers,
                                                  2),
            "draft_collectives": draft, "draft_per_step": round(draft / k, 2) if k else 0,
            "each": [{"part": p, "kind": kind, "scope": s, "bytes": b, "count": n}
                     for (p, kind, s, b), n in sorted(counts.items(), key=lambda kv: (PARTS.index(kv[0][0]),
                                                                                      -kv[1]))]}


def engine_programs(target: Target, assistant: Assistant, tp: int, batch: int, k: int, context: int,
                    page_size: int) -> dict[str, Callable[[], tuple[Any, tuple]]]:
    """program name -> a function building it ((jitted, abstract args)): the programs a plain and a speculative
    engine of `tp` devices build for `batch` rows. Each engine is made when a program of it is first asked for,
    of the parameters' shapes alone when the target has no weights (nothing is compiled or allocated here)."""
    common = dict(max_num_seqs=batch, max_model_len=context, page_size=page_size, tensor_parallel_size=tp,
                  compile_at_start=False, prefill_chunk=min(256, context))

    @functools.cache
    def steps(speculative: bool) -> CompiledSteps:
        if not speculative:
            return Engine(target, EngineConfig(**common)).steps
        return Engine(target, EngineConfig(**common, num_speculative_tokens=k, structured_outputs=True),
                      assistant=assistant).steps

    return {"decode": lambda: steps(False).decode_program(batch, False),
            "decode_sampled": lambda: steps(False).decode_program(batch, True),
            "speculative": lambda: steps(True).speculative_program(batch, False),
            "speculative_sampled": lambda: steps(True).speculative_program(batch, True),
            "draft": lambda: steps(True).draft_program(batch),
            "verify": lambda: steps(True).verify_program(batch),
            "accept": lambda: steps(True).accept_program(batch)}


def count_model(name: str, target: Target, assistant: Assistant, args: argparse.Namespace,
                dump: str | None = None) -> list[dict]:
    """One row per (tp, batch): each asked program's `summarize`."""
    rows = []
    layers = target.config.num_layers
    for tp in args.tp:
        for B in args.batch:
            row = {"model": name, "tp": tp, "batch": B, "k": args.k, "target_layers": layers}
            programs = engine_programs(target, assistant, tp, B, args.k, args.context, args.page_size)
            for prog in args.programs:
                t0 = time.perf_counter()
                text = lower_program(programs[prog]()).compile().as_text()
                row[prog] = summarize(text, layers, 0 if prog.startswith("decode") else args.k)
                row[prog]["compile_s"] = round(time.perf_counter() - t0, 1)
                if dump:
                    os.makedirs(dump, exist_ok=True)
                    with gzip.open(os.path.join(dump, f"{name}_{prog}_tp{tp}_b{B}.hlo.txt.gz"), "wt") as f:
                        f.write(text)
            rows.append(row)
            print(json.dumps({key: v if not isinstance(v, dict) else {x: v[x] for x in v if x != "each"}
                              for key, v in row.items()}), flush=True)
    return rows


def print_table(rows: list[dict], programs: list[str], each: bool) -> None:
    print(f"\n{'model':8} {'tp':>3} {'B':>3} {'program':20} {'AR/layer':>8} {'layers':>7} {'target':>7} "
          f"{'draft':>6} {'step':>5} {'all':>5} {'KB':>9}")
    for r in rows:
        for prog in programs:
            s = r[prog]
            parts = s["parts"]
            print(f"{r['model']:8} {r['tp']:3d} {r['batch']:3d} {prog:20} {s['all_reduces_per_target_layer']:8.2f} "
                  f"{parts['layers']['count']:7d} {parts['target']['count']:7d} {parts['draft']['count']:6d} "
                  f"{parts['step']['count']:5d} {s['collectives']:5d} {s['bytes'] / 1024:9.1f}")
            for c in s["each"] if each else []:
                print(f"    {c['count']:4d} x {c['kind']:18} {c['bytes']:>10} B  {c['part']:7} {c['scope']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, choices=sorted(TARGETS) + ["demo"],
                    help="real shapes (benchmarks/common.py; bf16, no weights) or the demo pair (default: 31b)")
    ap.add_argument("--ckpt", action="append", default=[],
                    help="a target checkpoint's shapes (its config.json alone is read); repeat for several")
    ap.add_argument("--assistant", action="append", default=[], help="the assistant checkpoint of each --ckpt")
    ap.add_argument("--name", action="append", default=[], help="each --ckpt's name in the results (default: its "
                    "directory's parent's name)")
    ap.add_argument("--tp", nargs="+", type=int, default=[2])
    ap.add_argument("--batch", nargs="+", type=int, default=[2])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096, help="max_model_len (table widths)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--programs", nargs="+", default=["decode", "verify", "speculative"], choices=PROGRAMS)
    ap.add_argument("--each", action="store_true", help="also print every distinct collective: kind, size, scope")
    ap.add_argument("--dump-hlo", default=None, help="write each program's optimized HLO (gzip) here")
    args = ap.parse_args()
    if len(args.ckpt) != len(args.assistant) or len(args.name) not in (0, len(args.ckpt)):
        ap.error("each --ckpt needs its --assistant (and its --name, if any is given)")
    env = environment()
    print(env, flush=True)
    models: list[tuple[str, Target, Assistant]] = []
    names = args.name or [os.path.basename(os.path.dirname(os.path.abspath(c))) for c in args.ckpt]
    for name, ckpt, assistant in zip(names, args.ckpt, args.assistant):
        models.append((name, target_shapes(ckpt), assistant_shapes(assistant)))
    for name in args.models if args.models is not None else ([] if args.ckpt else ["31b"]):
        models.append((name, *load_model(name)))
    rows = []
    for name, target, assistant in models:
        rows += count_model(name, target, assistant, args, args.dump_hlo)
    write_json("collectives.json", {"env": env, "rows": rows})
    print_table(rows, args.programs, args.each)


if __name__ == "__main__":
    main()
