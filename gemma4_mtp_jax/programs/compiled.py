"""The compiled programs: prefill chunks, decode, and the speculative round, built from the pure step functions
of steps/ (`forward.py`, `speculative.py`).

Each step is one XLA program per shape bucket, compiled ahead of time. The engine's device state
(`device_state.DeviceState`: pages, the drafter's hidden buffer, each slot's newest token and length) is donated
and comes back updated in place. The host passes its per-row inputs (slots, page tables, sampling and stop rows, the
token and length of rows that start decoding) packed as one int32 array (`input_pack.py`), donated too: the program
writes its packed result over that array's first columns, and the host reads them back (`CompiledSteps.result`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.steps.device_state import (DeviceState, History, StepInputs, count_inputs, finish_round,
                                                prefill_history, stop_check)
from gemma4_mtp_jax.programs.executable_cache import user_cache_dir
from gemma4_mtp_jax.steps.forward import StepSpec, decode_step, prefill_step
from gemma4_mtp_jax.programs.input_pack import pack_rows, packed_width, return_in, unpack_rows
from gemma4_mtp_jax.kernels.device_budget import on_gpu, pallas_kernels
from gemma4_mtp_jax.model.config import TextConfig
from gemma4_mtp_jax.model.kv_state import KVLayout
from gemma4_mtp_jax.model.runtime import Target
from gemma4_mtp_jax.model.sharding import Placement, mesh_context
from gemma4_mtp_jax.programs.arrays import ProgramArrays, jit_on
from gemma4_mtp_jax.steps.speculative import (AssistantDrafter, Drafter, draft_round, speculative_step, verify_accept,
                                              verify_forward)
from gemma4_mtp_jax.model.sampling import mask_words, top_logprobs_count
from gemma4_mtp_jax.xla_env import STABLE_TEMPORARIES, UPDATE_MODE_OPTION, update_mode_in_flags

log = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (start-up then reuses earlier compilations of the same
    programs). path: a directory, "none" to leave it off, or None for an already configured directory or
    ~/.cache/gemma4_mtp_jax/jax_cache. Returns the directory in use."""
    if path is not None and path.lower() == "none":
        return None
    if path is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = path or user_cache_dir("jax_cache")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def compiler_options() -> dict[str, str]:
    """XLA options every step program is compiled with. On the GPU: SKIP_TEMP, stable addresses for a program's
    temporaries, so that XLA does not re-record the command buffers of every pipelined step (xla_env.py). Where
    XLA_FLAGS already chooses the update mode for the whole process (as the package sets it at import), that
    applies; as a compile option alone it only skips part of the updates
    (docs/decisions/0001-command-buffer-update-mode.md)."""
    if not on_gpu() or update_mode_in_flags():
        return {}
    return {UPDATE_MODE_OPTION: STABLE_TEMPORARIES}


# JAX settings that change what a traced program computes (the executable cache's key holds their values).
_TRACE_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                 "jax_threefry_partitionable")

_options_rejected: list[str] = []  # the message of an XLA that refused compiler_options(), once

# XLA's GEMM autotuning, off: about half of a small program's compile time (docs/decisions/0014-untuned-first-
# programs.md). Untuned, XLA's own Triton GEMMs take default tiles that made E2B's decode 2x and its B = 16 verify 6x
# slower, so these programs leave GEMMs to cuBLAS, which picks its kernels by its own heuristics
# (docs/decisions/0015-cublas-for-untuned-programs.md). Only programs that serve while their tuned replacements
# compile go without tuning (`quick_compiles`, an engine's first programs). Typed values: XLA refuses the string
# "false" for a bool option, and a refused option compiles the program tuned.
UNTUNED = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def quick_compiles() -> bool:
    """Whether compiling without autotuning is quicker here: only XLA:GPU autotunes."""
    return on_gpu()


def compile_lowered(lowered: jax.stages.Lowered, autotune: bool = True) -> Any:
    """A lowered step program compiled with `compiler_options()`, or without them where this XLA refuses them;
    `autotune` False: without XLA's GEMM autotuning as well (UNTUNED)."""
    options = compiler_options() | ({} if autotune else UNTUNED)
    if options and not _options_rejected:
        try:
            return lowered.compile(compiler_options=options)
        except (RuntimeError, ValueError) as e:  # an XLA that does not know the option: the programs still run
            _options_rejected.append(str(e))
            log.warning("compiling without %s (this XLA refused it: %s); every pipelined step then re-records its "
                        "command buffers", options, str(e).splitlines()[0][:200])
    return lowered.compile()


def _with_pallas_kernels(fn: Callable) -> Callable:
    """fn, traced under `device_budget.pallas_kernels()` in whichever thread lowers it."""

    def traced(*args):
        with pallas_kernels():
            return fn(*args)

    return traced


# A step program's variants, (sampled, processed): every row greedy; some row samples (`sampling.sample` says why
# the host, not the device, decides); some row needs logits processing or logprobs (sampling.SamplingParams.
# processed), which samples too. The cheaper variants skip what their batches never need.
VARIANTS = ((False, False), (True, False), (True, True))


def variant_tag(sampled: bool, processed: bool) -> str:
    return ",processed" if processed else ",sampled" if sampled else ""


def placement_for(placement: Placement | None, drafter: Drafter | None, cfg: TextConfig) -> Placement | None:
    """The placement the programs run on: `placement`, and with the MTP assistant the pages it reads whole on every
    device too, so that its draft steps, whole on every device as well, need no collective
    (sharding.Placement.whole_kv)."""
    if placement is None or not isinstance(drafter, AssistantDrafter):
        return placement
    return placement.with_whole_kv(drafter.kv_layers(cfg))


@dataclasses.dataclass
class CompiledSteps:
    """Ahead-of-time compiled programs: prefill per (rows, chunk) bucket, and per batch bucket either decode or,
    with a drafter, the speculative round, each in the three VARIANTS. What the programs take besides their host
    inputs (parameters, the device state) is `arrays` (arrays.py)."""

    target: Target
    layout: KVLayout
    cache_dtype: Any
    attention_impl: str = "auto"
    drafter: Drafter | None = None  # with a drafter, decoding is the speculative step (steps/speculative.py)
    k: int = 0  # the most drafts a round verifies: the page geometry and the staging buffer are sized for it
    # The rounds' sizes that have speculative programs, k among them (a round of 0 drafts verifies the newest token
    # alone: a decode step that keeps the drafter's h); () means k alone. The engine picks one per step
    # (engine/speculation.py).
    round_sizes: tuple[int, ...] = ()
    num_slots: int = 1
    # Tensor parallelism: the mesh the programs run on and each parameter's and page's sharding (None: one device,
    # no sharding annotations). Host inputs and outputs are replicated; pages and the hidden buffer come back with
    # the shardings they went in with, so donation updates them in place.
    placement: Placement | None = None
    # Programs take the target's leaves stacked as rows of a few arrays (param_pack.py); False: every array as it is.
    pack_params: bool = False
    # The most rows a decode or speculative program takes and the longest chunk a (one-row) prefill program takes:
    # they size the device state's staging buffer for the packed host inputs (input_pack.py). None: num_slots
    # rows; the layout's max_model_len tokens.
    max_batch: int | None = None
    max_prefill_tokens: int | None = None
    # With a drafter: also a round in three programs per batch bucket for batches with a grammar, whose masks depend
    # on the drafts: the drafts (`draft`), which the host reads; the verify's target forward (`verify`), during which
    # the host walks the grammars through the drafts; the rest of the verify (`accept`: the processed variant with
    # a grammar's masks at every verified position).
    structured: bool = False
    # Prefill programs that also return their prompt tokens' logprobs (completions' echo with logprobs), one more
    # per prefill bucket.
    prompt_logprobs: bool = False
    prefill: dict[tuple, Any] = dataclasses.field(default_factory=dict)  # (batch, tokens[, "scored"])
    # The prefill of a chunk with soft tokens (a prompt with media; a target with encoders alone): (batch, tokens)
    prefill_media: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    decode: dict[tuple[int, bool, bool], Any] = dataclasses.field(default_factory=dict)  # (batch, *variant)
    speculative: dict[tuple[int, bool, bool, int], Any] = dataclasses.field(default_factory=dict)  # (..., k)
    draft: dict[int, Any] = dataclasses.field(default_factory=dict)  # batch -> the drafts alone (structured)
    verify: dict[int, Any] = dataclasses.field(default_factory=dict)  # batch -> their verify's forward (structured)
    accept: dict[int, Any] = dataclasses.field(default_factory=dict)  # batch -> the rest of that verify

    def __post_init__(self):
        self.round_sizes = tuple(sorted(set(self.round_sizes) | {self.k})) if self.drafter is not None else ()
        if any(not 0 <= r <= self.k for r in self.round_sizes):
            raise ValueError(f"round sizes {self.round_sizes} must lie in 0..k = {self.k}")
        self.placement = placement_for(self.placement, self.drafter, self.target.config)
        whole_kv = frozenset() if self.placement is None else self.placement.whole_kv
        self.spec = StepSpec(self.target, self.layout, self.attention_impl, drafter=self.drafter, k=self.k,
                             whole_kv=whole_kv)
        self._rep = None if self.placement is None else self.placement.replicated
        # Elements of the staging buffer: one more than the largest packed input (input_pack.unpack_rows).
        rows, tokens = self.max_batch or self.num_slots, self.max_prefill_tokens or self.layout.max_model_len
        masked = self.k + 1 if self.structured and self.drafter is not None else 1  # the verify's masks
        capacity = 1 + max(rows * packed_width(self._abstract_inputs(rows, processed=True, masked=masked)),
                           packed_width(self._abstract_inputs(1, tokens)))
        self.arrays = ProgramArrays(self.target, self.layout, self.cache_dtype,
                                    self.drafter.params() if self.drafter is not None else None, self.num_slots,
                                    capacity, self.placement, self.pack_params)
        # What every program takes (the engine's runner passes them each step).
        self.program_params, self.draft_params = self.arrays.program_params, self.arrays.draft_params

    @property
    def params(self) -> Any:
        """The target's parameter tree on the programs' devices (ProgramArrays.params)."""
        return self.arrays.params

    def _jit(self, fn, donate: tuple[int, ...], results: int = 1):
        """fn jitted for the placement: it returns the state and `results` replicated arrays (the draft program:
        its drafts, q and q_ids; the verify's forward: h_all and the logits)."""
        if self.attention_impl == "pallas":  # the Pallas kernels throughout, interpreted off the GPU
            fn = _with_pallas_kernels(fn)
        return jit_on(self.placement, fn, donate, (self.arrays.state_shardings(),) + (self._rep,) * results)

    def _abstract_inputs(self, batch: int, tokens: int | None = None, processed: bool = False,
                         masked: int = 1) -> StepInputs:
        """A program's host inputs: a prefill's (PrefillRows of `tokens` per row) or, for tokens None, a decode or
        speculative step's (StepRows; with processing rows in the processed variant, grammar masks for `masked`
        positions)."""
        return StepInputs.abstract(batch, self.layout.pages_per_seq, tokens, self._rep, processed,
                                   mask_words(self.target.config.vocab_size), masked)

    def _abstract_args(self, batch: int, tokens: int | None = None, processed: bool = False,
                       masked: int = 1) -> tuple:
        """(program params, draft params, state, packed inputs) as shapes."""
        params, draft = self.arrays.abstract_params()
        width = packed_width(self._abstract_inputs(batch, tokens, processed, masked))
        packed = jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=self._rep)
        return params, draft, self.arrays.abstract_state(), packed

    @staticmethod
    def inputs(inputs: StepInputs) -> np.ndarray:
        """A program's host inputs (StepInputs of host arrays) as it takes them: one int32 array [B, W]
        (input_pack.py)."""
        return pack_rows(inputs)

    def _unpack(self, state: DeviceState, packed: jax.Array, tokens: int | None = None,
                processed: bool = False, masked: int = 1) -> tuple:
        """(StepInputs, state with the inputs staged): see input_pack.py. A program whose packed inputs do not fit
        the staging buffer (more rows than max_batch, a longer chunk than max_prefill_tokens) fails here, at
        tracing."""
        inputs, staged = unpack_rows(packed, self._abstract_inputs(packed.shape[0], tokens, processed, masked),
                                     state.inputs)
        return inputs, state.replace(inputs=staged)

    def _prefill_fn(self, params, state: DeviceState, packed, *media, tokens: int,
                    scored: bool = False) -> tuple[DeviceState, jax.Array]:
        """A prompt chunk per row; the token sampled after the row's last one, through the stop rule (meaningful on
        a prompt's final chunk), with its logprobs, as a packed [B, 4 + 1 + 2K] result (finish_round's layout);
        the drafter's h (the hidden there) into its slot; the rows' histories (device_state.prefill_history).
        `media`: the media variant's soft tokens and where they go (steps.forward.forward_paged)."""
        inputs, state = self._unpack(state, packed, tokens)
        rows = inputs.rows
        state, history = prefill_history(state, rows, inputs.processing)
        pages, token, h_last, logprobs = prefill_step(self.spec.but(scored=scored), self.arrays.pack.unpack(params),
                                                      state.pages, inputs, history, media)
        state = state.replace(pages=pages)
        if state.hidden is not None:
            state = state.replace(hidden=state.hidden.at[rows.slot].set(h_last.astype(state.hidden.dtype)))
        keep, reason = stop_check(token[:, None], jnp.zeros_like(token), rows.stop_ids, rows.remaining)
        zeros = jnp.zeros_like(token)
        return state, return_in(packed, jnp.concatenate([jnp.stack([token, zeros, keep, reason], 1), logprobs], 1))

    def _decode_fn(self, params, state: DeviceState, packed, *, sampled: bool,
                   processed: bool) -> tuple[DeviceState, jax.Array]:
        inputs, state = self._unpack(state, packed, processed=processed)
        rows = inputs.rows.resolve(state)
        inputs = inputs.replace(rows=rows)
        history = History.of(state, rows.slot) if processed else None
        pages, nxt, logprobs = decode_step(self.spec.but(sampled=sampled, processed=processed),
                                           self.arrays.pack.unpack(params), state.pages, inputs, history)
        state = state.replace(pages=pages)
        zeros = jnp.zeros_like(nxt)
        if processed:
            state = count_inputs(state, rows, rows.token[:, None], zeros)
        state, result = finish_round(state, rows, nxt[:, None], zeros, logprobs)
        return state, return_in(packed, result)

    def _speculative_fn(self, params, params_d, state: DeviceState, packed, *, sampled: bool,
                        processed: bool, k: int) -> tuple[DeviceState, jax.Array]:
        inputs, state = self._unpack(state, packed, processed=processed)
        rows = inputs.rows.resolve(state)
        inputs = inputs.replace(rows=rows)
        history = History.of(state, rows.slot) if processed else None
        pages, hidden, emitted, n, verified, logprobs = speculative_step(
            self.spec.but(sampled=sampled, processed=processed, k=k), self.arrays.pack.unpack(params), params_d,
            state.pages, state.hidden, inputs, history)
        state = state.replace(pages=pages, hidden=hidden)
        if processed:
            state = count_inputs(state, rows, verified, n)
        state, result = finish_round(state, rows, emitted, n, logprobs)
        return state, return_in(packed, result)

    def _draft_fn(self, params, params_d, state: DeviceState, packed) -> tuple:
        """A round's drafts alone (speculative.draft_round): (state, packed [B, k] drafts, q, q_ids)."""
        inputs, state = self._unpack(state, packed)
        inputs = inputs.replace(rows=inputs.rows.resolve(state))
        drafts, q, q_ids = draft_round(self.spec, self.arrays.pack.unpack(params), params_d, state.pages,
                                       state.hidden, inputs)
        return state, return_in(packed, drafts), q, q_ids

    def _verify_forward_fn(self, params, state: DeviceState, packed, drafted) -> tuple:
        """The verify's target forward on a `_draft_fn`'s drafts (`drafted`: its packed output; `packed`: the draft
        program's inputs again): (state with the pages written, h_all [B, k+1, H], logits [B, k+1, V]), which
        `_accept_fn` takes once the host has the grammar masks."""
        inputs, state = self._unpack(state, packed)
        inputs = inputs.replace(rows=inputs.rows.resolve(state))
        pages, h_all, logits = verify_forward(self.spec, self.arrays.pack.unpack(params), state.pages, inputs,
                                              drafted[:, :self.k])
        return state.replace(pages=pages), h_all, logits

    def _accept_fn(self, state: DeviceState, packed, drafted, q, q_ids, h_all,
                   logits) -> tuple[DeviceState, jax.Array]:
        """The rest of the verify (`_verify_forward_fn`'s h_all and logits), in the processed variant with grammar
        masks at the k+1 verified positions: the speculative round's result."""
        inputs, state = self._unpack(state, packed, processed=True, masked=self.k + 1)
        rows = inputs.rows.resolve(state)
        inputs = inputs.replace(rows=rows)
        hidden, emitted, n, verified, logprobs = verify_accept(
            self.spec.but(sampled=True, processed=True), state.hidden, inputs, History.of(state, rows.slot),
            drafted[:, :self.k], q, q_ids, h_all, logits)
        state = count_inputs(state.replace(hidden=hidden), rows, verified, n)
        state, result = finish_round(state, rows, emitted, n, logprobs)
        return state, return_in(packed, result)

    # Each program as (its jitted function, the abstract arguments it is lowered for): lowering needs both
    # (`jitted.lower(*args)`), and the executable cache keys on the arguments without lowering.
    def prefill_program(self, batch: int, tokens: int, scored: bool = False,
                        media: bool = False) -> tuple[Any, tuple]:
        params, _, state, packed = self._abstract_args(batch, tokens)
        fn = functools.partial(self._prefill_fn, tokens=tokens, scored=scored)
        extra = ()
        if media:  # soft tokens [B, T, H] in the activations' dtype, and where they go [B, T]
            H = self.target.config.hidden_size
            extra = (jax.ShapeDtypeStruct((batch, tokens, H), jnp.dtype(self.target.dtype), sharding=self._rep),
                     jax.ShapeDtypeStruct((batch, tokens), jnp.bool_, sharding=self._rep))
        return self._jit(fn, (1, 2)), (params, state, packed, *extra)

    def decode_program(self, batch: int, sampled: bool, processed: bool = False) -> tuple[Any, tuple]:
        params, _, state, packed = self._abstract_args(batch, processed=processed)
        fn = functools.partial(self._decode_fn, sampled=sampled, processed=processed)
        return self._jit(fn, (1, 2)), (params, state, packed)

    def speculative_program(self, batch: int, sampled: bool, processed: bool = False,
                            k: int | None = None) -> tuple[Any, tuple]:
        fn = functools.partial(self._speculative_fn, sampled=sampled, processed=processed,
                               k=self.k if k is None else k)
        return self._jit(fn, (2, 3)), self._abstract_args(batch, processed=processed)

    def draft_program(self, batch: int) -> tuple[Any, tuple]:
        return self._jit(self._draft_fn, (2, 3), results=3), self._abstract_args(batch)

    def verify_program(self, batch: int) -> tuple[Any, tuple]:
        params, _, state, packed = self._abstract_args(batch)
        return (self._jit(self._verify_forward_fn, (1,), results=2),
                (params, state, packed, self.draft_outputs(batch)[1]))

    def accept_program(self, batch: int) -> tuple[Any, tuple]:
        _, _, state, packed = self._abstract_args(batch, processed=True, masked=self.k + 1)
        _, drafted, q, q_ids = self.draft_outputs(batch)
        _, h_all, logits = self.verify_outputs(batch)
        return self._jit(self._accept_fn, (0, 1)), (state, packed, drafted, q, q_ids, h_all, logits)

    def draft_outputs(self, batch: int) -> tuple:
        """What the draft program of `batch` rows returns, as shapes: (state, packed drafts, q, q_ids)."""
        with mesh_context(self.placement):
            return jax.eval_shape(self._draft_fn, *self._abstract_args(batch))

    def verify_outputs(self, batch: int) -> tuple:
        """What the verify's forward program of `batch` rows returns, as shapes: (state, h_all, logits)."""
        with mesh_context(self.placement):
            return jax.eval_shape(self._verify_forward_fn, *self.verify_program(batch)[1])

    def static_description(self) -> tuple | None:
        """What shapes every program besides its arguments and the package's code (the executable cache's key):
        the layout, the dtypes, the attention implementation, k, the slots, the devices, the model configs. None
        for a drafter other than the assistant, which nothing here can describe (its programs are not cached)."""
        if self.drafter is None:
            drafter = None
        elif isinstance(self.drafter, AssistantDrafter):
            drafter = (self.drafter.assistant.config, str(jnp.dtype(self.drafter.assistant.dtype)))
        else:
            return None
        return (self.layout, str(jnp.dtype(self.cache_dtype)), self.attention_impl, self.k, self.num_slots,
                self.placement, self.pack_params, self.arrays.input_capacity, self.target.config,
                str(jnp.dtype(self.target.dtype)), drafter,
                tuple(getattr(jax.config, name, None) for name in _TRACE_CONFIG))

    def result(self, out: jax.Array, prefill: bool = False, processed: bool = False,
               scored: int = 0, k: int | None = None) -> np.ndarray:
        """A program's packed result on the host (waits for the program): the first columns of the array it
        returned, [B, 4] for a prefill, [B, k+4] for a decode (k = 0) or speculative step of k drafts (finish_round;
        k None: the engine's k), then for a prefill or a processed step the emitted tokens' logprob columns
        (device_state.unpack_logprobs), and for a scored prefill of `scored` tokens the prompt tokens' ones."""
        if k is None:
            k = self.k if self.drafter is not None else 0
        positions = 1 if prefill else 1 + k
        per_position = 1 + 2 * top_logprobs_count(self.target.config.vocab_size)
        width = positions + 3
        if prefill or processed:
            width += positions * per_position
        return np.asarray(out)[:, :width + scored * per_position]

    def compile_draft(self, batch: int) -> Any:
        """(program_params, draft_params, state, inputs) -> (state, drafted, q, q_ids): a round's drafts alone
        (`result(drafted)[:, :k]` reads them); state and inputs donated."""
        return self._compiled(self.draft, batch, lambda: self.draft_program(batch))

    def compile_verify(self, batch: int) -> Any:
        """(program_params, state, inputs, drafted) -> (state, h_all, logits): the verify's target forward on a
        draft program's drafts; inputs: the draft program's; the state donated (the inputs are not: nothing it
        returns could take their place)."""
        return self._compiled(self.verify, batch, lambda: self.verify_program(batch))

    def compile_accept(self, batch: int) -> Any:
        """(state, inputs, drafted, q, q_ids, h_all, logits) -> (state, out): the rest of that verify; inputs:
        `inputs(StepInputs)` with processing rows masked at k+1 positions; state and inputs donated; `result(out,
        processed=True)` is the round's packed result."""
        return self._compiled(self.accept, batch, lambda: self.accept_program(batch))

    @staticmethod
    def _compiled(table: dict, key: Any, program: Callable[[], tuple[Any, tuple]]) -> Any:
        if key not in table:
            jitted, args = program()
            table[key] = compile_lowered(jitted.lower(*args))
        return table[key]

    def compile_prefill(self, batch: int, tokens: int, scored: bool = False, media: bool = False) -> Any:
        """(program_params, state, inputs[, soft, at]) -> (state, out); inputs: `inputs(StepInputs)` of B rows of T
        tokens (PrefillRows); state and inputs donated; `result(out, prefill=True)` is the packed [B, 4] result.
        `media`: the variant for a chunk with soft tokens (`programs` lists it for a target with encoders alone)."""
        key = (batch, tokens) + (("scored",) if scored else ())
        return self._compiled(self.prefill_media if media else self.prefill, key,
                              lambda: self.prefill_program(batch, tokens, scored, media))

    def compile_decode(self, batch: int, sampled: bool = False, processed: bool = False) -> Any:
        """(program_params, state, inputs) -> (state, out); inputs: `inputs(StepInputs)` (StepRows, and processing
        rows when `processed`); state and inputs donated; `result(out, processed=processed)` is the packed result.
        The variant (VARIANTS): `sampled`, some row samples (False: every row must be greedy); `processed`, some row
        needs processing or logprobs (implies sampled)."""
        key = (batch, sampled or processed, processed)
        return self._compiled(self.decode, key, lambda: self.decode_program(*key))

    def compile_speculative(self, batch: int, sampled: bool = False, processed: bool = False,
                            k: int | None = None) -> Any:
        """(program_params, draft_params, state, inputs) -> (state, out); as `compile_decode`, for the speculative
        round of k drafts (None: the engine's k; one of `round_sizes`): a packed [B, k+4] result, then the logprob
        columns when `processed`."""
        key = (batch, sampled or processed, processed, self.k if k is None else k)
        return self._compiled(self.speculative, key, lambda: self.speculative_program(*key))

    def programs(self, batch_buckets: list[int], prefill_buckets: list[int],
                 round_sizes: tuple[int, ...] | None = None) -> list[tuple]:
        """Every program the engine runs with these buckets (and with a drafter, these of `round_sizes`; None:
        all): (name, build, store[, outputs]), where build() gives the jitted function and the abstract arguments to
        lower it for, store(compiled) keeps the compiled program, and outputs() what it returns as shapes when that
        is not (state, one array)."""
        def put(table, key):
            return lambda compiled: table.__setitem__(key, compiled)

        # Costliest first, so that they start compiling first: larger buckets, and sampling's programs (E2B's sampled
        # speculative programs compile in ~55 s, the greedy ones in 21-46 s: docs/decisions/0013-compile-in-
        # background.md).
        batch_buckets, prefill_buckets = sorted(batch_buckets, reverse=True), sorted(prefill_buckets, reverse=True)
        progs = [(f"prefill[1x{t}]", lambda t=t: self.prefill_program(1, t), put(self.prefill, (1, t)))
                 for t in prefill_buckets]
        if self.prompt_logprobs:
            progs += [(f"prefill[1x{t},scored]", lambda t=t: self.prefill_program(1, t, True),
                       put(self.prefill, (1, t, "scored"))) for t in prefill_buckets]
        if self.target.encoders is not None:  # prompts with images / audio: chunks with soft tokens have their own
            progs += [(f"prefill[1x{t},media]", lambda t=t: self.prefill_program(1, t, media=True),
                       put(self.prefill_media, (1, t))) for t in prefill_buckets]
        for variant in sorted(VARIANTS, reverse=True):
            tag = variant_tag(*variant)
            if self.drafter is None:
                progs += [(f"decode[{b}{tag}]", lambda b=b, v=variant: self.decode_program(b, *v),
                           put(self.decode, (b, *variant))) for b in batch_buckets]
            else:
                sizes = sorted(self.round_sizes if round_sizes is None else round_sizes, reverse=True)
                progs += [(f"speculative[{b}x{k}{tag}]", lambda b=b, v=variant, k=k: self.speculative_program(b, *v, k),
                           put(self.speculative, (b, *variant, k))) for b in batch_buckets for k in sizes]
        # The masked round's programs are of size k: not listed again when only other sizes are asked for (the
        # background's first bucket), which would compile them twice.
        if self.drafter is not None and self.structured and (round_sizes is None or self.k in round_sizes):
            progs += [(f"draft[{b}x{self.k}]", lambda b=b: self.draft_program(b), put(self.draft, b),
                       lambda b=b: self.draft_outputs(b)) for b in batch_buckets]
            progs += [(f"verify[{b}x{self.k}]", lambda b=b: self.verify_program(b), put(self.verify, b),
                       lambda b=b: self.verify_outputs(b)) for b in batch_buckets]
            progs += [(f"accept[{b}x{self.k},masked]", lambda b=b: self.accept_program(b), put(self.accept, b))
                      for b in batch_buckets]
        return progs
