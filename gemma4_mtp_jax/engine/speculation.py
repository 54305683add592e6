"""How many drafts each speculative round verifies, chosen per step so that speculation never costs more than it
gives.

A round of k drafts emits the drafts accepted and one token more. With a_j the chance that draft j is accepted
once the drafts before it were (j = 0..k-1), a row expects E(k) = 1 + sum_{i<k} prod_{j<=i} a_j tokens from it. A
step of batch bucket B costs c(B, k) seconds whatever its rows accept, so the best round size is the one that
maximises sum_rows E_row(k) / c(B, k), the step's tokens per second. A round of 0 drafts (the newest token verified
alone, as a decode step does, keeping the drafter's h for a later round) is always a candidate: a drafter that is
never right then costs what a 0-draft round costs over a plain decode step, plus a short round now and then to
notice when it is right again.

a_j is estimated per request from its own rounds, leaning on the estimate over every request's recent rounds
until it has rounds of its own; c(B, k) is each program's measured time (`Engine` times them as they become
compiled). docs/decisions/0021-round-size-per-step.md says why these choices.
"""

from __future__ import annotations

import dataclasses

import numpy as np


# Where in its output a round began, grouped for reports of acceptance versus output position (does it decay over
# long outputs?): [0, 128), [128, 512), [512, 2048), [2048, ...).
OUTPUT_POSITION_BUCKETS = (0, 128, 512, 2048)


def output_position_bucket(position: int) -> str:
    """The OUTPUT_POSITION_BUCKETS group of an output position, as a label ("128-511", "2048+")."""
    edges = OUTPUT_POSITION_BUCKETS
    i = max(j for j, e in enumerate(edges) if position >= e)
    return f"{edges[i]}+" if i == len(edges) - 1 else f"{edges[i]}-{edges[i + 1] - 1}"


def round_sizes(k: int) -> tuple[int, ...]:
    """The round sizes an engine that chooses them per step compiles, for at most k drafts: 0, the powers of two
    below k, and k (k = 4: 0, 1, 2, 4)."""
    return tuple(sorted({0, k} | {1 << i for i in range(max(k, 1).bit_length()) if 1 << i < k}))


@dataclasses.dataclass
class PositionAcceptance:
    """Speculative rounds counted by draft position j: the rounds that reached j (they drafted it, and accepted
    every draft before it) and those that accepted it. Their ratio estimates a_j."""

    reached: np.ndarray  # [k] float64
    accepted: np.ndarray  # [k] float64

    @staticmethod
    def zeros(k: int) -> "PositionAcceptance":
        return PositionAcceptance(np.zeros(k), np.zeros(k))

    def record(self, drafted: int, accepted: int) -> None:
        """A round that drafted `drafted` tokens and accepted the first `accepted` of them."""
        self.reached[:min(accepted + 1, drafted)] += 1
        self.accepted[:accepted] += 1

    def rates(self, prior: np.ndarray, strength: float) -> np.ndarray:
        """a_j for the positions of `prior`, estimated as if `strength` rounds at the `prior` rates came before
        the ones counted (none counted past this count's positions)."""
        n = min(len(prior), len(self.reached))
        reached, accepted = np.zeros(len(prior)), np.zeros(len(prior))
        reached[:n], accepted[:n] = self.reached[:n], self.accepted[:n]
        return estimated_rates(reached, accepted, prior, strength)


def estimated_rates(reached: np.ndarray, accepted: np.ndarray, prior: np.ndarray, strength: float) -> np.ndarray:
    """a_j from counts [..., k] of rounds that reached and accepted each position, as if `strength` rounds at the
    `prior` rates [k] came before them."""
    return (accepted + strength * prior) / (reached + strength)


class SpeculationPolicy:
    """The round size of each speculative step: the engine's k always (`adaptive` False), or the one that maximises
    the step's expected tokens per second among the sizes whose programs are compiled and timed (`costs`)."""

    # The overall estimate's prior before any round is seen: speculation starts on, and the first rounds decide.
    PRIOR = 0.6
    # How many rounds' worth the prior counts for: a request's own estimate leans on the overall one until it has
    # about this many rounds of its own at a position.
    STRENGTH = 4.0
    # The overall counts shrink by this factor at every step that drafts, so they follow the requests running now
    # (half-life ~35 such steps).
    DECAY = 0.98
    # After this many steps in a row of 0-draft rounds, one step drafts the smallest positive round, so that a
    # drafter that becomes right again (other requests, other text) is noticed.
    EXPLORE_EVERY = 32

    def __init__(self, k: int, adaptive: bool):
        self.k, self.adaptive = k, adaptive
        self.overall = PositionAcceptance.zeros(k)
        self.costs: dict[tuple[int, int], float] = {}  # (batch bucket, round size) -> seconds per step
        self.chosen: dict[int, int] = {}  # round size -> steps that took it
        self._without_drafts = 0

    def overall_rates(self) -> np.ndarray:
        return self.overall.rates(np.full(self.k, self.PRIOR), self.STRENGTH)

    def record_step(self, rounds: list[tuple[int, int]]) -> None:
        """A read step's speculative rounds, (drafted, accepted) per row that speculated, into the overall
        estimate."""
        drafted, accepted = np.array([r for r in rounds if r[0] > 0], np.int64).reshape(-1, 2).T
        if not drafted.size:
            return
        self.overall.reached *= self.DECAY
        self.overall.accepted *= self.DECAY
        # PositionAcceptance.record of every round at once: one pass, not one per row (the engine's loop pays it)
        positions = np.arange(self.k)
        self.overall.reached += (np.minimum(accepted + 1, drafted)[:, None] > positions).sum(axis=0)
        self.overall.accepted += (accepted[:, None] > positions).sum(axis=0)

    def choose(self, batch: int, rows: list[PositionAcceptance | None], sizes: tuple[int, ...]) -> int:
        """The round size for a step of `rows` (each speculating row's own counts; None for a row that does not
        speculate) in batch bucket `batch`, among `sizes` (those compiled for it)."""
        size = self._choose(batch, rows, sizes)
        self.chosen[size] = self.chosen.get(size, 0) + 1
        return size

    def _choose(self, batch: int, rows: list[PositionAcceptance | None], sizes: tuple[int, ...]) -> int:
        if not self.adaptive:
            return self.k
        timed = [s for s in sizes if (batch, s) in self.costs]
        if not timed:  # nothing measured yet: the configured k, as a fixed engine runs
            return self.k if self.k in sizes else max(sizes)
        speculating = [r for r in rows if r is not None]
        if not speculating:
            return min(timed)
        # sum over rows of E_row(size) = len(rows) + the rows' expected accepted drafts before position `size`,
        # computed for all rows at once: at 128 rows a loop of small numpy calls costs milliseconds of the engine's
        # step loop, as much as the round sizes it chooses between differ on a small model
        rates = self._rates(speculating)  # [R, k]
        accepted_before = np.concatenate([[0.0], np.cumsum(np.cumprod(rates, axis=1).sum(axis=0))])  # [k + 1]

        def tokens_per_second(size: int) -> float:
            return (len(rows) + accepted_before[size]) / self.costs[batch, size]

        best = max(timed, key=lambda s: (tokens_per_second(s), -s))  # ties: the smaller round
        if best > 0:
            self._without_drafts = 0
            return best
        self._without_drafts += 1
        positive = [s for s in timed if s > 0]
        if positive and self._without_drafts >= self.EXPLORE_EVERY:
            self._without_drafts = 0
            return min(positive)
        return best

    def _rates(self, rows: list[PositionAcceptance]) -> np.ndarray:
        """[len(rows), k]: each row's a_j (PositionAcceptance.rates against the overall estimate), for all at once."""
        k = self.k
        if all(len(r.reached) == k for r in rows):
            reached, accepted = np.stack([r.reached for r in rows]), np.stack([r.accepted for r in rows])
        else:  # rows with fewer positions counted (fresh requests, or only smaller rounds so far)
            reached, accepted = np.zeros((len(rows), k)), np.zeros((len(rows), k))
            for i, r in enumerate(rows):
                n = min(k, len(r.reached))
                reached[i, :n], accepted[i, :n] = r.reached[:n], r.accepted[:n]
        return estimated_rates(reached, accepted, self.overall_rates(), self.STRENGTH)
