"""`python -m gemma4_mtp_jax.train assistant`: train an MTP assistant for a frozen Gemma 4 target.

--out DIR receives, besides the checkpoint itself (config.json, generation_config.json, model.safetensors, written
at the end):
  run.json          the architecture and options the run was started with (a resumed run must match them)
  data/             the prepared training / held-out sequences (reused on resume)
  checkpoints/      training checkpoints (parameters, optimizer state, step; see train/checkpoint.py)
  train_log.jsonl   one line per step: loss, KL and cross-entropy per draft step, acceptance, grad norm, lr
  eval.json         the held-out evaluation (also printed): before training, after training (dense head, and
                    the centroid fit's coverage), and of the written checkpoint as served
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.weights import demo
from gemma4_mtp_jax.api import abstract_assistant_params, load_assistant, load_target
from gemma4_mtp_jax.model.config import ConfigError, read_config_json
from gemma4_mtp_jax.train import arch, checkpoint
from gemma4_mtp_jax.train.centroids import cluster_of_tokens, fit_centroid_head, refine_centroids
from gemma4_mtp_jax.train.data import Dataset, DataError, DataOptions, build_dataset
from gemma4_mtp_jax.train.export import checkpoint_tensors, generation_config, write_assistant
from gemma4_mtp_jax.train.objective import Objective
from gemma4_mtp_jax.train.trainer import (
    Coverage,
    TrainConfig,
    abstract_state,
    collect_draft_hiddens,
    evaluate,
    fit,
    programs,
)
from gemma4_mtp_jax.weights.safetensors_io import CheckpointError

PROG = "python -m gemma4_mtp_jax.train assistant"
EPILOG = """\
examples:
  python -m gemma4_mtp_jax.train assistant --target demo --data corpus/ --out runs/demo-assistant --steps 500
  python -m gemma4_mtp_jax.train assistant --target ckpt/e2b --init ckpt/e2b-assistant --data corpus/ \\
      --out runs/e2b-assistant --dtype bfloat16 --steps 20000 --batch-size 16 --seq-len 1024 --k 4
  python -m gemma4_mtp_jax.train assistant --target ckpt/31b --data corpus/ --out runs/31b-assistant \\
      --assistant-config '{"text_config": {"hidden_size": 512, "intermediate_size": 4096}}'

Running the same command again resumes from the newest checkpoint in --out (same options required; --steps may
grow, which stretches the learning-rate schedule). The result in --out loads with gemma4_mtp_jax.load_assistant,
`python -m checkpoints_convert --hf DIR` and transformers' Gemma4AssistantForCausalLM.
"""


class RunError(ValueError):
    """Options that contradict the run found in --out."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Train a Gemma 4 MTP assistant (drafter) for a frozen target by distillation on its own draft "
                    "rounds, and write it as a Hugging Face checkpoint.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("models")
    g.add_argument("--target", required=True,
                   help="the target: HF directory, converted Orbax directory, hub id, or 'demo' (the embedded pair)")
    g.add_argument("--init", default=None,
                   help="start from this assistant (HF / Orbax directory, hub id, or 'demo'); its architecture is kept")
    g.add_argument("--assistant-config", default=None, metavar="JSON",
                   help="a fresh assistant's config.json overrides (inline JSON object or a file), merged over the "
                        "default derived from the target (4 layers [S,S,S,F]; hidden 256 and the centroid head for "
                        "PLE targets (E2B/E4B), else hidden 1024; the target's K/V geometry)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the dtype the target runs in (and the assistant computes in and is saved in); default: the "
                        "target checkpoint's")
    g = ap.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=None, metavar="FILE_OR_DIR",
                   help="text files (.txt .md .text .rst, tokenized with the target's tokenizer.json), .jsonl "
                        "({\"text\"} or {\"ids\"}), .ids (ids per line), .npy (int array); directories are searched")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default 512)")
    g.add_argument("--heldout-fraction", type=float, default=0.05, help="held-out share of the sequences (0.05)")
    g.add_argument("--max-heldout-seqs", type=int, default=256, help="cap on held-out sequences (default 256)")
    g.add_argument("--max-train-seqs", type=int, default=None,
                   help="sequences to read for training (default: steps x batch size, one pass)")
    g.add_argument("--self-distill-fraction", type=float, default=0.25,
                   help="share of training sequences replaced by the target's own continuation of their first "
                        "--prompt-len tokens (default 0.25)")
    g.add_argument("--self-distill-temperature", type=float, default=0.0,
                   help="sampling temperature of those continuations (default 0: greedy)")
    g.add_argument("--self-distill-top-p", type=float, default=1.0, help="top-p of sampled continuations (1.0)")
    g.add_argument("--prompt-len", type=int, default=None, help="prompt tokens for continuations (default seq-len/4)")
    g.add_argument("--gen-batch", type=int, default=16, help="sequences generated concurrently (default 16)")
    g = ap.add_argument_group("objective and optimizer")
    g.add_argument("--k", type=int, default=None,
                   help="draft steps unrolled per round = num_assistant_tokens written (default: --init's, else 4)")
    g.add_argument("--step-decay", type=float, default=0.8, help="weight of draft step j is decay^(j-1) (0.8)")
    g.add_argument("--ce-weight", type=float, default=1.0,
                   help="weight of the cross-entropy on the target's greedy token, beside the KL (1.0)")
    g.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    g.add_argument("--positions-per-seq", type=int, default=64,
                   help="bonus positions (rounds) trained per sequence and step (default 64)")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW, default 3e-4)")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default min(100, steps/10))")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr x this (0.1)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay on matrices (0.01)")
    g.add_argument("--clip-norm", type=float, default=1.0, help="gradient clipping by global norm (1.0)")
    g.add_argument("--seed", type=int, default=0, help="initialisation, data order, positions (default 0)")
    g = ap.add_argument_group("checkpoints and output")
    g.add_argument("--out", required=True, help="output directory (the assistant checkpoint and the run's state)")
    g.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (default 500)")
    g.add_argument("--keep-checkpoints", type=int, default=1, help="training checkpoints kept (default 1)")
    g.add_argument("--centroid-iters", type=int, default=20,
                   help="centroid head: balanced k-means iterations over the head rows (default 20)")
    g.add_argument("--centroid-fit-batches", type=int, default=64,
                   help="centroid head: training batches whose draft hiddens the centroids are fitted to (64)")
    g.add_argument("--centroid-fit-steps", type=int, default=1000,
                   help="centroid head: Adam steps fitting the centroids' cluster scores (default 1000; 0: the "
                        "k-means means as they are)")
    g.add_argument("--eval-batch-size", type=int, default=None, help="held-out sequences per evaluation step "
                                                                     "(default --batch-size)")
    return ap


def _info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _train_config(args, k: int) -> TrainConfig:
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len),
                        ("--positions-per-seq", args.positions_per_seq), ("--k", k), ("--save-every", args.save_every)):
        if value < 1:
            raise RunError(f"{flag} {value}: must be at least 1")
    if args.seq_len < k + 2:
        raise RunError(f"--seq-len {args.seq_len}: must be at least k + 2 = {k + 2}")
    warmup = args.warmup_steps if args.warmup_steps is not None else min(100, args.steps // 10)
    return TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        positions_per_seq=min(args.positions_per_seq, args.seq_len),
        objective=Objective(k=k, step_decay=args.step_decay, ce_weight=args.ce_weight),
        lr=args.lr, warmup_steps=warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        clip_norm=args.clip_norm, seed=args.seed)


def _check_resume(run: dict, new: dict, out: Path, full: bool) -> None:
    """Refuse options that change what the prepared data (the target's continuations) or, with `full` (a checkpoint
    exists), the checkpoint means; --steps may change."""
    where = out / "run.json"
    for key in ("target", "dtype") + (("init",) if full else ()):
        if run[key] != new[key]:
            raise RunError(f"{where}: this run was started with --{key} {run[key]}, not {new[key]} (use a new --out)")
    if not full:
        return
    if run["assistant_config"] != new["assistant_config"]:
        raise RunError(f"{where}: this run was started with another assistant architecture (--assistant-config / "
                       "--init); use a new --out")
    old_t, new_t = dict(run["train"]), dict(new["train"])
    old_t.update(old_t.pop("objective"))
    new_t.update(new_t.pop("objective"))
    for key, value in old_t.items():
        if key != "steps" and new_t[key] != value:
            raise RunError(f"{where}: this run was started with --{key.replace('_', '-')} {value}, not "
                           f"{new_t[key]} (use the same options to resume, or a new --out)")


def _architecture(args, target) -> tuple[dict, dict, Any, str | None]:
    """(assistant config.json, generation_config base, the --init assistant or None, its source)."""
    _, init_src = demo.resolve(args.target, args.init)
    if init_src is None:
        config_json = arch.default_assistant_config(read_config_json(target.path), target.config)
        if args.assistant_config is not None:
            config_json = arch.merge_config(config_json, arch.read_config_overrides(args.assistant_config))
        gen_base = {key: target.generation_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                    if key in target.generation_config}
        return config_json, gen_base, None, None
    if args.assistant_config is not None:
        raise RunError("--init and --assistant-config exclude each other: --init brings its own architecture")
    init = load_assistant(init_src, "float32")  # float32 master weights
    return read_config_json(init.path), dict(init.generation_config), init, init_src


def _dataset(args, target, data_dir: Path, k: int) -> Dataset:
    """The prepared sequences in data_dir, or new ones from --data (saved there)."""
    if Dataset.exists(data_dir):
        dataset = Dataset.load(data_dir)
        _info(f"data: the sequences prepared in {data_dir} ({len(dataset.train)} train, {len(dataset.heldout)} "
              "held-out); delete it to rebuild from --data")
    else:
        if not args.data:
            raise DataError("--data: required (no prepared data in --out)")
        from gemma4_mtp_jax.generate import load_tokenizer

        prompt_len = args.prompt_len if args.prompt_len is not None else args.seq_len // 4
        opts = DataOptions(
            seq_len=args.seq_len, k=k, prompt_len=max(1, prompt_len), heldout_fraction=args.heldout_fraction,
            max_heldout=args.max_heldout_seqs, self_distill_fraction=args.self_distill_fraction,
            self_distill_temperature=args.self_distill_temperature, self_distill_top_p=args.self_distill_top_p,
            max_train_sequences=args.max_train_seqs or args.steps * args.batch_size, gen_batch=args.gen_batch,
            seed=args.seed)
        dataset = build_dataset(target, args.data, load_tokenizer(target.path), opts)
        dataset.save(data_dir)
        _info(f"data: {json.dumps({k_: v for k_, v in dataset.info.items() if k_ != 'options'})}")
    if dataset.train.tokens.shape[1] != args.seq_len:
        raise RunError(f"{data_dir}: sequences of {dataset.train.tokens.shape[1]} tokens, but --seq-len {args.seq_len}")
    return dataset


def _fit_centroid_head(args, acfg, progs, params, target, dataset: Dataset, init_ordering: np.ndarray | None):
    """(centroids, token_ordering, Coverage) for a centroid-head assistant: balanced k-means over the trained dense
    head's rows, then the centroids fitted to draft hiddens of training data."""
    head = arch.canonical_head(params)
    centroids, ordering = fit_centroid_head(head, acfg.num_centroids, args.centroid_iters, args.seed, init_ordering)
    cluster_of = cluster_of_tokens(ordering, acfg.num_centroids)
    hn, top = collect_draft_hiddens(progs, params, target.params, dataset.train, args.centroid_fit_batches)
    centroids = refine_centroids(centroids, cluster_of, hn, top, head, args.centroid_fit_steps, args.seed)
    return centroids, ordering, Coverage(jnp.asarray(centroids), jnp.asarray(cluster_of), acfg.centroid_top_k)


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    out = Path(args.out).expanduser()
    target_src, _ = demo.resolve(args.target, args.init)
    target = load_target(target_src, args.dtype)
    dtype = jnp.dtype(target.dtype).name
    _info(f"target {target_src} ({target.config.num_layers} layers, hidden {target.config.hidden_size}, {dtype})")
    config_json, gen_base, init, init_src = _architecture(args, target)
    acfg = arch.parse_for_target(config_json, target.config,
                                 "--assistant-config" if init is None else f"--init {init_src}: config.json")
    k = args.k or int(gen_base.get("num_assistant_tokens") or 4)
    tcfg = _train_config(args, k)
    suppress = tuple(sorted(int(t) for t in gen_base.get("suppress_tokens") or []))
    run_info = {"target": str(target.path.resolve()), "dtype": dtype,
                "init": None if init is None else str(init.path.resolve()),
                "assistant_config": config_json, "generation_config": gen_base, "train": dataclasses.asdict(tcfg)}
    latest = checkpoint.latest(out)
    if (out / "run.json").is_file():  # written once the data was prepared: the data is the target's
        _check_resume(json.loads((out / "run.json").read_text()), run_info, out, full=latest is not None)
    dataset = _dataset(args, target, out / "data", k)
    (out / "run.json").write_text(json.dumps(run_info, indent=2))

    progs = programs(target.config, target.dtype, arch.dense(acfg), tcfg, suppress)
    eval_batch = args.eval_batch_size or tcfg.batch_size
    placeholder = Coverage.placeholder(acfg)
    init_ordering_path = out / "init_token_ordering.npy"  # an --init centroid head's clusters: the k-means start
    if latest is not None:
        template = abstract_state(progs, abstract_assistant_params(arch.dense(acfg), jnp.float32))
        state, saved = checkpoint.load(latest, template)
        state = jax.tree_util.tree_map(jnp.asarray, state)
        start = int(saved["step"])
        if start > tcfg.steps:
            raise RunError(f"{latest}: the checkpoint is at step {start}, beyond --steps {tcfg.steps}")
        _info(f"resuming from {latest} (step {start} of {tcfg.steps})")
        initial_path = out / "eval_initial.json"
        initial = json.loads(initial_path.read_text()) if initial_path.is_file() else None
    else:
        if init is not None:
            params, ordering = arch.dense_params(init)
            if ordering is not None:
                np.save(init_ordering_path, ordering)
        else:
            params = arch.init_params(acfg, tcfg.seed)
        state = {"params": params, "opt_state": progs.optimizer.init(params)}
        start = 0
        initial = evaluate(progs, params, target.params, dataset.heldout, eval_batch, placeholder,
                           "held-out evaluation (initial)")
        (out / "eval_initial.json").write_text(json.dumps(initial, indent=2))

    t_train = time.perf_counter()
    if start < tcfg.steps:
        meta = {"seed": tcfg.seed, "rng": "the key of step s is fold_in(PRNGKey(seed), s)",
                "batch_size": tcfg.batch_size}
        state = fit(progs, target.params, state, start, dataset.train, out, meta, args.save_every,
                    args.keep_checkpoints)
    train_s = time.perf_counter() - t_train
    params = state["params"]

    centroids = ordering = None
    coverage = placeholder
    if acfg.use_ordered_embeddings:
        init_ordering = np.load(init_ordering_path) if init_ordering_path.is_file() else None
        centroids, ordering, coverage = _fit_centroid_head(args, acfg, progs, params, target, dataset, init_ordering)
    write_assistant(out, config_json, generation_config(gen_base, k),
                    checkpoint_tensors(params, dtype, centroids, ordering), dtype)
    _info(f"wrote the assistant to {out}")

    trained = evaluate(progs, params, target.params, dataset.heldout, eval_batch, coverage,
                       "held-out evaluation (trained, dense head)")
    served = load_assistant(out, dtype)  # what the engine will load
    served_eval = evaluate(programs(target.config, target.dtype, served.config, tcfg, suppress), served.params,
                           target.params, dataset.heldout, eval_batch, placeholder,
                           "held-out evaluation (written checkpoint)")
    report = {
        "out": str(out),
        "step": tcfg.steps,
        "k": k,
        "assistant": {"hidden_size": acfg.text.hidden_size, "layers": acfg.text.num_layers,
                      "head": "centroid" if acfg.use_ordered_embeddings else "dense",
                      "parameters": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))},
        "data": {k_: v for k_, v in dataset.info.items() if k_ != "options"},
        "heldout_initial": initial,
        "heldout_trained_dense_head": trained,
        "heldout_served": served_eval,
        "train_seconds_this_run": train_s,
        "seconds_this_run": time.perf_counter() - t_start,
    }
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except (ConfigError, CheckpointError, DataError, RunError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0
