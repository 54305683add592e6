"""An engine's settings: its batch and prefill buckets, KV pools, compiling, speculation and devices."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# The K/V cache dtypes by name, besides "auto" ("fp8": e4m3fn, 3 mantissa bits; e5m2 would trade one of them for a
# range the scales make unneeded).
CACHE_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "fp8": "float8_e4m3fn"}


def powers_of_two_upto(n: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


@dataclasses.dataclass
class EngineConfig:
    max_num_seqs: int = 8
    min_batch_bucket: int = 2
    max_model_len: int = 2048
    page_size: int = 16
    # Pages per KV group's pool; None: from kv_cache_bytes, or else enough for max_num_seqs sequences of
    # max_model_len (then no sequence is ever preempted) where the device memory left allows (pool_memory_left),
    # else what it allows.
    num_pages: dict[str, int] | None = None
    # Device memory for the KV pools: every running sequence's sliding ring, the rest for full-layer pages.
    kv_cache_bytes: int | None = None
    # A directory of compiled programs loaded at start-up without tracing or compiling them, and written with the
    # programs compiled (executable_cache.py); None: off.
    executable_cache_dir: str | None = None
    prefill_chunk: int = 256
    # Prompt tokens prefilled per step while other sequences decode (None: prefill_chunk): a long prompt delays
    # the running streams by at most this many tokens' prefill per step. With nothing decoding, prompts prefill
    # at once.
    max_num_batched_tokens: int | None = None
    min_prefill_bucket: int = 16
    # The K/V pages' dtype: None or "auto": the target's parameter dtype; "bfloat16", "float32", or "fp8"
    # (float8_e4m3fn: half a bfloat16 cache's bytes, so twice the pages, each layer's K and V divided by a static
    # power-of-two scale: kv_state.kv_cache_scales). fp8 needs a GPU of compute capability >= 8.9.
    cache_dtype: str | None = None
    attention_impl: str = "auto"  # "auto" | "pallas" (every kernel, interpreted off the GPU) | "xla"
    compile_at_start: bool = True
    # With compile_at_start: compile the smallest batch bucket's step programs and the smallest prefill bucket's
    # program before the engine is returned, and the others in a background thread. The engine serves at once,
    # with batches and prefill chunks no larger than the buckets compiled so far; a cold start is then ready in
    # the time of three programs instead of all of them, and serving still never compiles. On the GPU those three
    # compile without XLA's GEMM autotuning, which is about half of a small program's compile time, and their tuned
    # versions replace them once the other buckets' programs are compiled (`ProgramSet.quick_start`).
    compile_in_background: bool = False
    # Drafts per round when an assistant is given (k); None: the assistant's num_assistant_tokens, else 4.
    num_speculative_tokens: int | None = None
    # With an assistant: choose each step's drafts per round (engine/speculation.py) among 0, the powers of two
    # below k and k, from the acceptance measured per draft position and each program's measured time, so that
    # speculating never costs more than it gives; k is then the most a round drafts. The extra round sizes'
    # programs compile with the buckets after the first (in the background with compile_in_background).
    adaptive_speculation: bool = False
    # Share the K/V of full pages between requests whose tokens up to that page are equal (allocator.py). Free
    # while the pool has room: cached pages are only the ones that would otherwise sit free.
    enable_prefix_caching: bool = True
    # Devices one engine spans (sharding.py): parameters and KV pages split Megatron-style, one program per step.
    tensor_parallel_size: int = 1
    # Dispatch step n+1 before reading step n's tokens (the device state carries each sequence's newest token), so
    # the device does not wait for the host between steps; each step's tokens then reach the caller one step later.
    async_scheduling: bool = True
    # Pass the target's parameters to the step programs stacked as rows of a few arrays (param_pack.py): E2B 540
    # arrays per call -> 12, each of which costs the host ~3 us on the GPU. Only the packed arrays stay on the
    # device (load the weights into host memory first, as `serve --pack-params` does, or they are held twice).
    # Off until the row layout is timed on the GPU (docs/decisions/0004-pack-params.md).
    pack_params: bool = False
    # Speculative rounds for requests with a grammar (structured output): two more programs per batch bucket, the
    # drafts alone and their verify under the grammar's masks at every position. Off: such requests do not
    # speculate (their mask is known for the first position only).
    structured_outputs: bool = False
    # Prefill programs that also return the prompt tokens' logprobs (SamplingParams.prompt_logprobs: completions'
    # echo with logprobs, as evaluation harnesses score text): one more program per prefill bucket.
    prompt_logprobs: bool = False

    def kv_cache_dtype(self, target_dtype) -> jnp.dtype:
        """`cache_dtype` as a dtype, for a target of `target_dtype`."""
        name = self.cache_dtype
        if name is None or name == "auto":
            return jnp.dtype(target_dtype)
        if name not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {['auto', *CACHE_DTYPES]}, got {name!r}")
        return jnp.dtype(CACHE_DTYPES[name])

    def batch_buckets(self) -> list[int]:
        # A single sequence runs as 2 rows (one padding): XLA's 1-row matmuls take a slower path on the H200 (31B
        # decode 28.4 ms at 1 row, 23.8 ms at 2 rows: `python benchmarks/bench_decode.py --models 31b --batch 1 2`).
        return powers_of_two_upto(max(self.max_num_seqs, self.min_batch_bucket), self.min_batch_bucket)

    def prefill_buckets(self) -> list[int]:
        # A chunk holds at most max_model_len - 1 tokens (a sequence's tokens but its newest), so buckets above the
        # power of two that covers them would be compiled at start-up and never run.
        top = min(self.prefill_chunk, 1 << max(0, (self.max_model_len - 2).bit_length()))
        return powers_of_two_upto(top, min(self.min_prefill_bucket, top))
