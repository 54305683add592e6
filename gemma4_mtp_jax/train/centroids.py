"""Fitting the centroid head of an E2B/E4B-style assistant to a trained dense head.

The centroid head (model/assistant.py `CentroidHead`) scores C clusters of exactly V/C tokens each and computes
logits only for the tokens of the top-K clusters. After training with the dense head, the clusters come from a
balanced k-means over the head rows (every cluster exactly V/C rows). Each centroid starts as the mean of its
rows (a cluster's score hn . c is then its tokens' mean logit) and is then fitted on draft hiddens of training
data to score highest the cluster holding the dense head's top token (`refine_centroids`). `token_ordering` lists
cluster 0's tokens, then cluster 1's, ... (the layout transformers and the loader expect).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from gemma4_mtp_jax.kernels.centroid_head import select_centroids

_CHUNK = 16384  # rows per distance computation: [16384, C] float32 at a time


@jax.jit
def _nearest_open(rows: jax.Array, centroids: jax.Array, open_: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each row, the nearest cluster with room left and its squared distance (up to the row's own norm)."""
    d = jnp.sum(centroids * centroids, -1)[None, :] - 2.0 * rows @ centroids.T
    d = jnp.where(open_[None, :], d, jnp.inf)
    best = jnp.argmin(d, -1)
    return best.astype(jnp.int32), jnp.take_along_axis(d, best[:, None], -1)[:, 0]


def _nearest(rows: np.ndarray, centroids: np.ndarray, open_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    best, dist = [], []
    c, o = jnp.asarray(centroids), jnp.asarray(open_)
    for s in range(0, rows.shape[0], _CHUNK):
        chunk = rows[s:s + _CHUNK]
        n = chunk.shape[0]
        size = min(_CHUNK, 1 << (n - 1).bit_length())  # power-of-two shapes: a handful of compilations
        b, d = _nearest_open(jnp.asarray(np.pad(chunk, ((0, size - n), (0, 0)))), c, o)
        best.append(np.asarray(b)[:n])
        dist.append(np.asarray(d)[:n])
    return np.concatenate(best), np.concatenate(dist)


def balanced_assign(rows: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Assign every row to a cluster so that each of the C clusters gets exactly V/C rows.

    Rounds of proposals: every unassigned row proposes to its nearest cluster that still has room; a cluster
    takes its closest proposers up to its remaining room. Every round fills at least one slot, and total room
    always equals the rows left, so it ends with every cluster exactly full."""
    V, C = rows.shape[0], centroids.shape[0]
    if V % C:
        raise ValueError(f"{V} rows cannot be split into {C} clusters of equal size")
    room = np.full(C, V // C, np.int64)
    assign = np.full(V, -1, np.int64)
    left = np.arange(V)
    while left.size:
        choice, dist = _nearest(rows[left], centroids, room > 0)
        order = np.lexsort((dist, choice))  # by cluster, closest first
        sorted_choice = choice[order]
        first = np.searchsorted(sorted_choice, sorted_choice, side="left")
        rank = np.arange(order.size) - first  # place in its cluster's queue
        taken = order[rank < room[sorted_choice]]
        assign[left[taken]] = choice[taken]
        room -= np.bincount(choice[taken], minlength=C)
        left = left[assign[left] < 0]
    return assign


def cluster_means(rows: np.ndarray, assign: np.ndarray, C: int) -> np.ndarray:
    sums = np.zeros((C, rows.shape[1]), np.float64)
    np.add.at(sums, assign, rows)
    return (sums / np.bincount(assign, minlength=C)[:, None]).astype(np.float32)


def balanced_kmeans(rows: np.ndarray, num_clusters: int, iters: int, seed: int,
                    init_assign: np.ndarray | None = None, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Balanced k-means (squared Euclidean) of rows [V, d] into num_clusters clusters of exactly V/C rows.

    Starts from `init_assign` (e.g. an initial assistant's clusters) or from C distinct random rows; stops early
    when an iteration changes no assignment. Returns (assign [V] cluster of each row, centroids [C, d] = means)."""
    rows = np.asarray(rows, np.float32)
    V, C = rows.shape[0], num_clusters
    if V % C:
        raise ValueError(f"vocabulary {V} is not divisible by num_centroids {C}")
    if init_assign is not None:
        centroids = cluster_means(rows, init_assign, C)
    else:
        centroids = rows[np.random.default_rng(seed).choice(V, C, replace=False)]
    assign = None
    for _ in tqdm(range(max(1, iters)), desc="centroids (balanced k-means)", leave=False, disable=not progress):
        new = balanced_assign(rows, centroids)
        centroids = cluster_means(rows, new, C)
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
    return assign, centroids


def token_ordering(assign: np.ndarray, num_clusters: int) -> np.ndarray:
    """The permutation listing cluster 0's token ids, then cluster 1's, ... (ascending ids within a cluster)."""
    V = assign.shape[0]
    order = np.argsort(assign, kind="stable")
    if not np.array_equal(np.bincount(assign, minlength=num_clusters), np.full(num_clusters, V // num_clusters)):
        raise ValueError("clusters are not all of size V/C")
    return order.astype(np.int64)


def fit_centroid_head(head: np.ndarray, num_clusters: int, iters: int, seed: int,
                      init_ordering: np.ndarray | None = None, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(centroids [C, Ha], token_ordering [V]) for the dense head [V, Ha] (canonical order). `init_ordering`: an
    existing token_ordering to start the k-means from."""
    V = head.shape[0]
    init = None
    if init_ordering is not None:
        init = np.empty(V, np.int64)
        init[np.asarray(init_ordering)] = np.arange(V) // (V // num_clusters)
    assign, centroids = balanced_kmeans(head, num_clusters, iters, seed, init, progress)
    return centroids, token_ordering(assign, num_clusters)


def coverage_hits(hn: jax.Array, top_token: jax.Array, centroids: jax.Array, cluster_of: jax.Array,
                  top_k: int) -> jax.Array:
    """[...] bool: whether the dense head's top token falls inside the top_k clusters the centroid head selects
    for hn [..., Ha] (the served selection, `select_centroids`). cluster_of [V]: each token's cluster."""
    lead = hn.shape[:-1]
    top = select_centroids(hn.reshape(-1, hn.shape[-1]), centroids, top_k)  # [T, K]
    want = jnp.take(cluster_of, top_token.reshape(-1))
    return jnp.any(top == want[:, None], -1).reshape(lead)


def cluster_of_tokens(ordering: np.ndarray, num_clusters: int) -> np.ndarray:
    """[V] int32: each token's cluster under token_ordering."""
    out = np.empty(ordering.size, np.int32)
    out[np.asarray(ordering)] = np.arange(ordering.size) // (ordering.size // num_clusters)
    return out


def refine_centroids(centroids: np.ndarray, cluster_of: np.ndarray, hn: np.ndarray, top_token: np.ndarray,
                     head: np.ndarray, steps: int, seed: int, lr: float = 1e-2, batch: int = 8192) -> np.ndarray:
    """Centroids that rank the cluster of the dense head's top token first: softmax cross-entropy over the
    clusters' scores hn . c, Adam from the k-means means; the clusters themselves (token_ordering) stay.

    Examples: draft hiddens hn [M, Ha] of training data with their dense top tokens [M], plus the head row of
    every token the training data never made top (rescaled to the hiddens' median norm), labelled with that
    token: such tokens still pull their cluster's centroid towards their row.

    The means alone score a cluster by its tokens' mean logit, which can rank a cluster holding the top token
    below clusters of uniformly mediocre tokens; fitting the scores to the selection they make fixes that."""
    if steps <= 0 or hn.shape[0] == 0:
        return centroids
    unseen = np.setdiff1d(np.arange(head.shape[0]), top_token)
    rows = np.asarray(head, np.float32)[unseen]
    scale = np.median(np.linalg.norm(hn, axis=-1)) / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)
    x = jnp.asarray(np.concatenate([np.asarray(hn, np.float32), rows * scale]))
    y = jnp.asarray(np.asarray(cluster_of)[np.concatenate([np.asarray(top_token), unseen])], jnp.int32)
    opt = optax.adam(lr)

    @jax.jit
    def update(c, state, key):
        idx = jax.random.randint(key, (min(batch, x.shape[0]),), 0, x.shape[0])

        def loss(c):
            return optax.softmax_cross_entropy_with_integer_labels(x[idx] @ c.T, y[idx]).mean()

        updates, state = opt.update(jax.grad(loss)(c), state)
        return optax.apply_updates(c, updates), state

    c = jnp.asarray(centroids, jnp.float32)
    state = opt.init(c)
    key = jax.random.PRNGKey(seed)
    for i in tqdm(range(steps), desc="centroids (fit to draft hiddens)", leave=False):
        c, state = update(c, state, jax.random.fold_in(key, i))
    return np.asarray(c, np.float32)
