"""The choice of each step's drafts per round (engine/speculation.py), on made-up costs and acceptance: no model."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_mtp_jax.engine.speculation import (PositionAcceptance, SpeculationPolicy, output_position_bucket,
                                               round_sizes)


def test_round_sizes_and_output_position_buckets():
    assert round_sizes(4) == (0, 1, 2, 4)
    assert round_sizes(1) == (0, 1)
    assert round_sizes(6) == (0, 1, 2, 4, 6)
    assert [output_position_bucket(p) for p in (0, 127, 128, 511, 512, 2047, 2048, 10**6)] == [
        "0-127", "0-127", "128-511", "128-511", "512-2047", "512-2047", "2048+", "2048+"]


def test_position_counts():
    """A round reaches the positions up to its first rejection (and no further than it drafted); the estimate of a
    position with no round is the prior."""
    counts = PositionAcceptance.zeros(4)
    for drafted, accepted in ((4, 2), (2, 2), (4, 0), (1, 1)):
        counts.record(drafted, accepted)
    assert counts.reached.tolist() == [4, 2, 1, 0] and counts.accepted.tolist() == [3, 2, 0, 0]
    prior = np.full(4, 0.5)
    assert counts.rates(prior, 0.0)[:3].tolist() == [0.75, 1.0, 0.0]
    assert counts.rates(prior, 2.0).tolist() == pytest.approx([4 / 6, 3 / 4, 1 / 3, 0.5])
    assert PositionAcceptance.zeros(0).rates(prior, 2.0).tolist() == [0.5] * 4  # a request with no round yet


def _policy(costs: dict[int, float], batch: int = 8) -> SpeculationPolicy:
    policy = SpeculationPolicy(4, adaptive=True)
    policy.costs = {(batch, k): c for k, c in costs.items()}
    return policy


def _rows(n: int, rate: float, rounds: int = 50) -> list[PositionAcceptance]:
    """n rows whose every draft position was accepted at `rate` over `rounds` rounds."""
    out = []
    for _ in range(n):
        counts = PositionAcceptance.zeros(4)
        counts.reached[:] = rounds
        counts.accepted[:] = rate * rounds
        out.append(counts)
    return out


# A step's cost by round size: verifying more positions costs more (E2B-like ratios).
COSTS = {0: 1.0, 1: 1.1, 2: 1.2, 4: 1.5}


def test_the_round_size_maximises_tokens_per_second():
    sizes = (0, 1, 2, 4)
    # Drafts always accepted: 5 tokens for 1.5 is the best.
    assert _policy(COSTS).choose(8, _rows(8, 1.0), sizes) == 4
    # Accepted at 0.5: E = 1.5 / 1.75 / 1.9375 for k = 1 / 2 / 4, per cost 1.36 / 1.46 / 1.29: k = 2.
    assert _policy(COSTS).choose(8, _rows(8, 0.5), sizes) == 2
    # Never accepted: every round size emits 1 token, the cheapest round wins.
    assert _policy(COSTS).choose(8, _rows(8, 0.0), sizes) == 0
    # Rows that do not speculate count 1 token whatever the size: with 6 of 8 off, k = 1 beats k = 2.
    assert _policy(COSTS).choose(8, _rows(2, 0.5) + [None] * 6, sizes) == 1
    assert _policy(COSTS).choose(8, [None] * 8, sizes) == 0
    # Only the sizes compiled (and timed) for the bucket compete.
    assert _policy(COSTS).choose(8, _rows(8, 1.0), (0, 1, 2)) == 2
    policy = _policy({0: 1.0, 2: 1.2})
    assert policy.choose(8, _rows(8, 1.0), sizes) == 2  # 1 and 4 are not timed yet
    # Nothing timed yet for this bucket: the configured k, as a fixed engine.
    assert _policy(COSTS).choose(16, _rows(8, 0.0), sizes) == 4


def test_the_choice_is_the_definition_row_by_row():
    """The policy computes all rows at once; the definition, row by row: a_j = (accepted + s * prior) /
    (reached + s) per row (positions it never counted take the prior), E(k) = 1 + sum_{i<k} prod_{j<=i} a_j, the
    size of the largest sum of E over rows (1 for a row that does not speculate) per cost, ties to the smaller.
    The overall counts likewise: each round's positions reached and accepted, added after the decay."""
    rng = np.random.default_rng(0)
    sizes = (0, 1, 2, 4)
    for trial in range(200):
        policy = _policy({k: 1.0 + c for k, c in zip(sizes, np.sort(rng.uniform(0, 1, 4)))})
        oracle = PositionAcceptance.zeros(4)
        for _ in range(int(rng.integers(0, 4))):
            rounds = [(int(d), int(rng.integers(0, d + 1))) for d in rng.choice(sizes, int(rng.integers(1, 9)))]
            policy.record_step(rounds)
            if any(d for d, _ in rounds):
                oracle.reached *= policy.DECAY
                oracle.accepted *= policy.DECAY
                for d, a in rounds:
                    oracle.record(d, a)
        np.testing.assert_allclose(policy.overall.reached, oracle.reached)
        np.testing.assert_allclose(policy.overall.accepted, oracle.accepted)
        rows = []
        for _ in range(int(rng.integers(1, 12))):
            if rng.random() < 0.2:
                rows.append(None)
                continue
            counts = PositionAcceptance.zeros(int(rng.choice([0, 1, 2, 4])))
            for _ in range(int(rng.integers(0, 12))):
                d = int(rng.integers(1, len(counts.reached) + 1)) if len(counts.reached) else 0
                counts.record(d, int(rng.integers(0, d + 1)))
            rows.append(counts)
        prior = policy.overall_rates()

        def per_second(size: int) -> float:
            tokens = 0.0
            for r in rows:
                tokens += 1.0 if r is None else 1.0 + float(np.sum(np.cumprod(r.rates(prior, policy.STRENGTH)[:size])))
            return tokens / policy.costs[8, size]

        if any(r is not None for r in rows):
            expected = max(sizes, key=lambda k: (round(per_second(k), 9), -k))
            assert policy.choose(8, rows, sizes) == expected, trial


def test_a_request_leans_on_the_overall_estimate_until_it_has_rounds():
    """A new request takes the overall estimate; one with rounds of its own weighs them in."""
    policy = _policy(COSTS)
    for _ in range(40):
        policy.record_step([(4, 4)] * 8)  # every draft accepted: the overall estimate nears 1
    assert policy.overall_rates().min() > 0.95
    fresh = PositionAcceptance.zeros(0)
    assert policy.choose(8, [fresh] * 8, (0, 1, 2, 4)) == 4
    assert policy.choose(8, _rows(8, 0.0, rounds=200), (0, 1, 2, 4)) == 0


def test_the_overall_estimate_follows_recent_rounds():
    policy = _policy(COSTS)
    for _ in range(40):
        policy.record_step([(4, 4)] * 8)
    for _ in range(200):
        policy.record_step([(4, 0)] * 8)
    assert policy.overall_rates()[0] < 0.05
    policy.record_step([(0, 0)] * 8)  # rounds without drafts tell nothing: the estimate stays
    assert policy.overall_rates()[0] < 0.05


def test_steps_without_drafts_probe_now_and_then():
    """Where 0 drafts win, every EXPLORE_EVERY-th step drafts the smallest positive round, so that a drafter that
    becomes right again is seen; the counts of steps by size are kept."""
    policy = _policy(COSTS)
    picks = [policy.choose(8, _rows(8, 0.0), (0, 1, 2, 4)) for _ in range(3 * policy.EXPLORE_EVERY)]
    assert picks.count(1) == 3 and set(picks) == {0, 1}
    assert picks.index(1) == policy.EXPLORE_EVERY - 1
    assert policy.chosen == {0: 3 * policy.EXPLORE_EVERY - 3, 1: 3}


def test_a_fixed_policy_always_drafts_k():
    policy = SpeculationPolicy(4, adaptive=False)
    policy.costs = {(8, k): c for k, c in COSTS.items()}
    assert policy.choose(8, _rows(8, 0.0), (4,)) == 4
