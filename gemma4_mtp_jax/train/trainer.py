"""The optimizer, the compiled train and evaluation steps, the training loop and the held-out evaluation."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from gemma4_mtp_jax.model.config import AssistantConfig, TextConfig
from gemma4_mtp_jax.model.assistant import Gemma4Assistant
from gemma4_mtp_jax.model.target import Gemma4Target
from gemma4_mtp_jax.train import checkpoint
from gemma4_mtp_jax.train.centroids import coverage_hits
from gemma4_mtp_jax.train.data import Sequences, batch_indices
from gemma4_mtp_jax.train.objective import (
    Objective,
    RoundStats,
    draft_rounds,
    round_loss,
    round_stats,
    sample_positions,
    target_log_probs,
    target_pass,
    valid_positions,
)

Array = jax.Array


def warmup_cosine(steps: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> optax.Schedule:
    """Linear warmup to lr, then a cosine decay to lr * min_lr_ratio at the last step."""
    warmup = min(warmup_steps, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * min_lr_ratio)


def adamw(schedule: optax.Schedule, b1: float, b2: float, weight_decay: float, clip_norm: float
          ) -> optax.GradientTransformation:
    """AdamW after clipping by global norm; weight decay on matrices only (Gemma's norms multiply by their weight:
    decay would shrink them)."""
    matrices = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1, b2, weight_decay=weight_decay, mask=matrices))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    positions_per_seq: int  # bonus positions P drawn per sequence and step
    objective: Objective
    lr: float = 3e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.01  # on matrices only (see adamw)
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    seed: int = 0

    def schedule(self) -> optax.Schedule:
        return warmup_cosine(self.steps, self.lr, self.warmup_steps, self.min_lr_ratio)

    def optimizer(self) -> optax.GradientTransformation:
        return adamw(self.schedule(), self.b1, self.b2, self.weight_decay, self.clip_norm)

    def step_key(self, step: Array | int) -> Array:
        """The RNG key of a step (bonus positions): a pure function of (seed, step)."""
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), step)


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The fitted centroid head, to check how often the dense head's top token lies in the selected clusters."""

    centroids: Array  # [C, Ha]
    cluster_of: Array  # [V] int32
    top_k: int
    fitted: bool = True

    @staticmethod
    def placeholder(cfg: AssistantConfig) -> "Coverage":
        """Nothing to check (before the fit, or a dense-head assistant), with the shapes of the real check, so that
        both evaluations share one compiled program."""
        C, K = (cfg.num_centroids, cfg.centroid_top_k) if cfg.use_ordered_embeddings else (1, 1)
        return Coverage(jnp.zeros((C, cfg.text.hidden_size), jnp.float32), jnp.zeros((cfg.text.vocab_size,), jnp.int32),
                        K, False)


class Programs:
    """The compiled steps for one (target config and dtype, assistant config, training config)."""

    def __init__(self, target_cfg: TextConfig, target_dtype: Any, assistant_cfg: AssistantConfig, cfg: TrainConfig,
                 suppress: tuple[int, ...]):
        self.target = Gemma4Target(target_cfg, target_dtype)
        self.assistant = Gemma4Assistant(assistant_cfg, jnp.float32)
        self.cfg = cfg
        V = target_cfg.vocab_size
        self.suppress = jnp.zeros((V,), bool).at[jnp.asarray(suppress, jnp.int32)].set(True) if suppress else None
        self.optimizer = cfg.optimizer()
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1))
        self.eval_step = jax.jit(self._eval_step, static_argnames=("top_k",))
        self.collect_step = jax.jit(self._collect_step)

    def _train_step(self, params_a, opt_state, params_t, tokens: Array, lengths: Array, step: Array):
        cfg = self.cfg
        positions, valid = sample_positions(cfg.step_key(step), lengths, tokens.shape[1], cfg.positions_per_seq,
                                            cfg.objective.k)
        tp = target_pass(self.target, params_t, tokens)

        def loss_fn(pa):
            return round_loss(cfg.objective, self.assistant, self.target, pa, params_t, tokens, tp, positions, valid,
                              self.suppress)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params_a)
        updates, opt_state = self.optimizer.update(grads, opt_state, params_a)
        params_a = optax.apply_updates(params_a, updates)
        return params_a, opt_state, {"loss": loss, "stats": stats, "grad_norm": optax.tree.norm(grads),
                                     "lr": cfg.schedule()(step)}

    def _collect_step(self, params_a, params_t, tokens: Array, lengths: Array, step: Array):
        """Draft hiddens [B, N, k, Ha] and greedy drafts [B, N, k] of sampled rounds (N = positions_per_seq), and
        which rounds are real [B, N]: the data the centroid fit learns from."""
        cfg = self.cfg
        key = jax.random.fold_in(cfg.step_key(step), 1)  # a stream apart from training's
        positions, valid = sample_positions(key, lengths, tokens.shape[1], cfg.positions_per_seq, cfg.objective.k)
        tp = target_pass(self.target, params_t, tokens)
        drafts = draft_rounds(self.assistant, self.target, params_a, params_t, tokens, tp, positions, cfg.objective.k,
                              self.suppress)
        return drafts.hn.astype(jnp.float32), drafts.tokens, valid

    def _eval_step(self, params_a, params_t, tokens: Array, lengths: Array, gen_start: Array,
                   centroids: Array, cluster_of: Array, top_k: int):
        """Every bonus position of every sequence: (stats over all valid P, stats over the P at or after
        gen_start (the target's own greedy text: exact acceptance), coverage hits per step). The target runs once;
        the positions go through in chunks of positions_per_seq."""
        cfg, k = self.cfg, self.cfg.objective.k
        B, T = tokens.shape
        n = cfg.positions_per_seq
        chunks = -(-T // n)
        tp = target_pass(self.target, params_t, tokens)
        all_ok = valid_positions(lengths, T, k)
        gen_ok = valid_positions(lengths, T, k, gen_start) & (gen_start < lengths)[:, None]

        def chunk(carry, c):
            P = jnp.minimum(c * n + jnp.arange(n), T - 1)
            positions = jnp.broadcast_to(P, (B, n)).astype(jnp.int32)
            inside = (c * n + jnp.arange(n)) < T
            log_p = target_log_probs(self.target, params_t, tp, positions, k)
            drafts = draft_rounds(self.assistant, self.target, params_a, params_t, tokens, tp, positions, k,
                                  self.suppress)
            v_all = all_ok[:, P] & inside
            v_gen = gen_ok[:, P] & inside
            hits = coverage_hits(drafts.hn, drafts.tokens, centroids, cluster_of, top_k)  # [B, n, k]
            out = (round_stats(cfg.objective, log_p, drafts, v_all), round_stats(cfg.objective, log_p, drafts, v_gen),
                   jnp.sum(hits * v_all[..., None], (0, 1)))
            return jax.tree_util.tree_map(jnp.add, carry, out), None

        zero = RoundStats(jnp.zeros(()), jnp.zeros((k,)), jnp.zeros((k,)), jnp.zeros((k,)), jnp.zeros(()))
        init = (zero, zero, jnp.zeros((k,)))
        total, _ = jax.lax.scan(chunk, init, jnp.arange(chunks))
        return total


_PROGRAMS: dict[tuple, Programs] = {}


def programs(target_cfg: TextConfig, target_dtype: Any, assistant_cfg: AssistantConfig, cfg: TrainConfig,
             suppress: tuple[int, ...]) -> Programs:
    """Programs, shared by every run in a process with the same configuration (compiled once)."""
    key = (repr(target_cfg), jnp.dtype(target_dtype).name, repr(assistant_cfg), repr(cfg), suppress)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = Programs(target_cfg, target_dtype, assistant_cfg, cfg, suppress)
    return _PROGRAMS[key]


# ----------------------------------------------------------------------------------------------------------------
# Held-out evaluation
# ----------------------------------------------------------------------------------------------------------------
def _summary(s: RoundStats) -> dict:
    n = float(s.pairs)
    if n == 0:
        return {"pairs": 0}
    acc = [float(a) / n for a in np.asarray(s.accepted_prefix)]
    return {
        "pairs": int(n),
        "loss": float(s.loss) / n,
        "kl_per_step": [float(x) / n for x in np.asarray(s.kl)],
        "ce_per_step": [float(x) / n for x in np.asarray(s.ce)],
        # P(drafts 1..j all accepted), greedy; their sum is the expected number of accepted drafts per round
        "acceptance_per_position": acc,
        "expected_accepted_per_round": float(sum(acc)),
    }


def evaluate(progs: Programs, params_a, params_t, heldout: Sequences, batch_size: int, coverage: Coverage,
             desc: str = "held-out evaluation") -> dict:
    """Loss and greedy acceptance on held-out sequences (every bonus position). "all": every position of every
    held-out sequence (corpus and target text); "target_greedy": the positions inside the target's own greedy
    continuations, where the acceptance estimate is exact for the served greedy rule. With a fitted `coverage`:
    how often the (dense) head's top token lies inside the selected clusters."""
    total = None
    N = len(heldout)
    for s in tqdm(range(0, N, batch_size), desc=desc, leave=False):
        rows = np.arange(s, s + batch_size)
        idx = rows % N
        lengths = np.where(rows < N, heldout.lengths[idx], 0)  # rows wrapped around to fill the batch count nothing
        out = progs.eval_step(params_a, params_t, jnp.asarray(heldout.tokens[idx]), jnp.asarray(lengths),
                              jnp.asarray(heldout.gen_start[idx]), coverage.centroids, coverage.cluster_of,
                              top_k=coverage.top_k)
        total = out if total is None else jax.tree_util.tree_map(jnp.add, total, out)
    all_, gen, hits = jax.device_get(total)
    result = {"all": _summary(all_), "target_greedy": _summary(gen)}
    if coverage.fitted and float(all_.pairs) > 0:
        per_step = [float(h) / float(all_.pairs) for h in hits]
        result["centroid_coverage"] = {"mean": float(np.mean(per_step)), "per_step": per_step, "goal": 0.99}
    return result


def collect_draft_hiddens(progs: Programs, params_a, params_t, train: Sequences, batches: int) -> tuple[np.ndarray,
                                                                                                     np.ndarray]:
    """(hn [M, Ha], top token [M]) of the dense head's greedy draft steps on `batches` training batches."""
    hns, tops = [], []
    cfg = progs.cfg
    for b in tqdm(range(batches), desc="draft hiddens for the centroid fit", leave=False):
        idx = batch_indices(len(train), cfg.batch_size, b, cfg.seed + 1)
        hn, top, valid = jax.device_get(progs.collect_step(params_a, params_t, jnp.asarray(train.tokens[idx]),
                                                           jnp.asarray(train.lengths[idx]), jnp.asarray(b, jnp.int32)))
        hns.append(hn[valid])
        tops.append(top[valid])
    return np.concatenate(hns).reshape(-1, hns[0].shape[-1]), np.concatenate(tops).reshape(-1)


# ----------------------------------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------------------------------
def abstract_state(progs: Programs, params_template: dict) -> dict:
    """The shape of a training state (to restore a checkpoint into)."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params_template)
    return {"params": abstract, "opt_state": jax.eval_shape(progs.optimizer.init, abstract)}


def fit(progs: Programs, params_t, state: dict, start_step: int, train: Sequences, out: Path, meta: dict,
        save_every: int, keep: int) -> dict:
    """Train from `start_step` to cfg.steps, checkpointing every save_every steps and at the end; one line per
    step goes to out/train_log.jsonl. Returns the final state."""
    cfg = progs.cfg
    log_path = out / "train_log.jsonl"
    lines = log_path.read_text().splitlines() if log_path.is_file() else []
    lines = [ln for ln in lines if json.loads(ln)["step"] <= start_step]  # a resumed run rewrites what follows
    log_path.write_text("".join(ln + "\n" for ln in lines))
    params, opt_state = state["params"], state["opt_state"]
    rate = None
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc="training", unit="step")
    with log_path.open("a") as f:
        for step in bar:
            idx = batch_indices(len(train), cfg.batch_size, step, cfg.seed)
            t0 = time.perf_counter()
            params, opt_state, m = progs.train_step(params, opt_state, params_t, jnp.asarray(train.tokens[idx]),
                                                    jnp.asarray(train.lengths[idx]), jnp.asarray(step, jnp.int32))
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            tokens = int(train.lengths[idx].sum())
            rate = tokens / dt if rate is None or step == start_step + 1 else 0.9 * rate + 0.1 * tokens / dt
            s = m["stats"]
            pairs = max(float(s.pairs), 1.0)
            acc = [float(a) / pairs for a in s.accepted_prefix]
            rec = {"step": step + 1, "loss": float(m["loss"]), "kl_per_step": [float(x) / pairs for x in s.kl],
                   "ce_per_step": [float(x) / pairs for x in s.ce], "acceptance_per_position": acc,
                   "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "pairs": int(pairs),
                   "tokens_per_s": tokens / dt}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{acc[0]:.2f}", tok_s=f"{rate:,.0f}")
            done = step + 1
            if done % save_every == 0 or done == cfg.steps:
                checkpoint.save(out, done, {"params": params, "opt_state": opt_state},
                                {**meta, "samples_seen": done * cfg.batch_size,
                                 "epoch": done * cfg.batch_size // len(train)}, keep)
    bar.close()
    return {"params": params, "opt_state": opt_state}
