"""The continuous-batching engine: requests join and leave between steps; every step is a compiled program.

Data flows one way: a request is admitted when the pages its prompt needs are free (it waits otherwise, and is
refused at once if it could never fit), its prompt is prefilled in bucketed chunks, then it joins the decode batch,
padded to the next batch bucket. Pages are taken as sequences grow; when the pool runs dry, the newest sequences
are preempted: their pages go back, they wait at the head of the queue, and on resuming their K/V is recomputed
from their tokens (prompt and output so far), so their output is the one an unpreempted run gives. With the prefix
cache, a request's leading full pages whose tokens another request already computed are shared instead of
recomputed (docs/DESIGN.md, "Prefix cache"). All programs are compiled at start-up; serving never compiles.

One request cannot fail another: each request's part of a step (its pages, its row of the batch's host arrays, taking
its new tokens) is built and checked on its own, and a request whose part raises ends alone with finish reason
"error" (its pages freed) while the step goes on with the others. Only the compiled program itself is shared: when
it raises, `step` raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.allocator import PageAllocator
from gemma4_mtp_jax.config import check_pair
from gemma4_mtp_jax.device_state import FINISH_LENGTH, FINISH_STOP, MAX_STOP_IDS, DeviceState, PrefillRows, StepRows
from gemma4_mtp_jax.executable_cache import ExecutableCache
from gemma4_mtp_jax.kv_state import NULL_PAGE, KVLayout, make_layout, page_bytes
from gemma4_mtp_jax.runtime import Assistant, Target, shapes_only
from gemma4_mtp_jax.sampling import SamplingBatch, SamplingParams, any_sampled
from gemma4_mtp_jax.sharding import Placement, ShardingError, check_tensor_parallel
from gemma4_mtp_jax.speculative import AssistantDrafter, Drafter
from gemma4_mtp_jax.step import CompiledSteps, quick_compiles
from gemma4_mtp_jax.xla_env import allocator_memory

log = logging.getLogger(__name__)


class DeviceMemoryError(RuntimeError):
    """The engine's weights, KV pools and programs do not fit in its devices' memory (raised at start-up)."""


class RequestError(ValueError):
    """A request that can never be served as asked (bad ids, too long, larger than the whole KV pool)."""


def powers_of_two_upto(n: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


def _nbytes(leaf: Any) -> int:
    """Bytes of an array or of a shape alone (jax.ShapeDtypeStruct)."""
    return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def pool_memory_left(devices: Sequence[jax.Device], params: Any) -> int | None:
    """Bytes of KV pool the devices can take, in all (pages are split over tensor-parallel devices): what each
    device's allocator has left (`xla_env.allocator_memory`: its limit less what is in use), less the share of
    `params` not on the device yet (a loader may leave weights in host memory until the programs place them), less
    a reserve for the programs' temporaries and for XLA's GEMM autotuning at compile time, which allocates the
    operands of each matmul it tunes: twice the largest weight, plus 1 GiB. Where an allocator does not say what
    it holds (XLA's VMM allocator), the weights already on the devices count as its use. None where a device has
    no known memory limit (CPU). Across processes (multi-host) each reads its own devices: the pools are split
    alike over all of them."""
    memory = [allocator_memory(d) for d in devices if d.process_index == jax.process_index()]
    if not memory or any(m is None for m in memory):
        return None
    leaves = jax.tree_util.tree_leaves(params)
    nbytes = [_nbytes(x) for x in leaves]
    placed = [isinstance(x, jax.Array) and {d.platform for d in x.devices()} == {devices[0].platform}
              for x in leaves]
    # Shapes alone (jax.ShapeDtypeStruct: an engine that compiles before the weights are loaded, `compile_ahead`)
    # count as weights still to come, so that it plans the pools the engine built after loading plans.
    host = sum(n for x, n, p in zip(leaves, nbytes, placed)
               if isinstance(x, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) and not p)
    on_devices = sum(n for n, p in zip(nbytes, placed) if p)
    reserve = 2 * max(nbytes, default=0) + (1 << 30)
    free = min(limit - (on_devices // len(devices) if used is None else used) for limit, used in memory)
    return max(0, len(devices) * (free - host // len(devices) - reserve))


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
    cache_dtype: str | None = None  # default: the target's parameter dtype
    attention_impl: str = "auto"  # "auto" | "pallas" (every kernel, interpreted off the GPU) | "xla"
    compile_at_start: bool = True
    # With compile_at_start: compile the smallest batch bucket's step programs and the smallest prefill bucket's
    # program before the engine is returned, and the others in a background thread. The engine serves at once,
    # with batches and prefill chunks no larger than the buckets compiled so far; a cold start is then ready in
    # the time of three programs instead of all of them, and serving still never compiles. On the GPU those three
    # compile without XLA's GEMM autotuning, which is about half of a small program's compile time, and their tuned
    # versions replace them once the other buckets' programs are compiled (`Engine._quick_start`).
    compile_in_background: bool = False
    # Drafts per round when an assistant is given (k); None: the assistant's num_assistant_tokens, else 4.
    num_speculative_tokens: int | None = None
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
    # Off until the row layout is timed on the GPU (its engines did not finish compiling within 85 s in run 43, for
    # a reason not yet measured; run 39 timed a flat layout: no host overhead left, every weight copied).
    pack_params: bool = False

    def batch_buckets(self) -> list[int]:
        # A single sequence runs as 2 rows (one padding): XLA's 1-row matmuls take a slower path on the H200
        # (31B decode 28.4 ms at 1 row, 23.8 ms at 2 rows, benchmarks/RESULTS.md run 5).
        return powers_of_two_upto(max(self.max_num_seqs, self.min_batch_bucket), self.min_batch_bucket)

    def prefill_buckets(self) -> list[int]:
        # A chunk holds at most max_model_len - 1 tokens (a sequence's tokens but its newest), so buckets above the
        # power of two that covers them would be compiled at start-up and never run.
        top = min(self.prefill_chunk, 1 << max(0, (self.max_model_len - 2).bit_length()))
        return powers_of_two_upto(top, min(self.min_prefill_bucket, top))


@dataclasses.dataclass(eq=False)  # a request is itself, whatever its fields: compared and hashed by identity
class Request:
    id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    speculative: bool = True  # draft with the assistant (when the engine has one)
    output: list[int] = dataclasses.field(default_factory=list)
    status: str = "waiting"  # waiting -> running -> finished
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # finish_reason "error": what went wrong (for logs; clients get a generic message)
    pages: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    # Speculative decoding: drafts per round (k), and the drafts accepted in each of the request's rounds; the
    # other counts derive from these.
    num_speculative_tokens: int = 0
    accepted_per_round: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    num_preemptions: int = 0
    prefilled: int = 0  # K/V positions written (or found in the prefix cache) since (re)admission
    decoding: bool = False  # prefill complete: the sequence is in the decode batch
    # Prefix caching: the chained hash of the tokens up to the end of each full page, the pages registered in the
    # cache so far, and per sliding ring the next logical page to enter (its slot is re-pointed if shared).
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    registered: int = 0
    ring_next: dict[str, int] = dataclasses.field(default_factory=dict)
    # The slot's device values (newest token, length, remaining) are this sequence's: a step has run it since it
    # started decoding. Until then its rows bring them from the host.
    on_device: bool = False

    @property
    def num_drafted(self) -> int:
        return self.num_speculative_tokens * len(self.accepted_per_round)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def accepted_per_position(self) -> list[int]:
        """Rounds that accepted at least j+1 drafts, for each draft position j."""
        return [sum(n > j for n in self.accepted_per_round) for j in range(self.num_speculative_tokens)]

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
                "accepted_per_position": list(self.accepted_per_position),
                "accepted_per_round": list(self.accepted_per_round),
            }),
        }


@dataclasses.dataclass
class StepEvent:
    request: Request
    new_tokens: list[int]
    finished: bool
    accepted: int | None = None  # drafts accepted in this step's speculative round (None: no round)


@dataclasses.dataclass
class _Row:
    """One request's row of a step's host arrays, built before the batch is assembled so that a request whose row
    cannot be built (a value that does not fit its dtype, a page table longer than its width) fails alone."""

    req: Request
    tables: dict[str, np.ndarray]  # KV group -> [table width] int32
    sampling: tuple  # SamplingParams.row()
    stop_ids: np.ndarray  # [MAX_STOP_IDS] int32, -1 padded
    remaining: np.int32  # tokens the request may still produce
    # A row whose slot does not hold its values yet (its first decode step) brings its newest token and position.
    fresh: bool = False
    token: np.int32 = np.int32(0)
    length: np.int32 = np.int32(-1)


_FINISH_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}


class _Dispatched(NamedTuple):
    """A decode or speculative step dispatched and not read yet: its requests by row, the same as a set (asked once
    per decoding sequence per step), and the program's output on the device (`CompiledSteps.result` reads its packed
    result)."""

    requests: list[Request]
    members: frozenset[Request]
    packed: jax.Array


class Engine:
    """Serves a target, and speculates with `assistant` when one is given (docs/DESIGN.md, "A request's path").

    The assistant sets the round's k and the K/V geometry its drafts need; `drafter` is what proposes the drafts
    inside the speculative program (default: `AssistantDrafter(assistant)`, the assistant itself)."""

    def __init__(self, target: Target, config: EngineConfig | None = None,
                 progress: Callable[[str, float], None] | None = None, assistant: Assistant | None = None,
                 drafter: Drafter | None = None, devices: Sequence[jax.Device] | None = None,
                 compiled_ahead: dict[str, Any] | None = None):
        """`devices`: the tensor_parallel_size devices this engine runs on (default: the first ones; a
        data-parallel server gives each replica its own). `compiled_ahead`: what `compile_ahead` returned for this
        configuration, the programs it compiled, taken instead of compiling or loading them."""
        if drafter is not None and assistant is None:
            raise ValueError("a drafter needs an assistant (it sets k and the drafts' K/V window)")
        self.target = target
        self.assistant = assistant
        self.config = cfg = config or EngineConfig()
        tc = target.config
        if cfg.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {cfg.max_model_len}")
        if cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {cfg.max_num_batched_tokens}")
        self.k = 0
        if assistant is not None:
            check_pair(tc, assistant.config)
            k = cfg.num_speculative_tokens
            if k is None:
                k = int(assistant.generation_config.get("num_assistant_tokens") or 4)
            if not 1 <= k <= 16:
                raise ValueError(f"num_speculative_tokens must be in 1..16, got {k}")
            self.k = k
        elif cfg.num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs an assistant")
        groups = sorted({tc.layers[i].layer_type for i in tc.store_layers.values()})
        geometry = dict(page_size=cfg.page_size, max_model_len=cfg.max_model_len, prefill_chunk=cfg.prefill_chunk,
                        num_speculative_tokens=self.k,
                        assistant_window=assistant.config.text.sliding_window if assistant else 0)
        self.cache_dtype = jnp.dtype(cfg.cache_dtype) if cfg.cache_dtype else jnp.dtype(target.dtype)
        self.page_bytes = page_bytes(tc, cfg.page_size, self.cache_dtype)
        num_pages = cfg.num_pages
        if num_pages is not None and cfg.kv_cache_bytes is not None:
            raise ValueError("EngineConfig: give num_pages or kv_cache_bytes, not both")
        if num_pages is None:
            probe = make_layout(tc, num_pages={g: 1 << 30 for g in groups}, **geometry)
            # With the prefix cache, sliding pools hold one ring more than the running sequences take: a finished
            # sequence's window then outlives the next admission (which takes a whole ring), so the next request
            # with the same prefix finds it. Without that room every admission evicts the cached windows.
            spare = {g: probe.table_width(g) if cfg.enable_prefix_caching and probe.ring_pages(g) else 0
                     for g in groups}
            num_pages = {g: cfg.max_num_seqs * probe.table_width(g) + spare[g] + 1 for g in groups}
            if cfg.kv_cache_bytes is not None:
                num_pages = self._pages_for_memory(probe, num_pages, cfg.kv_cache_bytes)
            else:
                num_pages = self._fit_device_memory(probe, num_pages, devices)
        self.layout: KVLayout = make_layout(tc, num_pages=num_pages, **geometry)
        self.allocators = {g: PageAllocator(self.layout.pages(g)) for g in groups}
        if assistant is not None and drafter is None:
            drafter = AssistantDrafter(assistant)
        placement = self._placement(cfg.tensor_parallel_size, devices)
        with self._out_of_memory_explained("placing the weights"):
            self.steps = CompiledSteps(target, self.layout, self.cache_dtype, cfg.attention_impl, drafter=drafter,
                                       k=self.k, num_slots=cfg.max_num_seqs, placement=placement,
                                       pack_params=cfg.pack_params, max_batch=max(cfg.batch_buckets()),
                                       max_prefill_tokens=max(cfg.prefill_buckets()))
        # An engine of shapes alone (compile_ahead) compiles but never runs: no pools.
        self.state: DeviceState | None = None
        if not shapes_only(target.params):
            with self._out_of_memory_explained("allocating the KV pools"):
                self.state = self.steps.init_state()
        # Each running sequence owns a slot: its row of the device state's per-sequence arrays.
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        # The step dispatched but not read yet (async scheduling): its requests by row and its packed result.
        self._inflight: _Dispatched | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.eos_ids = self._eos_ids()
        self.num_preemptions = 0
        # Prefix cache, in tokens: looked up at admission, and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.compile_times: dict[str, float] = {}
        self._warm_up: threading.Thread | None = None  # compiling the larger buckets' programs in the background
        self._stop_warm_up = threading.Event()
        self._num_programs: int | None = None
        self._all_buckets = batch, prefill = cfg.batch_buckets(), cfg.prefill_buckets()  # computed once
        self._all_compiled = True  # False while the scheduler must keep to the buckets compiled so far
        if cfg.compile_at_start:
            cache = ExecutableCache.open(cfg.executable_cache_dir)
            with self._out_of_memory_explained("compiling the step programs (XLA's autotuner runs them)"):
                self.compile_times = self.steps.compile_all(*self._first_buckets(), progress, cache=cache,
                                                            given=compiled_ahead, autotune=not self._quick_start())
            if cfg.compile_in_background and (batch[1:] or prefill[1:] or self.steps.untuned):
                self._warm_up = threading.Thread(target=self._compile_rest, args=(batch[1:], prefill[1:], progress,
                                                                                   cache), name="gemma4-compile")
                self._all_compiled = False
                self._warm_up.start()

    def _first_buckets(self) -> tuple[list[int], list[int]]:
        """(batch buckets, prefill buckets) whose programs the engine compiles before it is returned: every one,
        or with compile_in_background the smallest of each."""
        batch, prefill = self._all_buckets
        return ([batch[0]], [prefill[0]]) if self.config.compile_in_background else (batch, prefill)

    def _quick_start(self) -> bool:
        """Whether the first buckets' programs compile without autotuning (compile_in_background, where XLA
        autotunes): they serve until `_compile_rest` replaces them, so the engine is ready sooner."""
        return self.config.compile_in_background and quick_compiles()

    def _compile_rest(self, batch: list[int], prefill: list[int], progress, cache: ExecutableCache | None) -> None:
        """The warm-up thread (compile_in_background): the programs of the buckets left out at start-up, then the
        first buckets' programs again with autotuning where they were compiled without. A program replaced between
        two steps is the same computation, its GEMMs tiled otherwise (their sums rounded in another order, as
        between two batch buckets): the next step runs the tuned one."""
        t0 = time.perf_counter()
        try:
            times = self.steps.compile_all(batch, prefill, progress, cache=cache, stop=self._stop_warm_up)
            self.compile_times.update(times)
            if times and not self._stop_warm_up.is_set():
                log.info("compiled the last %d programs in the background in %.1fs: every bucket in use",
                         len(times), time.perf_counter() - t0)
            if self.steps.untuned and not self._stop_warm_up.is_set():
                # No progress per program: these fill no new bucket (the caller's count of programs stays right).
                t0, untuned = time.perf_counter(), len(self.steps.untuned)
                self.compile_times.update(self.steps.compile_all(*self._first_buckets(), cache=cache,
                                                                 stop=self._stop_warm_up))
                log.info("%d of the first programs replaced by their autotuned versions in %.1fs",
                         untuned - len(self.steps.untuned), time.perf_counter() - t0)
        except Exception:
            log.exception("compiling in the background failed: serving goes on with the programs compiled so far")

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait until the background compiling is over (compile_in_background); True when it is."""
        if self._warm_up is not None:
            self._warm_up.join(timeout)
            return not self._warm_up.is_alive()
        return True

    def close(self) -> None:
        """Stop compiling in the background: no further program starts, the ones compiling finish (waited for)."""
        if self._warm_up is not None:
            self._stop_warm_up.set()
            if self._warm_up.is_alive():  # an XLA compilation cannot be cut short (demo ~10 s, E2B ~20 s: run 116)
                log.info("waiting for the programs still compiling in the background (none further starts)")
            self._warm_up.join()

    def programs_ready(self) -> tuple[int, int]:
        """(programs compiled, programs the buckets need)."""
        steps = self.steps
        if self._num_programs is None:
            self._num_programs = len(steps.programs(*self._all_buckets))
        return len(steps.prefill) + len(steps.decode) + len(steps.speculative), self._num_programs

    def programs_untuned(self) -> int:
        """Programs serving in their quick form, compiled without XLA's autotuning (compile_in_background where
        XLA autotunes), until `_compile_rest` swaps in their tuned versions. Every program is in its final form
        once programs_ready() counts them all and this is 0: the engine runs at its steady speed from then on."""
        return len(self.steps.untuned)

    def _buckets(self) -> tuple[list[int], list[int]]:
        """(batch buckets, prefill buckets) the scheduler may use now: every one, or while programs still compile in
        the background, those whose programs are compiled (a batch bucket's greedy and sampled ones)."""
        batch, prefill = self._all_buckets
        if self._all_compiled:
            return batch, prefill
        steps = self.steps.decode if self.assistant is None else self.steps.speculative
        ready_batch = [b for b in batch if (b, False) in steps and (b, True) in steps]
        ready_prefill = [t for t in prefill if (1, t) in self.steps.prefill]
        if len(ready_batch) == len(batch) and len(ready_prefill) == len(prefill):
            self._all_compiled = True  # no more lookups
        return ready_batch, ready_prefill

    @contextlib.contextmanager
    def _out_of_memory_explained(self, doing: str):
        """A device out of memory while the engine starts, said in the engine's terms: what takes the memory and
        which settings give some back."""
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            cfg = self.config
            weights = sum(map(_nbytes, jax.tree_util.tree_leaves(
                (self.target.params, self.assistant.params if self.assistant else None))))
            raise DeviceMemoryError(
                f"out of device memory {doing}: the weights take {weights / 1e9:.2f} GB and the KV pools "
                f"{self.kv_cache_bytes() / 1e9:.2f} GB (max_num_seqs={cfg.max_num_seqs} sequences of "
                f"max_model_len={cfg.max_model_len} tokens, {cfg.tensor_parallel_size} device(s)); lower "
                f"--max-num-seqs or --max-model-len, set --kv-cache-memory, or raise --gpu-memory-utilization "
                f"({str(e).splitlines()[0][:300]})") from e

    def _placement(self, tp: int, devices: Sequence[jax.Device] | None) -> Placement | None:
        """Where the engine runs: None (the default device, no sharding) for one device and no explicit devices."""
        check_tensor_parallel(self.target.config, tp)
        if devices is None:
            if tp == 1:
                return None
            if tp > len(jax.devices()):
                raise ShardingError(f"tensor_parallel_size={tp} but only {len(jax.devices())} devices are visible")
            devices = jax.devices()[:tp]
        if len(devices) != tp:
            raise ShardingError(f"tensor_parallel_size={tp} but {len(devices)} devices were given")
        return Placement.over(devices)

    def _fit_device_memory(self, probe: KVLayout, roomy: dict[str, int],
                           devices: Sequence[jax.Device] | None) -> dict[str, int]:
        """The default pools (`roomy`: every sequence at max_model_len), or, where they would not fit in the
        device memory left after the weights and a reserve (`pool_memory_left`), pools sized to that memory:
        sequences then grow into pages on demand and the newest are preempted when the pool runs dry."""
        tp = self.config.tensor_parallel_size
        left = pool_memory_left(list(devices) if devices is not None else jax.devices()[:tp],
                                (self.target.params, self.assistant.params if self.assistant else None))
        want = sum(n * self.page_bytes[g] for g, n in roomy.items())
        if left is None or want <= left:
            log.info("KV pools: %.2f GB for %d sequences of %d tokens (device memory left for them: %s)",
                     want / 1e9, self.config.max_num_seqs, self.config.max_model_len,
                     "not reported by the allocator" if left is None else f"{left / 1e9:.2f} GB")
            return roomy
        log.warning("the default KV pools (%.2f GB: %d sequences of %d tokens) do not fit in the %.2f GB of device "
                    "memory left for them; sizing them to it (sequences beyond it are preempted)", want / 1e9,
                    self.config.max_num_seqs, self.config.max_model_len, left / 1e9)
        return self._pages_for_memory(probe, roomy, left, "the device memory left for the KV cache")

    def _pages_for_memory(self, probe: KVLayout, roomy: dict[str, int], budget: int,
                          what: str = "kv_cache_bytes") -> dict[str, int]:
        """Pool sizes within `budget` bytes: the sliding pools as `roomy` has them (a ring per sequence, taken whole
        at admission, and the prefix cache's spare ring), and the rest split evenly, in pages, between the groups
        whose pages grow with the sequence."""
        rings = {g: n for g, n in roomy.items() if probe.ring_pages(g)}
        growing = [g for g in roomy if g not in rings]
        left = budget - sum(n * self.page_bytes[g] for g, n in rings.items())
        n = left // sum(self.page_bytes[g] for g in growing) if growing else 0
        short = [g for g in growing if n - 1 < probe.table_width(g)]
        if left < 0 or short:
            need = (sum(n * self.page_bytes[g] for g, n in rings.items())
                    + sum((probe.table_width(g) + 1) * self.page_bytes[g] for g in growing))
            raise ValueError(f"{what}={budget} cannot hold the sliding rings of max_num_seqs="
                             f"{self.config.max_num_seqs} sequences plus one sequence of max_model_len="
                             f"{self.config.max_model_len}: that needs at least {need} bytes (fewer sequences, a "
                             f"shorter max_model_len or, on a GPU, a larger --gpu-memory-utilization)")
        return {**rings, **{g: int(n) for g in growing}}

    def kv_cache_bytes(self) -> int:
        """Device memory of the KV pools (page 0 of each included)."""
        return sum(self.layout.pages(g) * self.page_bytes[g] for g in self.allocators)

    def _eos_ids(self) -> frozenset[int]:
        eos = self.target.generation_config.get("eos_token_id", self.target.config.eos_token_ids)
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                    stop_ids: frozenset[int] | None = None, request_id: str | None = None,
                    speculative: bool = True) -> Request:
        V = self.target.config.vocab_size
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_ids is not None and len(stop_ids) > MAX_STOP_IDS:
            raise RequestError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(stop_ids)}")
        bad = sorted(t for t in stop_ids or () if not 0 <= t < V)
        if bad:
            raise RequestError(f"stop token id {bad[0]} is outside the vocabulary [0, {V})")
        total = len(prompt) + max_new_tokens
        if total > self.config.max_model_len:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                               f"max_model_len={self.config.max_model_len}")
        for g, alloc in self.allocators.items():
            if self.layout.pages_needed(g, total) > alloc.capacity:
                raise RequestError(f"request needs {self.layout.pages_needed(g, total)} '{g}' pages; the pool has "
                                   f"{alloc.capacity}")
        sampling = sampling or SamplingParams()
        if sampling.seed is None and sampling.temperature > 0:  # unseeded: a fresh draw, not the same seed for all
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(32))
        req = Request(request_id or f"req-{next(self._ids)}", prompt, max_new_tokens, sampling,
                      self.eos_ids if stop_ids is None else frozenset(stop_ids), speculative=speculative)
        self.waiting.append(req)
        return req

    def cancel(self, request: Request) -> None:
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "cancelled")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None)

    def pages_in_use(self) -> dict[str, int]:
        return {g: a.num_used for g, a in self.allocators.items()}

    def pages_total(self) -> dict[str, int]:
        return {g: a.capacity for g, a in self.allocators.items()}

    def _finish(self, req: Request, reason: str) -> None:
        # Out of the batch first: if freeing fails (broken page accounting), the request must still be gone.
        req.status, req.finish_reason, req.finished_at = "finished", reason, time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        """Give back `req`'s slot and pages (its complete pages stay in the prefix cache unless it failed)."""
        if req.finish_reason != "error":
            self._register(req)
        slot, req.slot = req.slot, None
        if slot is not None:
            self._free_slots.append(slot)
        pages, req.pages = req.pages, {}
        for g, group_pages in pages.items():
            # Newest logical page first: eviction (least recently released first) then takes a cached prefix from
            # its end, and its first pages (for a ring, the oldest of its window), which later lookups need before
            # the others, stay findable longest.
            R = self.layout.ring_pages(g)
            if R is not None and g in req.ring_next:
                newest = req.ring_next[g] - 1
                group_pages = [group_pages[j % R] for j in range(newest - R + 1, newest + 1)]
            self.allocators[g].free(group_pages[::-1])

    def _preempt(self, req: Request) -> None:
        """Take a running sequence out to free its pages: it waits at the head of the queue and, when admitted
        again, recomputes its K/V from its tokens (`_prefill` of prompt + output but the newest)."""
        log.info("preempting request %s (%d tokens) to free KV pages", req.id, req.num_tokens)
        self.running.remove(req)
        self._release(req)
        req.status, req.prefilled, req.decoding, req.registered, req.ring_next = "waiting", 0, False, 0, {}
        req.on_device = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _tokens_ahead(self, req: Request) -> int:
        """An upper bound of `req`'s tokens when its next step runs: with a step in flight that runs it, up to k+1
        more than the host has read (never more than the request can reach)."""
        n = req.num_tokens
        if self._inflight is not None and req in self._inflight.members:
            n += self.k + 1
        return min(n, len(req.prompt) + req.max_new_tokens)

    def _pages_short(self, req: Request) -> dict[str, int]:
        """Pages `req` still lacks per KV group for its next step: K/V up to its newest token, plus the k drafts
        a speculative round verifies past it."""
        n = self._tokens_ahead(req)
        return {g: self.layout.pages_needed(g, n) - len(req.pages.get(g, ())) for g in self.allocators}

    def _grow_fits(self, decoding: list[Request]) -> bool:
        """Whether every decoding sequence's next pages fit the free pool without preempting anyone (False if one
        cannot count them: `_grow` then fails it alone)."""
        need = {g: 0 for g in self.allocators}
        for req in decoding:
            try:
                short = self._pages_short(req)
            except Exception:
                return False
            for g, n in short.items():
                need[g] += max(n, 0)
        return all(need[g] <= a.num_free for g, a in self.allocators.items())

    def _take_pages(self, req: Request, short: dict[str, int]) -> None:
        for g, n in short.items():  # one group at a time: _finish frees what was taken if one fails
            if n > 0:
                req.pages[g] = req.pages.get(g, []) + self.allocators[g].allocate(n)

    def _grow(self, decoding: list[Request], events: list[StepEvent]) -> list[Request]:
        """Pages for this step's writes, oldest sequence first. When the pool cannot give them, the newest running
        sequences are preempted until it can (a sequence preempts itself if it is the newest). Returns the
        sequences that still decode this step; one whose allocation raises fails alone."""
        for req in decoding:
            if req.status != "running":
                continue  # preempted for an older one
            try:
                short = self._pages_short(req)
            except Exception as e:
                events.append(self._fail(req, "counting its pages", e))
                continue
            while req.status == "running" and any(n > self.allocators[g].num_free for g, n in short.items()):
                self._preempt(self.running[-1])
            if req.status != "running":
                continue
            try:
                self._take_pages(req, short)
                self._advance_rings(req, (self._tokens_ahead(req) - 1 + self.k) // self.layout.page_size)
            except Exception as e:
                events.append(self._fail(req, "allocating its pages", e))
        return [r for r in decoding if r.status == "running"]

    def _fail(self, req: Request, stage: str, exc: Exception) -> StepEvent:
        """`req`'s own part of the step raised: it alone ends with "error", its pages freed."""
        log.error("request %s failed while %s; the other requests go on", req.id, stage, exc_info=exc)
        req.error = f"{stage}: {type(exc).__name__}: {exc}"
        try:
            self._finish(req, "error")
        except Exception:
            log.exception("request %s: freeing its pages failed", req.id)
        return StepEvent(req, [], True)

    def _admit(self, events: list[StepEvent] | None = None) -> list[Request]:
        """Move the requests that fit from `waiting` to `running` with the pages of their tokens so far; one whose
        pages cannot be taken fails alone (its StepEvent goes to `events`). A page per running sequence stays free
        in each growing group, so that admitting does not force a preemption at the next step."""
        admitted = []
        cap = min(self.config.max_num_seqs, self._buckets()[0][-1])
        while self.waiting and len(self.running) < cap:
            req = self.waiting[0]
            n_cached, cached = self._cached_prefix(req)
            need = self._pages_short(req)
            if n_cached:  # the cached pages are shared, not taken: fewer fresh ones, but the evictable ones count
                need = {g: need[g] - len(cached[g][1]) + self.allocators[g].evictable(cached[g][1])
                        for g in need}
            reserve = {g: 0 if self.layout.ring_pages(g) else len(self.running) for g in self.allocators}
            if any(need[g] + reserve[g] > a.num_free for g, a in self.allocators.items()):
                break  # first come, first served: wait for pages to free up
            self.waiting.popleft()
            req.status = "running"
            self.running.append(req)
            try:
                self._take_admission_pages(req, n_cached, cached)
                req.slot = self._free_slots.pop()
            except Exception as e:
                failed = self._fail(req, "allocating its pages", e)
                if events is not None:
                    events.append(failed)
                continue
            admitted.append(req)
        return admitted

    # ------------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> None:
        """Forget every cached page (vLLM's reset_prefix_cache): later requests recompute their prefixes."""
        for alloc in self.allocators.values():
            alloc.clear_cache()

    def _extend_keys(self, req: Request, num_pages: int) -> None:
        """`req.page_keys` up to `num_pages` pages: key j hashes key j-1 and the tokens of page j, so equal keys
        mean equal tokens at every position up to the page's end (and so equal K/V)."""
        ps = self.layout.page_size
        if len(req.page_keys) >= num_pages:
            return
        tokens = req.prompt + req.output
        while len(req.page_keys) < num_pages:
            j = len(req.page_keys)
            prev = req.page_keys[-1] if j else b""
            chunk = np.asarray(tokens[j * ps : (j + 1) * ps], np.int32).tobytes()
            req.page_keys.append(hashlib.blake2b(prev + chunk, digest_size=16).digest())

    def _window_first_page(self, num_pages: int) -> int:
        """The oldest logical page a sequence resuming after `num_pages` full pages still reads in a sliding layer:
        the target's window before its first query, or the drafter's W+1 committed keys."""
        ps = self.layout.page_size
        window = self.target.config.sliding_window
        reach = max(window - 1, self.assistant.config.text.sliding_window if self.assistant else 0) + 1
        return max(0, (num_pages * ps - reach) // ps)

    def _cached_prefix(self, req: Request) -> tuple[int, dict[str, tuple[int, list[int]]]]:
        """The most full pages of `req`'s tokens (all but the newest, and at least one token left to prefill) whose
        K/V the cache holds: every page for full layers, the window's for sliding rings. Returns (pages,
        {group: (first logical page, cached pages from it)}); (0, {}) with the cache off or on a miss."""
        if not self.config.enable_prefix_caching:
            return 0, {}
        limit = (self._prefill_len(req) - 1) // self.layout.page_size
        if limit <= 0:
            return 0, {}
        self._extend_keys(req, limit)
        n = limit
        for g, alloc in self.allocators.items():
            if self.layout.ring_pages(g) is None:
                j = 0
                while j < n and alloc.lookup(req.page_keys[j]) is not None:
                    j += 1
                n = j
        while n > 0:
            found = {}
            for g, alloc in self.allocators.items():
                lo = 0 if self.layout.ring_pages(g) is None else self._window_first_page(n)
                pages = [alloc.lookup(key) for key in req.page_keys[lo:n]]
                if None in pages:
                    break
                found[g] = (lo, pages)
            else:
                return n, found
            n -= 1
        return 0, {}

    def _take_admission_pages(self, req: Request, n_cached: int, cached: dict[str, tuple[int, list[int]]]) -> None:
        """The pages of an admitted request: the cached prefix shared, fresh ones for the rest (a sliding ring:
        the cached window's pages in their slots, fresh ones in the others)."""
        for g, alloc in self.allocators.items():  # one group at a time: _finish frees what was taken if one fails
            lo, shared = cached.get(g, (0, []))
            alloc.share(shared)
            R = self.layout.ring_pages(g)
            if R is None:
                req.pages[g] = list(shared)
                req.pages[g] += alloc.allocate(self.layout.pages_needed(g, req.num_tokens) - len(shared))
            else:
                slots: list[int | None] = [None] * R
                for j, page in zip(range(lo, n_cached), shared):
                    slots[j % R] = page
                req.pages[g] = [p for p in slots if p is not None]  # held so far (freed if the next line raises)
                fresh = iter(alloc.allocate(slots.count(None)))
                req.pages[g] = [p if p is not None else next(fresh) for p in slots]
                req.ring_next[g] = n_cached
        req.registered = n_cached
        req.prefilled = n_cached * self.layout.page_size
        if self.config.enable_prefix_caching:  # counted once per admission, not per step a request waits
            self.prefix_cache_queries += self._prefill_len(req)
            self.prefix_cache_hits += req.prefilled

    @staticmethod
    def _prefill_len(req: Request) -> int:
        """Tokens a (re)admitted request's prefill runs: its prompt, and a resumed one's output but the newest."""
        return len(req.prompt) + max(len(req.output) - 1, 0)

    def _advance_rings(self, req: Request, last_page: int) -> None:
        """Before a program writes up to logical page `last_page`: a sliding ring slot about to take a new logical
        page gets a fresh page if its current one is shared (cached or held by another sequence), so cached K/V
        is never overwritten. Without the prefix cache nothing is shared and the ring is overwritten in place."""
        if not self.config.enable_prefix_caching:
            return
        for g, alloc in self.allocators.items():
            R = self.layout.ring_pages(g)
            if R is None:
                continue
            pages = req.pages[g]
            for j in range(req.ring_next.get(g, 0), last_page + 1):
                if alloc.shared(pages[j % R]):
                    alloc.free([pages[j % R]])
                    pages[j % R] = alloc.allocate(1)[0]
            req.ring_next[g] = max(req.ring_next.get(g, 0), last_page + 1)

    def _register(self, req: Request) -> None:
        """Put `req`'s newly complete pages (every position's K/V committed) in the prefix cache."""
        if not self.config.enable_prefix_caching or not req.pages:
            return
        committed = req.num_tokens - 1 if req.decoding else req.prefilled
        n = committed // self.layout.page_size
        if n <= req.registered:
            return
        self._extend_keys(req, n)
        for j in range(req.registered, n):
            for g, alloc in self.allocators.items():
                R = self.layout.ring_pages(g)
                if R is None:
                    alloc.register(req.page_keys[j], req.pages[g][j])
                elif j >= req.ring_next.get(g, 0) - R:  # still in its slot
                    alloc.register(req.page_keys[j], req.pages[g][j % R])
        req.registered = n

    # ------------------------------------------------------------------ host -> device arrays
    def _page_rows(self, req: Request) -> dict[str, np.ndarray]:
        tables = {}
        for g, width in self.layout.pages_per_seq:
            t = np.full((width,), NULL_PAGE, np.int32)
            t[: len(req.pages[g])] = req.pages[g]
            tables[g] = t
        return tables

    def _row(self, req: Request) -> _Row:
        row = _Row(req, self._page_rows(req), req.sampling.row(), req.stop_row,
                   np.int32(req.max_new_tokens - len(req.output)))
        if req.decoding and not req.on_device:
            row.fresh, row.token, row.length = True, np.int32(req.output[-1]), np.int32(req.num_tokens - 1)
        return row

    def _rows(self, reqs: list[Request], events: list[StepEvent]) -> list[_Row]:
        rows = []
        for req in reqs:
            try:
                rows.append(self._row(req))
            except Exception as e:
                events.append(self._fail(req, "building its row of the batch", e))
        return rows

    def _tables(self, rows: list[_Row], batch: int) -> dict[str, np.ndarray]:
        """The batch's page tables from its rows (padding rows point at the null page)."""
        out = {}
        for g, width in self.layout.pages_per_seq:
            t = np.full((batch, width), NULL_PAGE, np.int32)
            for r, row in enumerate(rows):
                t[r] = row.tables[g]
            out[g] = t
        return out

    @staticmethod
    def _sampling(rows: list[_Row], batch: int) -> SamplingBatch:
        return SamplingBatch.from_rows([row.sampling for row in rows], batch)

    def _bucket(self, buckets: list[int], n: int) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise AssertionError(f"no bucket for {n} (buckets {buckets})")

    # ------------------------------------------------------------------ steps
    def _prefill(self, req: Request, row: _Row, budget: int | None) -> tuple[int, np.ndarray | None]:
        """Write the K/V of `req`'s tokens but the newest (`row`: its row of host arrays): its prompt, or for a
        preempted sequence its prompt and output so far, whose newest token then feeds the next decode step. Goes
        on from where the last call stopped, in chunks, for up to `budget` tokens (None: to the end). Returns
        (tokens prefilled, the packed result of the last chunk when the prefill is complete, else None): a new
        request's first token, through the stop rule. The program also leaves the drafter's first h in the slot."""
        buckets = self._buckets()[1]
        chunk = min(self.config.prefill_chunk, buckets[-1])
        sampling = self._sampling([row], 1)
        todo = req.prompt + req.output[:-1]
        done, packed = 0, None
        while req.prefilled < len(todo) and (budget is None or done < budget):
            start = req.prefilled
            n = min(chunk, len(todo) - start, budget - done if budget is not None else chunk)
            self._advance_rings(req, (start + n - 1) // self.layout.page_size)
            tables = {g: t[None] for g, t in self._page_rows(req).items()}
            T = self._bucket(buckets, n)
            tokens = np.zeros((1, T), np.int32)
            positions = np.full((1, T), -1, np.int32)
            tokens[0, :n] = todo[start : start + n]
            positions[0, :n] = np.arange(start, start + n)
            rows = PrefillRows(slot=np.array([req.slot], np.int32), tokens=tokens, positions=positions,
                               last_index=np.array([n - 1], np.int32), stop_ids=row.stop_ids[None],
                               remaining=np.array([row.remaining], np.int32))
            self.state, packed = self.steps.compile_prefill(1, T)(self.steps.program_params, self.state,
                                                                  self.steps.inputs(rows, tables, sampling))
            req.prefilled += n
            done += n
            self._register(req)
        if req.prefilled < len(todo):
            return done, None
        return done, self.steps.result(packed, prefill=True)[0]

    def _dispatch(self, rows: list[_Row]) -> jax.Array:
        """One decode step, or with a drafter one draft-and-verify round, for `rows`; returns the program's output,
        whose first columns are the packed result ([B, k+4] int32, device_state.finish_round), without waiting."""
        B, inputs = self._step_inputs(rows)
        sampled = any_sampled([row.sampling for row in rows])
        if self.assistant is None:
            self.state, packed = self.steps.compile_decode(B, sampled)(self.steps.program_params, self.state, inputs)
        else:
            self.state, packed = self.steps.compile_speculative(B, sampled)(
                self.steps.program_params, self.steps.draft_params, self.state, inputs)
        for row in rows:
            row.req.on_device = True
        return packed

    def _step_inputs(self, rows: list[_Row]) -> tuple[int, np.ndarray]:
        """A decode or speculative step's host inputs: (batch bucket, its rows, page tables and sampling rows packed
        as the program takes them)."""
        B = self._bucket(self._buckets()[0], len(rows))
        step_rows = StepRows(
            slot=np.full((B,), self.config.max_num_seqs, np.int32),  # padding rows use the spare last slot
            fresh=np.ones((B,), bool), token=np.zeros((B,), np.int32), length=np.full((B,), -1, np.int32),
            remaining=np.zeros((B,), np.int32), stop_ids=np.full((B, MAX_STOP_IDS), -1, np.int32),
            speculate=np.zeros((B,), bool))
        for r, row in enumerate(rows):
            step_rows.slot[r], step_rows.fresh[r] = row.req.slot, row.fresh
            step_rows.token[r], step_rows.length[r], step_rows.remaining[r] = row.token, row.length, row.remaining
            step_rows.stop_ids[r], step_rows.speculate[r] = row.stop_ids, row.req.speculative
        return B, self.steps.inputs(step_rows, self._tables(rows, B), self._sampling(rows, B))

    def _collect(self, dispatched: _Dispatched) -> list[StepEvent]:
        """Read a dispatched step (the one host read of a step) and take each row's new tokens. A row whose
        request ended meanwhile (it finished in the step before, or was cancelled) ran as padding: skipped."""
        if self._inflight is dispatched:
            self._inflight = None
        reqs, result = dispatched.requests, self.steps.result(dispatched.packed)
        now = time.perf_counter()
        events = []
        for req, row_result in zip(reqs, result):
            if req.status != "running":
                continue
            events.append(self._take(req, row_result, now, self.assistant is not None))
            if not req.finished:
                self._register(req)
        return events

    def _take(self, req: Request, result: np.ndarray, now: float, speculative_round: bool) -> StepEvent:
        """`req`'s new tokens from its row of a packed result (emitted tokens, n accepted, tokens kept, finish
        reason): the device decided where its output ends; the host only records it."""
        try:
            k1 = len(result) - 3
            n, keep, reason = (int(x) for x in result[k1:])
            kept = [int(t) for t in result[:keep]]
            req.output += kept
            req.token_times += [now] * len(kept)
            if req.first_token_at is None and kept:
                req.first_token_at = now
            accepted = None
            if speculative_round and req.speculative:
                req.num_speculative_tokens = self.k
                req.accepted_per_round.append(n)
                accepted = n
            if reason:
                self._finish(req, _FINISH_REASONS[reason])
        except Exception as e:
            return self._fail(req, "taking its new tokens", e)
        return StepEvent(req, kept, req.finished, accepted)

    def step(self) -> list[StepEvent]:
        """Pages for the decoding sequences' next tokens (preempting the newest if the pool is dry), admit what
        fits, prefill up to the token budget (everything when nothing decodes), then one decode step for the
        sequences that were decoding. A sequence whose prefill completes decodes from the next step.

        With async scheduling the decode step is dispatched before the previous one is read, so the returned events
        are the previous step's (and the prefills'); the previous step is read first when the pool cannot take the
        next step's pages without preempting (a preempted sequence's tokens must be known)."""
        events: list[StepEvent] = []
        decoding = [r for r in self.running if r.decoding]
        if self._inflight is not None and not self._grow_fits(decoding):
            events += self._collect(self._inflight)
            decoding = [r for r in self.running if r.decoding]
        decoding = self._grow(decoding, events)
        self._admit(events)
        budget = (self.config.max_num_batched_tokens or self.config.prefill_chunk) if decoding else None
        for req in [r for r in self.running if not r.decoding]:
            if budget is not None and budget <= 0:
                break
            prefill = self._rows([req], events)  # empty if its row could not be built (it failed alone)
            if not prefill:
                continue
            resumed = bool(req.output)  # a preempted sequence: its K/V is recomputed, its output kept
            used, packed = self._prefill(req, prefill[0], budget)
            if budget is not None:
                budget -= used
            if packed is not None:
                req.decoding = True
                if not resumed:
                    events.append(self._take(req, packed, time.perf_counter(), speculative_round=False))
        rows = self._rows(decoding, events)
        previous, self._inflight = self._inflight, None
        if rows:
            reqs = [row.req for row in rows]
            self._inflight = _Dispatched(reqs, frozenset(reqs), self._dispatch(rows))
        if previous is not None:
            events += self._collect(previous)
        if self._inflight is not None and not self.config.async_scheduling:
            events += self._collect(self._inflight)
        return events

    def run(self, on_event: Callable[[StepEvent], None] | None = None) -> None:
        while self.has_work:
            for ev in self.step():
                if on_event:
                    on_event(ev)


def compile_ahead(target: Target, config: EngineConfig, assistant: Assistant | None = None,
                  progress: Callable[[str, float], None] | None = None,
                  stop: threading.Event | None = None) -> dict[str, Any]:
    """Compile the programs that an `Engine(target, config, assistant=...)` compiles before it returns, from shapes
    alone: `target` and `assistant` may hold jax.ShapeDtypeStruct parameters (`api.target_shapes`,
    `api.assistant_shapes`). Run while the weights load; the engine built after loading takes them
    (`Engine(..., compiled_ahead=...)`), and they go into `config.executable_cache_dir` for the next start. No
    device memory is taken: the pools are planned, not allocated. Returns the programs by executable-cache key; {}
    without an executable cache (whose keys say which programs are the engine's). Once `stop` is set no further
    program starts (compile_all)."""
    cache = ExecutableCache.open(config.executable_cache_dir)
    if cache is None:
        return {}
    ahead = Engine(target, dataclasses.replace(config, compile_at_start=False), assistant=assistant)
    ahead.steps.compile_all(*ahead._first_buckets(), progress, cache=cache, stop=stop,
                            autotune=not ahead._quick_start())
    return ahead.steps.by_key
