"""Training a Gemma 4 target from scratch with next-token cross-entropy: how the demo pair's target is made.

The corpus is one token stream (documents `<bos> ... <eos>` back to back); a batch is B windows of T+1 tokens at
offsets drawn from (seed, step), so a run is a pure function of its options. Positions restart at 0 in every
window, as they do in every served prompt. Parameters and the optimizer state stay in float32; the forward runs in
`compute_dtype` (bfloat16 by default: the dtype the pair is served in), norms and the loss in float32. The
parameters with the best held-out loss seen at an evaluation are the ones returned (a small corpus is easy to
overfit, and the evaluations are cheap).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from gemma4_mtp_jax.api import abstract_target_params
from gemma4_mtp_jax.model.config import TextConfig
from gemma4_mtp_jax.model.target import Gemma4Target
from gemma4_mtp_jax.train.trainer import adamw, warmup_cosine
from gemma4_mtp_jax.weights.hf_loader import flatten_shapes, unflatten

Array = jax.Array

# Projections that write into the residual stream: scaled down by sqrt(2 * layers) at initialisation so that the
# stream's scale does not grow with depth.
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "per_layer_projection.weight")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 2e-3
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    seed: int = 0
    compute_dtype: str = "bfloat16"
    eval_every: int = 200
    eval_windows: int = 256  # held-out windows of seq_len tokens per evaluation (fewer if the held-out text is short)


def init_params(cfg: TextConfig, seed: int) -> dict:
    """Fresh float32 parameters: matrices ~ N(0, 1/fan_in) (unit-scale outputs for unit-scale inputs), residual
    output projections further / sqrt(2L); embedding tables ~ N(0, 1/dim) (the model multiplies looked-up rows by
    sqrt(dim), and the tied head then gives unit-scale logits); norm weights and layer scalars 1."""
    rng = np.random.default_rng(seed)
    out = {}
    depth = math.sqrt(2 * cfg.num_layers)
    for name, leaf in sorted(flatten_shapes(abstract_target_params(cfg, jnp.float32)).items()):
        shape = leaf.shape
        if len(shape) <= 1:
            arr = np.ones(shape)
        elif name.startswith("embed_tokens_per_layer"):
            arr = rng.standard_normal(shape) / math.sqrt(cfg.hidden_size_per_layer_input)
        elif name.startswith("embed_tokens"):
            arr = rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            arr = rng.standard_normal(shape) / math.sqrt(shape[-1])  # [out, in]
            if name.endswith(_RESIDUAL_OUTPUTS):
                arr /= depth
        out[name] = jnp.asarray(arr, jnp.float32)
    return unflatten(out)


def count_params(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def windows(stream: np.ndarray, batch_size: int, length: int, seed: int, step: int) -> np.ndarray:
    """[batch_size, length] windows of the stream at offsets drawn from (seed, step)."""
    rng = np.random.default_rng([seed, 3, step])
    starts = rng.integers(0, len(stream) - length + 1, batch_size)
    return stream[starts[:, None] + np.arange(length)[None, :]]


def heldout_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """Consecutive non-overlapping windows from the start of the held-out stream (the same at every evaluation)."""
    n = min(count, len(stream) // length)
    if n < 1:
        raise ValueError(f"held-out text: {len(stream)} tokens, fewer than one window of {length}")
    return stream[: n * length].reshape(n, length)


class Pretrainer:
    """The compiled train and evaluation steps for one (config, training config)."""

    def __init__(self, cfg: TextConfig, tc: PretrainConfig):
        self.cfg, self.tc = cfg, tc
        self.dtype = jnp.dtype(tc.compute_dtype)
        self.model = Gemma4Target(cfg, self.dtype)
        self.schedule = warmup_cosine(tc.steps, tc.lr, tc.warmup_steps, tc.min_lr_ratio)
        self.optimizer = adamw(self.schedule, tc.b1, tc.b2, tc.weight_decay, tc.clip_norm)
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1))
        self.eval_step = jax.jit(self._nll)

    def _nll(self, params: dict, tokens: Array) -> tuple[Array, Array]:
        """(summed next-token negative log-likelihood, token count) of windows [B, T+1]."""
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        p = jax.tree_util.tree_map(lambda x: x.astype(self.dtype), params)
        logits, _, _ = self.model.apply({"params": p}, inputs, positions)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        return nll.sum(), jnp.asarray(nll.size, jnp.float32)

    def _train_step(self, params: dict, opt_state, tokens: Array, step: Array):
        def loss_fn(p):
            total, n = self._nll(p, tokens)
            return total / n

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(step)}

    def heldout_loss(self, params: dict, heldout: np.ndarray, batch_size: int) -> float:
        total = count = 0.0
        for s in range(0, len(heldout), batch_size):
            t, n = self.eval_step(params, jnp.asarray(heldout[s:s + batch_size]))
            total, count = total + float(t), count + float(n)
        return total / count


def pretrain(cfg: TextConfig, train_stream: np.ndarray, heldout_stream: np.ndarray, tc: PretrainConfig,
             log: Callable[[dict], None] = lambda rec: None) -> tuple[dict, dict]:
    """(the best parameters by held-out loss, a summary) after tc.steps steps from a fresh initialisation."""
    if len(train_stream) <= tc.seq_len + 1:
        raise ValueError(f"training text: {len(train_stream)} tokens, not more than one window of {tc.seq_len + 1}")
    if int(train_stream.max()) >= cfg.vocab_size:
        raise ValueError(f"training text: token id {int(train_stream.max())} >= vocab_size {cfg.vocab_size}")
    pt = Pretrainer(cfg, tc)
    params = init_params(cfg, tc.seed)
    opt_state = pt.optimizer.init(params)
    held = heldout_windows(heldout_stream, tc.seq_len + 1, tc.eval_windows)
    best = (float("inf"), None, -1)
    history = []
    t0, tokens_seen = time.perf_counter(), 0
    bar = tqdm(range(tc.steps), desc="pretraining the target", unit="step")

    def evaluate(step: int) -> None:
        nonlocal best
        loss = pt.heldout_loss(params, held, tc.batch_size)
        rec = {"step": step, "heldout_loss": loss, "heldout_ppl": math.exp(loss)}
        history.append(rec)
        log(rec)
        if loss < best[0]:
            best = (loss, jax.tree_util.tree_map(np.asarray, params), step)

    for step in bar:
        batch = jnp.asarray(windows(train_stream, tc.batch_size, tc.seq_len + 1, tc.seed, step))
        params, opt_state, m = pt.train_step(params, opt_state, batch, jnp.asarray(step, jnp.int32))
        tokens_seen += tc.batch_size * tc.seq_len
        if step % 20 == 0 or step == tc.steps - 1:
            m = jax.device_get(m)
            rate = tokens_seen / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{float(m['loss']):.3f}", tok_s=f"{rate:,.0f}")
            log({"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                 "tokens_per_s": rate})
        if (step + 1) % tc.eval_every == 0 or step == tc.steps - 1:
            evaluate(step + 1)
    bar.close()
    loss, best_params, best_step = best
    summary = {"params": count_params(best_params), "steps": tc.steps, "best_step": best_step,
               "heldout_loss": loss, "heldout_ppl": math.exp(loss), "heldout_tokens": int(held.size - len(held)),
               "train_tokens_seen": tokens_seen, "train_stream_tokens": int(len(train_stream)),
               "seconds": time.perf_counter() - t0, "history": history}
    return best_params, summary
