"""Prometheus metrics of the server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "gemma4"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        p = PREFIX
        self.requests = Counter(f"{p}_requests", "HTTP requests answered, by endpoint (completions, "
                                "chat.completions, models, health, metrics; other: any other path, or a request "
                                "refused before its path was read) and status code (499: the client left before "
                                "its answer)", ["endpoint", "status"], registry=r)
        self.finished = Counter(f"{p}_request_finished", "Generations ended, by finish reason (stop, length, "
                                "cancelled: client went away, abort: server shutdown, error)", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated for clients", registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Time per output token after the first (a step "
                             "that yields k tokens counts k observations of gap/k)", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "From request arrival to its last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.waiting = Gauge(f"{p}_num_requests_waiting", "Requests queued, not yet running (queue depth)",
                             registry=r)
        self.running = Gauge(f"{p}_num_requests_running", "Requests running in the engine", registry=r)
        self.kv_pages_in_use = Gauge(f"{p}_kv_pages_in_use", "KV cache pages in use, by KV group", ["group"],
                                     registry=r)
        self.kv_pages_total = Gauge(f"{p}_kv_pages_total", "KV cache pages in the pool, by KV group", ["group"],
                                    registry=r)
        self.kv_cache_bytes = Gauge(f"{p}_kv_cache_bytes", "Device memory of the KV cache pools", registry=r)
        self.preemptions = Counter(f"{p}_num_preemptions", "Running sequences preempted to free KV pages (they "
                                   "resume later by recomputing their K/V)", registry=r)
        self.prefix_cache_queries = Counter(f"{p}_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache at admission", registry=r)
        self.prefix_cache_hits = Counter(f"{p}_prefix_cache_hits", "Prompt tokens whose K/V the prefix cache "
                                         "held (hit rate: hits / queries)", registry=r)
        self.draft_tokens = Counter(f"{p}_spec_decode_draft_tokens", "Draft tokens proposed by the assistant",
                                    registry=r)
        self.accepted_tokens = Counter(f"{p}_spec_decode_accepted_tokens", "Draft tokens accepted by the target",
                                       registry=r)
        self.accepted_per_position = Counter(f"{p}_spec_decode_accepted_tokens_per_position", "Draft tokens "
                                             "accepted, by draft position (0 = first draft of a round)",
                                             ["position"], registry=r)
        self.drafted_per_position = Counter(f"{p}_spec_decode_draft_tokens_per_position", "Draft tokens "
                                            "proposed, by draft position (acceptance rate at a position: accepted "
                                            "/ proposed there)", ["position"], registry=r)
        self.drafted_by_output_position = Counter(f"{p}_spec_decode_draft_tokens_by_output_position", "Draft "
                                                  "tokens proposed, by where in its output the round began",
                                                  ["output_position"], registry=r)
        self.accepted_by_output_position = Counter(f"{p}_spec_decode_accepted_tokens_by_output_position", "Draft "
                                                   "tokens accepted, by where in its output the round began (does "
                                                   "acceptance decay over long outputs?)", ["output_position"],
                                                   registry=r)
        self.request_acceptance_length = Histogram(f"{p}_spec_decode_request_acceptance_length", "Each finished "
                                                   "request's mean acceptance length (tokens per speculative round: "
                                                   "drafts accepted + 1)",
                                                   buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 5.0,
                                                            6.0, 8.0, 17.0), registry=r)
        self.speculative_steps = Counter(f"{p}_spec_decode_steps", "Speculative steps, by the drafts per round "
                                         "the engine chose for the step (0: the newest token verified alone)",
                                         ["drafts"], registry=r)
        self.acceptance_estimate = Gauge(f"{p}_spec_decode_acceptance_estimate", "The engine's running estimate "
                                         "of the chance a draft is accepted once the drafts before it were, by "
                                         "draft position (what --speculative-k auto chooses from)", ["position"],
                                         registry=r)
        self.accepted_per_round = Histogram(f"{p}_spec_decode_accepted_tokens_per_round", "Draft tokens accepted "
                                            "in one speculative round of one sequence",
                                            buckets=tuple(float(i) for i in range(17)), registry=r)
        self.tool_call_requests = Counter(f"{p}_tool_call_requests", "Chat requests whose output is parsed for "
                                          "tool calls (tools given, tool_choice auto)", registry=r)
        self.tool_call_responses = Counter(f"{p}_tool_call_responses", "Chat choices answered with tool calls",
                                           registry=r)
        self.structured_requests = Counter(f"{p}_structured_output_requests", "Requests whose output a grammar "
                                           "constrains (response_format, structured_outputs, a forced tool_choice)",
                                           registry=r)
        self.engine_steps = Counter(f"{p}_engine_steps", "Engine steps run", registry=r)
        self.engine_errors = Counter(f"{p}_engine_errors", "Engine steps that raised (their requests failed)",
                                     registry=r)
        self.spec_tokens = Gauge(f"{p}_num_speculative_tokens", "Draft tokens per round, the most with "
                                 "--speculative-k auto (0: no speculative decoding)", registry=r)
        info = Gauge(f"{p}_model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
