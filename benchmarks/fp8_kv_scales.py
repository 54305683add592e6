"""How much attention error an fp8 (e4m3fn) KV cache's scales cost, against a finer scale. Numbers, not timings:
CPU, about a minute.

    python benchmarks/fp8_kv_scales.py [--keys 1024] [--queries 32] [--seeds 5]

The cache keeps one static power-of-two scale per owning layer for K and one for V, from a bound that holds for
every input (kv_state.kv_cache_scales: |v_i| <= sqrt(D), |k_i| <= max|k_norm| sqrt(D)). The alternative measured
here is the usual finer one: a scale per (page of 16 tokens, KV head) from the page's own amax (amax / 448). Within
e4m3's normal range the relative rounding error does not depend on the scale, so the finer scale can only gain on
values the static one leaves subnormal (below 2^-6 of the scale), or lose to its own rounding of amax / 448.

K and V are made the way Gemma 4 makes them: a random projection (channels of unequal spread, some outlier
channels, or all alike) RMS-normed per head; K times a k_norm weight drawn around 1 and RoPE'd, V without a weight.
Queries are normed and roped the same way and scaled so that the scores spread with the given standard deviation
(Gemma 4 attends with scale 1.0; its q_norm / k_norm weights set the scores' spread). For each head dim (256: the
sliding layers, 512: the full layers) and kind of channels, printed: the share of K / V values stored subnormal,
and the attention output's error (||o - o_exact|| / ||o_exact||, mean and max over queries) and the attention
weights' KL(exact || fp8), for the static scale, the per-page amax scale, and no scale at all (1.0), each the mean
over `--seeds` draws of the inputs, and the ratio of the per-page scale's mean error to the static one's (mean and
range over the draws: the draws' own spread is the noise a difference must beat). Writes
fp8_kv_scales.json (under $OUT when set) when $OUT is set. The figures and the decision: docs/decisions/0016-fp8-kv-cache.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import write_json  # noqa: E402
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm, rope_tables, rope_with_tables, to_cache  # noqa: E402

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)
PAGE = 16
EPS = 1e-6


def pow2_scale(bound: float) -> float:
    return 2.0 ** math.ceil(math.log2(bound / FP8_MAX))


def channels(rng, n: int, D: int, kind: str) -> np.ndarray:
    """n raw projections [n, D]: channels all alike ("alike"), of log-normal spread ("spread"), or of log-normal
    spread with 4 channels 8x the rest ("outliers"); every token its own overall size."""
    sigma = np.ones(D)
    if kind != "alike":
        sigma = np.exp(rng.normal(0, 0.7, D))
    if kind == "outliers":
        sigma[rng.choice(D, 4, replace=False)] *= 8
    return rng.normal(size=(n, D)) * sigma * np.exp(rng.normal(0, 0.5, (n, 1)))


def roped(x: np.ndarray, positions: np.ndarray, D: int) -> np.ndarray:
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    cos, sin = rope_tables(jnp.asarray(positions), jnp.asarray(inv_freq, jnp.float32), jnp.float32)
    return np.asarray(rope_with_tables(jnp.asarray(x, jnp.float32)[:, None, :], cos, sin))[:, 0]


def inputs(rng, S: int, Q: int, D: int, kind: str, score_std: float):
    """(q [Q, D], k [S, D], v [S, D], the k_norm weight [D]) in float32."""
    k_norm = np.exp(rng.normal(0, 0.4, D)) * rng.choice([-1, 1], D, p=[0.05, 0.95])
    k = np.asarray(rms_norm(jnp.asarray(channels(rng, S, D, kind), jnp.float32), EPS, jnp.asarray(k_norm)))
    k = roped(k, np.arange(S), D)
    v = np.asarray(rms_norm(jnp.asarray(channels(rng, S, D, kind), jnp.float32), EPS))
    q = np.asarray(rms_norm(jnp.asarray(channels(rng, Q, D, kind), jnp.float32), EPS))
    q = roped(q, np.full(Q, S), D)
    q = q * (score_std / (q @ k.T).std())
    return q, k, v, k_norm


def quantized(x: np.ndarray, how: str, bound: float) -> tuple[np.ndarray, float]:
    """(x as an fp8 cache stores and reads it back, the share of its values stored subnormal)."""
    if how == "static":
        scale = np.full((x.shape[0], 1), pow2_scale(bound))
    elif how == "page_amax":
        amax = np.abs(x.reshape(-1, PAGE, x.shape[1])).max(axis=(1, 2))
        scale = np.repeat(np.maximum(amax, 1e-30) / FP8_MAX, PAGE)[:, None]
    else:
        scale = np.ones((x.shape[0], 1))
    stored = np.asarray(to_cache(jnp.asarray(x / scale, jnp.float32), 1.0, FP8), np.float32)
    subnormal = float(np.mean((stored != 0) & (np.abs(stored) < 2.0**-6)))
    return stored.astype(np.float64) * scale, subnormal


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = q.astype(np.float64) @ k.T
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v, p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    jax.config.update("jax_platforms", "cpu")
    rows = []
    print(f"{args.keys} keys in pages of {PAGE}, {args.queries} queries, means over {args.seeds} draws; output "
          f"error = ||o - o_exact|| / ||o_exact||; KL of the attention weights, nats")
    print(f"{'D':>4} {'channels':>8} {'scores':>6} {'scale':>9} {'K sub %':>7} {'V sub %':>7} "
          f"{'err mean':>9} {'err max':>9} {'KL mean':>9}   page_amax / static error")
    for D in (256, 512):
        for kind in ("alike", "spread", "outliers"):
            for score_std in (1.0, 4.0):
                runs = {how: [] for how in ("static", "page_amax", "none")}
                for seed in range(args.seeds):
                    rng = np.random.default_rng([seed, D, len(kind), int(score_std)])
                    q, k, v, k_norm = inputs(rng, args.keys, args.queries, D, kind, score_std)
                    o_exact, p_exact = attention(q, k, v)
                    bounds = {"k": float(np.abs(k_norm).max()) * math.sqrt(D), "v": math.sqrt(D)}
                    assert np.abs(k).max() <= bounds["k"] * 1.001 and np.abs(v).max() <= bounds["v"] * 1.001
                    for how, got in runs.items():
                        kq, k_sub = quantized(k, how, bounds["k"])
                        vq, v_sub = quantized(v, how, bounds["v"])
                        o, p = attention(q, kq, vq)
                        err = np.linalg.norm(o - o_exact, axis=-1) / np.linalg.norm(o_exact, axis=-1)
                        kl = np.sum(p_exact * (np.log(p_exact + 1e-300) - np.log(p + 1e-300)), -1)
                        got.append((k_sub, v_sub, err.mean(), err.max(), kl.mean()))
                ratio = np.array([a[2] / b[2] for a, b in zip(runs["page_amax"], runs["static"])])
                for how, got in runs.items():
                    k_sub, v_sub, err_mean, err_max, kl_mean = np.mean(got, axis=0)
                    row = dict(D=D, channels=kind, score_std=score_std, scale=how, k_subnormal=k_sub,
                               v_subnormal=v_sub, err_mean=err_mean, err_max=err_max, kl_mean=kl_mean,
                               amax_over_static=ratio.tolist())
                    rows.append(row)
                    tail = (f"   {ratio.mean():.3f} ({ratio.min():.3f}-{ratio.max():.3f})" if how == "page_amax"
                            else "")
                    print(f"{D:>4} {kind:>8} {score_std:>6.1f} {how:>9} {100 * k_sub:>7.3f} {100 * v_sub:>7.3f} "
                          f"{err_mean:>9.5f} {err_max:>9.5f} {kl_mean:>9.2e}{tail}")
    write_json("fp8_kv_scales.json", rows)


if __name__ == "__main__":
    main()
