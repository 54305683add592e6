"""A request as the engine keeps it: what was asked, what it produced, where it stands, its timings and its
speculative rounds; and the event a step reports for it."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import numpy as np

from gemma4_mtp_jax.engine.media import PromptMedia
from gemma4_mtp_jax.engine.speculation import PositionAcceptance, output_position_bucket
from gemma4_mtp_jax.steps.device_state import MAX_STOP_IDS
from gemma4_mtp_jax.model.sampling import SamplingParams


class RequestError(ValueError):
    """A request that can never be served as asked (bad ids, too long, larger than the whole KV pool)."""


@dataclasses.dataclass(eq=False)  # a request is itself, whatever its fields: compared and hashed by identity
class Request:
    """Its pages and slot are the KV cache manager's (kv_cache.py), not the request's."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    speculative: bool = True  # draft with the assistant (when the engine has one)
    # The tokens it may emit as a bitmask [ceil(V/32)] int32 (SamplingParams.allowed_mask), which its prefill
    # writes into its slot; built once by the engine.
    allowed_row: np.ndarray | None = None
    # n > 1: a sibling admitted only once this request's prompt is prefilled, so that it finds the prompt's full
    # pages in the prefix cache instead of computing them again.
    after: "Request | None" = None
    # Structured output: the request's grammar matcher (engine/grammar.py's GrammarMatcher), advanced by each
    # token it outputs; its mask restricts every sampled token.
    grammar: Any = None
    # Images / audio: the soft tokens at its prompt's placeholders (engine/media.PromptMedia), kept for a prefill
    # after preemption; None for a text prompt.
    media: PromptMedia | None = None
    # With sampling.logprobs: each output token's logprob and top alternatives, as `output` grows.
    logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)
    # With sampling.prompt_logprobs: those of its prompt's tokens from the second on (filled by its prefill).
    prompt_logprobs: list["TokenLogprob"] = dataclasses.field(default_factory=list)
    output: list[int] = dataclasses.field(default_factory=list)
    status: str = "waiting"  # waiting -> running -> finished
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # finish_reason "error": what went wrong (for logs; clients get a generic message)
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    # Speculative decoding, one entry per round the request speculated in: the drafts it proposed (the engine may
    # choose the round's size per step), those accepted, and how long the output was when it began; the other
    # counts derive from these (`record_round`).
    drafts_per_round: list[int] = dataclasses.field(default_factory=list)
    accepted_per_round: list[int] = dataclasses.field(default_factory=list)
    round_starts: list[int] = dataclasses.field(default_factory=list)
    # Its rounds by draft position, what the engine's choice of round size reads as this request's acceptance.
    position_acceptance: PositionAcceptance = dataclasses.field(default_factory=lambda: PositionAcceptance.zeros(0))
    num_preemptions: int = 0
    prefilled: int = 0  # K/V positions written (or found in the prefix cache) since (re)admission
    decoding: bool = False  # prefill complete: the sequence is in the decode batch
    # The slot's device values (newest token, length, remaining) are this sequence's: a step has run it since it
    # started decoding. Until then its rows bring them from the host.
    on_device: bool = False

    @property
    def processed(self) -> bool:
        """Whether its steps need the processed programs (sampling.SamplingParams.processed, or a grammar)."""
        return self.sampling.processed or self.grammar is not None

    def speculates(self, masked_rounds: bool) -> bool:
        """Whether its rows draft: it asked to, and a grammar it has masks every verified position (`masked_rounds`:
        the engine verifies grammar batches under their masks; otherwise only the first position's is known)."""
        return self.speculative and (self.grammar is None or masked_rounds)

    def record_round(self, drafted: int, accepted: int) -> None:
        """One speculative round of `drafted` drafts, `accepted` of them accepted, before its tokens are taken."""
        if len(self.position_acceptance.reached) < drafted:  # grown to the largest round so far
            self.position_acceptance = PositionAcceptance.zeros(drafted)
            for k, n in zip(self.drafts_per_round, self.accepted_per_round):
                self.position_acceptance.record(k, n)
        self.position_acceptance.record(drafted, accepted)
        self.drafts_per_round.append(drafted)
        self.accepted_per_round.append(accepted)
        self.round_starts.append(len(self.output))

    @property
    def num_drafted(self) -> int:
        return sum(self.drafts_per_round)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def accepted_per_position(self) -> list[int]:
        """Rounds that accepted at least j+1 drafts, for each draft position j."""
        k = max(self.drafts_per_round, default=0)
        return [sum(n > j for n in self.accepted_per_round) for j in range(k)]

    @property
    def drafted_per_position(self) -> list[int]:
        """Rounds that drafted at least j+1 tokens, for each draft position j."""
        k = max(self.drafts_per_round, default=0)
        return [sum(d > j for d in self.drafts_per_round) for j in range(k)]

    def acceptance_by_output_position(self) -> dict[str, dict[str, float]]:
        """Its rounds grouped by where in the output they began (speculation.OUTPUT_POSITION_BUCKETS): rounds,
        drafted, accepted, and mean acceptance length (tokens a round emitted) per group."""
        groups: dict[str, list[int]] = {}
        for start, d, n in zip(self.round_starts, self.drafts_per_round, self.accepted_per_round):
            g = groups.setdefault(output_position_bucket(start), [0, 0, 0])
            g[0], g[1], g[2] = g[0] + 1, g[1] + d, g[2] + n
        return {label: {"rounds": r, "drafted": d, "accepted": n, "mean_acceptance_length": (n + r) / r}
                for label, (r, d, n) in groups.items()}

    @functools.cached_property
    def stop_row(self) -> np.ndarray:
        """`stop_ids` as a step's row: [MAX_STOP_IDS] int32, -1 padded (built once, read every step)."""
        row = np.full((MAX_STOP_IDS,), -1, np.int32)
        row[: len(self.stop_ids)] = sorted(self.stop_ids)
        return row

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far: K/V is committed for all but the newest."""
        return len(self.prompt) + len(self.output)

    @property
    def prefill_len(self) -> int:
        """Tokens a (re)admitted request's prefill runs: its prompt, and a resumed one's output but the newest."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def committed(self) -> int:
        """Positions whose K/V is final: every token but the newest once decoding, else those prefilled."""
        return self.num_tokens - 1 if self.decoding else self.prefilled

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def stats(self) -> dict[str, Any]:
        end = self.finished_at or time.perf_counter()
        gaps = np.diff(self.token_times) if len(self.token_times) > 1 else np.array([])
        return {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": len(self.output),
            "finish_reason": self.finish_reason,
            "ttft_s": None if self.first_token_at is None else self.first_token_at - self.arrival,
            "latency_s": end - self.arrival,
            "mean_inter_token_s": float(gaps.mean()) if gaps.size else None,
            "preemptions": self.num_preemptions,
            **({} if not self.accepted_per_round else {
                "drafted": self.num_drafted,
                "accepted": self.num_accepted,
                "rounds": len(self.accepted_per_round),
                "mean_acceptance_length":
                    (self.num_accepted + len(self.accepted_per_round)) / len(self.accepted_per_round),
                "drafted_per_position": self.drafted_per_position,
                "accepted_per_position": self.accepted_per_position,
                "acceptance_per_position": [a / d for a, d in zip(self.accepted_per_position,
                                                                  self.drafted_per_position)],
                "acceptance_by_output_position": self.acceptance_by_output_position(),
                "drafts_per_round": list(self.drafts_per_round),
                "accepted_per_round": list(self.accepted_per_round),
            }),
        }


@dataclasses.dataclass
class TokenLogprob:
    """An output token's log-probability under the target's processed distribution at its position
    (sampling.token_logprobs), and the `logprobs` most likely tokens there, best first."""

    logprob: float
    top: list[tuple[int, float]]

    @staticmethod
    def rows(chosen: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray, count: int, n: int) -> list["TokenLogprob"]:
        """The first `n` positions of a program's logprob columns (device_state.unpack_logprobs), with `count`
        alternatives each."""
        return [TokenLogprob(float(chosen[j]), [(int(t), float(v)) for t, v in zip(top_ids[j, :count],
                                                                                 top_lp[j, :count])])
                for j in range(n)]


@dataclasses.dataclass
class StepEvent:
    request: Request
    new_tokens: list[int]
    finished: bool
    accepted: int | None = None  # drafts accepted in this step's speculative round (None: no round)
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for logprobs
    drafted: int = 0  # drafts that round proposed
