"""Kernels per step, counted in the optimized HLO of the decode, verify and speculative programs.

On a GPU with command buffers on, a step's fixed cost is roughly a few microseconds per kernel, so for the small
models the kernel count, not the bytes, sets the step time. This compiles each program from the parameters'
shapes (no weights, no device memory for them) and walks the optimized HLO from the entry computation:
a fusion, a custom call (cuBLAS GEMM, Pallas/Triton kernel) or any other non-trivial instruction is one kernel;
loops count their body once per known trip count; command-buffer `call`s are descended into; of a conditional's
branches, the one a greedy batch takes (the smaller). The result is the number of kernels one execution of a
greedy batch launches, by kind (kernels_max: a batch that samples), and the host syncs (conditional predicates).

    python benchmarks/kernel_count.py --models e2b 31b --batch 2 16          # on the GPU
    python benchmarks/kernel_count.py --models demo --batch 2 --dump-hlo /tmp/hlo
    python benchmarks/kernel_count.py --models e2b --batch 2 --programs verify speculative --by-scope 3
    JAX_PLATFORMS=cpu python benchmarks/kernel_count.py --compile-for h200 --models e2b   # no GPU: the CUDA plugin
    JAX_PLATFORMS=cpu python benchmarks/kernel_count.py --compile-for h200 --models e2b --ptxas   # + registers, spills

JSON to $OUT/kernel_count.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Hashable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import (ASSISTANTS, COMPILE_ONLY_TARGETS, TARGETS, add_pack_params_arg,  # noqa: E402
                               compile_only_device, environment, layout_for, lower_program, ptxas_report,
                               write_json)
from gemma4_mtp_jax.api import (Assistant, Target, abstract_assistant_params, abstract_target_params,  # noqa: E402
                                load_assistant, load_target)
from gemma4_mtp_jax.model.config import parse_assistant_config, parse_target_config  # noqa: E402
from gemma4_mtp_jax.steps.forward import StepSpec, forward_paged, lm_logits  # noqa: E402
from gemma4_mtp_jax.steps.speculative import AssistantDrafter  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402

# Instructions that launch nothing: bookkeeping of the HLO graph, or control flow whose bodies are walked.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
         "opt-barrier", "partition-id", "replica-id", "domain", "copy-done", "send-done", "recv-done"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*?\b([a-z][a-z0-9\-]*)\((.*)$")


def parse_hlo(text: str) -> tuple[str, dict[str, list[str]]]:
    """(entry name, computation name -> its instruction lines) of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and " = " in line:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, comps


def _kind(opcode: str, line: str) -> str:
    if opcode == "fusion":
        m = re.search(r'"kind":"(__[\w$]+)"', line)  # e.g. __triton_gemm, __cublas…, __custom_fusion
        k = re.search(r"kind=(k\w+)", line)
        return f"fusion:{m.group(1) if m else (k.group(1) if k else '?')}"
    if opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', line)
        return f"custom-call:{m.group(1) if m else '?'}"
    return opcode


_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Entry names of XLA's own kernels in its PTX (fusions, its Triton GEMMs); the rest are the Pallas kernels' names.
_XLA_KERNEL = ("loop_", "input_", "fusion", "gemm_fusion", "triton_softmax", "wrapped_", "copy", "transpose_",
               "concatenate", "dynamic_", "slice", "reduce", "scatter", "gather")


def _scope(line: str, comps: dict[str, list[str]], depth: int) -> str:
    """Where in the model a kernel comes from: the JAX name stack of its instruction (a fusion without metadata of
    its own: its root's), the program's own jit and the inner jits dropped but `draft_step` (the assistant's step,
    traced once), numbered modules merged (layers_3 -> layers_*), cut after `depth` names."""
    m = _OP_NAME.search(line)
    callee = re.search(r"calls=%?([\w.\-]+)", line)
    if not m and callee:
        root = next((ln for ln in comps.get(callee.group(1), []) if ln.lstrip().startswith("ROOT")), "")
        m = _OP_NAME.search(root)
    if not m:
        return "(no name)"
    names = []
    for part in m.group(1).split("/")[1:]:
        if part.startswith("jit("):
            if part == "jit(draft_step)":
                names.append("draft_step")
            continue
        names.append(re.sub(r"_\d+$", "_*", part))
    return "/".join(names[:depth]) or "(top level)"


def tally(text: str, key: Callable[[str, str, dict[str, list[str]]], Hashable | None], branch: str = "max",
          syncs: bool = True) -> collections.Counter:
    """What one execution of the module runs, counted under `key(opcode, line, computations)` of each instruction
    that does something (None: not counted): loops' bodies once per known trip count, command-buffer `call`s and
    async wrappers descended into, of a conditional's branches the one with the most counted ("max") or the fewest
    ("min"). With `syncs`, the host syncs too ("while-predicate-sync", "conditional-predicate-sync")."""
    entry, comps = parse_hlo(text)
    pick = max if branch == "max" else min

    def walk(name: str, times: int, out: collections.Counter, depth: int = 0) -> None:
        if depth > 50:
            raise ValueError(f"HLO call depth > 50 at {name}")
        for line in comps.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            opcode = m.group(1)
            if opcode in _FREE:
                continue
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trips.group(1)) if trips else 1
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                walk(body, times * n, out, depth + 1)
                walk(cond, times * (n + 1), out, depth + 1)
                if syncs:
                    out["while-predicate-sync"] += times * (n + 1) if not trips else 0
                continue
            if opcode == "conditional":
                # One branch is launched; the predicate costs a device-to-host copy.
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else [
                    re.search(r"true_computation=%?([\w.\-]+)", line).group(1),
                    re.search(r"false_computation=%?([\w.\-]+)", line).group(1)]
                sub = [collections.Counter() for _ in names]
                for b, c in zip(names, sub):
                    walk(b, times, c, depth + 1)
                out.update(pick(sub, key=lambda c: sum(c.values())))
                if syncs:
                    out["conditional-predicate-sync"] += times
                continue
            if opcode in ("call", "async-start"):
                callee = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", line)
                if callee and callee.group(1) in comps and "fused" not in callee.group(1):
                    walk(callee.group(1), times, out, depth + 1)
                    continue
            if opcode in ("async-done", "async-update"):
                continue
            k = key(opcode, line, comps)
            if k is not None:
                out[k] += times
    total: collections.Counter = collections.Counter()
    walk(entry, 1, total)
    return total


def count_kernels(text: str, branch: str = "max", scope_depth: int | None = None) -> collections.Counter:
    """Kernels one execution of the module launches, by kind (see the module docstring), or with `scope_depth` by
    where in the model they come from (`_scope`). At each conditional the branch with the most kernels is counted
    (branch "max": e.g. a batch that samples), or the fewest ("min": a greedy batch, whose sampling branches are
    skipped)."""
    if scope_depth is None:
        return tally(text, lambda opcode, line, _: _kind(opcode, line), branch)
    return tally(text, lambda _, line, comps: _scope(line, comps, scope_depth), branch)


def summarize(text: str, scope_depth: int | None = None) -> dict:
    """kernels: with every conditional's smaller branch (a greedy batch); kernels_max: with the larger one;
    by_scope (with `scope_depth`): a greedy batch's kernels by where in the model they come from."""
    out = {}
    if scope_depth is not None:
        scopes = count_kernels(text, "min", scope_depth)
        out["by_scope"] = dict(sorted(((k, v) for k, v in scopes.items() if not k.endswith("-sync")),
                                      key=lambda kv: -kv[1]))
    for branch in ("min", "max"):
        counter = count_kernels(text, branch)
        kernels = {k: v for k, v in counter.items() if not k.endswith("-sync")}
        out["kernels" if branch == "min" else "kernels_max"] = sum(kernels.values())
        if branch == "min":
            out["by_kind"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
            out["host_syncs"] = sum(v for k, v in counter.items() if k.endswith("-sync"))
    return out


def load_model(name: str) -> tuple[Target, Assistant]:
    if name == "demo":
        from gemma4_mtp_jax.weights.demo import demo_pair

        t_dir, a_dir = demo_pair()
        return load_target(t_dir), load_assistant(a_dir)
    dtype = jnp.bfloat16
    tcfg = parse_target_config(TARGETS[name], f"benchmarks/common.py TARGETS[{name!r}]")
    acfg = parse_assistant_config(ASSISTANTS[name], f"benchmarks/common.py ASSISTANTS[{name!r}]")
    return (Target(tcfg, abstract_target_params(tcfg, dtype), dtype, None, {}),
            Assistant(acfg, abstract_assistant_params(acfg, dtype), dtype, None, {}))


def programs(target: Target, assistant: Assistant, batch: int, k: int, context: int, page_size: int,
             pack_params: bool = False) -> dict:
    """The lowered programs of one batch size: decode, verify (forward on k+1 tokens + logits, the target half of
    the speculative step), speculative (k draft steps + verify + acceptance + bookkeeping), each for a greedy
    batch; and the decode and speculative variants a batch with a sampled row runs (`*_sampled`)."""
    tcfg, acfg, dtype = target.config, assistant.config, target.dtype
    layout = layout_for(tcfg, batch, page_size=page_size, max_model_len=context, num_speculative_tokens=k,
                        assistant_window=acfg.text.sliding_window)
    spec = CompiledSteps(target, layout, dtype, "auto", drafter=AssistantDrafter(assistant), k=k, num_slots=batch,
                         pack_params=pack_params)
    plain = CompiledSteps(target, layout, dtype, "auto", pack_params=pack_params, max_batch=batch)
    params, _, state, _ = plain._abstract_args(batch)
    tables = plain._abstract_inputs(batch).tables
    pages, tokens = state.pages, jax.ShapeDtypeStruct((batch, k + 1), jnp.int32)

    def verify(params, pages, tokens, positions, tables):
        params = plain.arrays.pack.unpack(params)
        h, pages = forward_paged(StepSpec(target, layout), params, pages, tokens, positions, tables)
        return pages, jnp.argmax(lm_logits(target, params, h), -1)

    return {"decode": lambda: lower_program(plain.decode_program(batch, False)),
            "verify": lambda: jax.jit(verify, donate_argnums=(1,)).lower(params, pages, tokens, tokens, tables),
            "speculative": lambda: lower_program(spec.speculative_program(batch, False)),
            "decode_sampled": lambda: lower_program(plain.decode_program(batch, True)),
            "speculative_sampled": lambda: lower_program(spec.speculative_program(batch, True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "e2b", "e4b", "26b", "31b"],
                    choices=sorted(TARGETS) + ["demo"])
    ap.add_argument("--batch", nargs="+", type=int, default=[2, 16])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096, help="max_model_len of the layout (table widths)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json-name", default="kernel_count.json", help="file name of the JSON under $OUT")
    add_pack_params_arg(ap)
    ap.add_argument("--programs", nargs="+", default=["decode", "verify", "speculative"],
                    choices=["decode", "verify", "speculative", "decode_sampled", "speculative_sampled"])
    ap.add_argument("--dump-hlo", default=None, help="write each program's optimized HLO (gzip) here")
    ap.add_argument("--by-scope", type=int, default=None, metavar="DEPTH",
                    help="also count each program's kernels by where in the model they come from (the name stack "
                         "cut after DEPTH names, e.g. 3: draft_step/Gemma4Assistant/layers_*), and print them")
    ap.add_argument("--compile-for", choices=sorted(COMPILE_ONLY_TARGETS), default=None,
                    help="compile for this GPU on a machine without it (benchmarks/common.py compile_only_device); "
                         "XLA's GEMMs untuned, as with autotuning off")
    ap.add_argument("--ptxas", action="store_true",
                    help="also each program's kernels' registers and spills, from ptxas -v on the PTX XLA compiled "
                         "(benchmarks/common.py ptxas_report): the Pallas kernels, and any kernel that spills")
    args = ap.parse_args()
    env = environment()
    device = None
    if args.compile_for:
        device = compile_only_device(args.compile_for)
        env["compiled_for"] = f"{args.compile_for}: {device.device_kind}, compile-only"
    print(env, flush=True)
    rows = []
    for name in args.models:
        target, assistant = load_model(name)
        layers = target.config.num_layers
        for B in args.batch:
            row = {"model": name, "batch": B, "k": args.k, "target_layers": layers}
            for prog, lower in programs(target, assistant, B, args.k, args.context, args.page_size,
                                        args.pack_params).items():
                if prog not in args.programs:
                    continue
                t0 = time.perf_counter()
                with contextlib.nullcontext() if device is None else jax.default_device(device), \
                        tempfile.TemporaryDirectory() as dump:
                    text = lower().compile({"xla_dump_to": dump} if args.ptxas else None).as_text()
                    row[f"{prog}_compile_s"] = round(time.perf_counter() - t0, 2)  # ptxas's report not counted
                    if args.ptxas:
                        row[f"{prog}_ptxas"] = {k: v for k, v in ptxas_report(dump).items()
                                                if v.get("spill_stores") or "error" in v
                                                or not k.startswith(_XLA_KERNEL)}
                row[prog] = summarize(text, args.by_scope)
                if args.dump_hlo:
                    os.makedirs(args.dump_hlo, exist_ok=True)
                    with gzip.open(os.path.join(args.dump_hlo, f"{name}_{prog}_b{B}.hlo.txt.gz"), "wt") as f:
                        f.write(text)
            if "decode" in row:
                row["decode_per_layer"] = round(row["decode"]["kernels"] / layers, 1)
            if "verify" in row and "speculative" in row:
                row["per_draft_step"] = round((row["speculative"]["kernels"] - row["verify"]["kernels"]) / args.k, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_json(args.json_name, {"env": env, "rows": rows})

    def cell(r, key, fmt="7d"):
        v = r[key]["kernels"] if isinstance(r.get(key), dict) else r.get(key)
        return format(v, fmt) if v is not None else f"{'-':>7}"

    for r in rows if args.ptxas else []:
        for prog in args.programs:
            for kernel, use in sorted(r.get(f"{prog}_ptxas", {}).items()):
                print(f"{r['model']} B={r['batch']} {prog}: {kernel}: " + (use["error"] if "error" in use else
                      f"{use.get('registers')} registers, {use.get('spill_stores', 0)} B spill stores, "
                      f"{use.get('spill_loads', 0)} B spill loads"))

    for r in rows if args.by_scope is not None else []:
        for prog in args.programs:
            if prog in r:
                print(f"\n{r['model']} B={r['batch']} {prog}: kernels by scope")
                for scope, n in r[prog]["by_scope"].items():
                    print(f"  {n:6d}  {scope}")

    print(f"\n{'model':6} {'B':>3} {'decode':>7} {'/layer':>7} {'verify':>7} {'spec':>7} {'/draft':>7} {'syncs':>7}")
    for r in rows:
        syncs = r["speculative"]["host_syncs"] if "speculative" in r else None
        print(f"{r['model']:6} {r['batch']:3d} {cell(r, 'decode')} {cell(r, 'decode_per_layer', '7.1f')} "
              f"{cell(r, 'verify')} {cell(r, 'speculative')} {cell(r, 'per_draft_step', '7.1f')} "
              f"{format(syncs, '7d') if syncs is not None else '-':>7}")


if __name__ == "__main__":
    main()
