"""One engine across processes (jax.distributed): process 0 decides, the others run the programs it runs.

Process 0 owns the scheduler and every decision it makes (admission, preemption, buckets, each round's k from its
own timings, grammar masks). Each call of a step program, its name, flags and host inputs, goes to the other
processes through JAX's distributed key-value store before process 0 dispatches it (`Publisher`); each follower runs
the same programs with the same inputs in the same order (`follow`) and decides nothing, so no measurement or
timing of its own can make it diverge (docs/decisions/0023-multihost-program-calls.md). Every process builds the same
engine at start from the same flags, checked first (`agree`), so the programs and the device state match.

A watch thread on every process (`Watch`) keeps a heartbeat in the store and reads the others': a peer silent for
`timeout_s`, or one that says it failed, is a failure of the whole job. A process that has a failure stops what it
can and exits within `exit_after_s`, wherever its own threads are stuck: a collective whose peer died never returns
(gloo and NCCL wait; JAX's coordination service would end the process only after its own heartbeat timeout).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from typing import Any, NoReturn

import jax
import numpy as np
from flax.serialization import msgpack_restore, msgpack_serialize, to_state_dict

from gemma4_mtp_jax.engine.engine import Engine
from gemma4_mtp_jax.model.sampling import SamplingBatch
from gemma4_mtp_jax.programs.program_set import ProgramSet
from gemma4_mtp_jax.steps.device_state import DeviceState, PrefillRows, ProcessingRows, StepInputs, StepRows

log = logging.getLogger(__name__)

NAMESPACE = "gemma4_mtp_jax"
BLOCK = 256  # program calls per key directory of the store; a directory goes once every follower ran its calls


class PeerFailure(RuntimeError):
    """A process of the job died, hangs, failed or cannot be reached."""


class ConfigMismatch(ValueError):
    """The processes were started with settings that would build different programs."""


def _client() -> Any:
    # JAX (0.10 and 0.11) exposes its key-value store only through the distributed runtime's client.
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized: a multi-process engine needs it (distributed.py)")
    return global_state.client


def _key(*parts: Any) -> str:
    return "/".join([NAMESPACE, *map(str, parts)])


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def agree(what: str, fields: dict[str, str], timeout_s: float) -> None:
    """Check that every process has the same `fields` (name -> value, e.g. the flags that shape the programs):
    each publishes its own and reads the others'. Raises ConfigMismatch naming each field that differs and the
    processes' values, or PeerFailure when a process does not publish within `timeout_s`."""
    client, me = _client(), jax.process_index()
    client.key_value_set(_key(what, me), json.dumps(fields, sort_keys=True))
    for other in range(jax.process_count()):
        if other == me:
            continue
        try:
            theirs = json.loads(client.blocking_key_value_get(_key(what, other), int(timeout_s * 1000)))
        except jax.errors.JaxRuntimeError as e:
            raise PeerFailure(f"process {other} did not report its {what} within {timeout_s:.0f}s "
                              f"({_first_line(e)})") from None
        differ = sorted(k for k in fields.keys() | theirs.keys() if fields.get(k) != theirs.get(k))
        if differ:
            raise ConfigMismatch(f"process {me} and process {other} differ in their {what}: " + "; ".join(
                f"{k}: process {me} has {fields.get(k, '(unset)')}, process {other} has {theirs.get(k, '(unset)')}"
                for k in differ))


# ---------------------------------------------------------------------- program calls
def encode_call(call: str, inputs: StepInputs | None = None, **flags: Any) -> bytes:
    """A program call as bytes: its name (ProgramSet's method), its flags and its host inputs (msgpack: arrays and
    plain values only, nothing a reader would execute), deflated at level 1: inputs are mostly padding and masks of
    -1, and the store's own gRPC compression of the raw bytes costs process 0 tens of milliseconds per MiB
    (docs/decisions/0023-multihost-program-calls.md)."""
    return zlib.compress(msgpack_serialize({"call": call, "flags": flags,
                                            "inputs": None if inputs is None else to_state_dict(inputs)}), 1)


def decode_call(data: bytes) -> tuple[str, StepInputs | None, dict[str, Any]]:
    """(name, host inputs, flags) of `encode_call`'s bytes."""
    msg = msgpack_restore(zlib.decompress(data))
    d = msg["inputs"]
    inputs = None
    if d is not None:
        rows = (PrefillRows if msg["call"] == "prefill" else StepRows)(**d["rows"])
        processing = None if d["processing"] is None else ProcessingRows(**d["processing"])
        inputs = StepInputs(rows, dict(d["tables"]), SamplingBatch(**d["sampling"]), processing)
    return msg["call"], inputs, msg["flags"]


def _call_key(n: int) -> str:
    return _key("call", n // BLOCK, n % BLOCK)


class Publisher:
    """Process 0's ProgramSet as the runner sees it: each program call is published, then run. Everything else
    (buckets, results) is the ProgramSet's own."""

    def __init__(self, programs: ProgramSet):
        self.programs = programs
        self.client = _client()
        self.calls = 0
        self.publish_seconds = 0.0  # host time spent publishing, in all

    def __getattr__(self, name: str) -> Any:
        return getattr(self.programs, name)

    def _publish(self, call: str, inputs: StepInputs | None = None, **flags: Any) -> None:
        t0 = time.perf_counter()
        self.client.key_value_set_bytes(_call_key(self.calls), encode_call(call, inputs, **flags))
        self.calls += 1
        self.publish_seconds += time.perf_counter() - t0

    def prefill(self, state: DeviceState, inputs: StepInputs, scored: bool = False,
                media: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[DeviceState, Any]:
        # A chunk's soft tokens travel with it: the followers run no encoder of their own.
        self._publish("prefill", inputs, scored=scored,
                      media=None if media is None else {"soft": np.asarray(media[0]), "at": np.asarray(media[1])})
        return self.programs.prefill(state, inputs, scored, media)

    def step(self, state: DeviceState, inputs: StepInputs, sampled: bool, processed: bool = False,
             k: int | None = None) -> tuple[DeviceState, Any]:
        self._publish("step", inputs, sampled=sampled, processed=processed, k=k)
        return self.programs.step(state, inputs, sampled, processed, k)

    def draft(self, state: DeviceState, inputs: StepInputs) -> tuple[DeviceState, Any, Any, Any]:
        self._publish("draft", inputs)
        return self.programs.draft(state, inputs)

    def verify(self, state: DeviceState, inputs: StepInputs, drafted: Any) -> tuple[DeviceState, Any]:
        self._publish("verify")  # the followers verify their own draft program's drafts, with its inputs
        return self.programs.verify(state, inputs, drafted)

    def accept(self, state: DeviceState, inputs: StepInputs, drafted: Any, q: Any, q_ids: Any,
               verified: Any) -> tuple[DeviceState, Any]:
        self._publish("accept", inputs)  # with the grammar masks: the followers' own programs' outputs stay theirs
        return self.programs.accept(state, inputs, drafted, q, q_ids, verified)

    def stop(self) -> None:
        """Tell the followers that no call comes any more: their loops return."""
        self._publish("stop")


def lead(engine: Engine) -> Publisher:
    """Make `engine` (process 0's) publish every program call it runs from now on; returns the Publisher."""
    publisher = Publisher(engine.runner.programs)
    engine.runner.programs = publisher
    return publisher


def follow(engine: Engine, watch: "Watch", poll_s: float = 0.5) -> int:
    """Run process 0's program calls on this process's `engine` (built as process 0's is) until it says stop;
    returns the calls run. Raises PeerFailure when the watch has a failure or process 0 cannot be reached."""
    client, programs = _client(), engine.programs
    state, engine.runner.state = engine.runner.state, None  # this loop owns the device state now
    # The last draft program's outputs (drafted, q, q_ids) and inputs, and its verify's outputs: a masked round's
    # later programs take them from this process's own devices.
    drafted: tuple = ()
    draft_inputs, verified = None, None
    n = 0
    while True:
        if watch.failure is not None:
            raise PeerFailure(watch.failure)
        try:
            data = client.blocking_key_value_get_bytes(_call_key(n), int(poll_s * 1000))
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" in str(e):  # nothing to run yet: process 0 is idle
                continue
            raise PeerFailure(f"lost process 0 (the coordinator): {_first_line(e)}") from None
        call, inputs, flags = decode_call(data)
        if call == "stop":
            return n
        if call == "prefill":
            media = flags.get("media")
            state, _ = programs.prefill(state, inputs, flags["scored"],
                                        None if media is None else (media["soft"], media["at"]))
        elif call == "step":
            state, _ = programs.step(state, inputs, flags["sampled"], flags["processed"], flags["k"])
        elif call == "draft":
            state, *drafted = programs.draft(state, inputs)
            draft_inputs = inputs
        elif call == "verify":
            state, verified = programs.verify(state, draft_inputs, drafted[0])
        elif call == "accept":
            state, _ = programs.accept(state, inputs, *drafted, verified)
        else:
            raise ValueError(f"process 0 sent an unknown program call {call!r}")
        watch.progress = n
        n += 1


# ---------------------------------------------------------------------- liveness
class Watch(threading.Thread):
    """Heartbeats and failures across the job. Every `interval_s` it writes this process's heartbeat (with its
    `progress`: the last program call a follower ran) and reads the others'; a peer whose heartbeat has not changed
    for `timeout_s`, a failure another process published, or the store gone (process 0 died) sets `failure`. Once
    `failure` is set, the process exits with status 1 after `exit_after_s` unless `close` came first: the owner
    stops what it can in between. On process 0 it also reads stop requests (`stop_request`) and deletes the
    program calls every follower ran."""

    def __init__(self, timeout_s: float, interval_s: float = 0.5, exit_after_s: float = 5.0):
        super().__init__(name="gemma4-multihost-watch", daemon=True)
        self.client = _client()
        self.me, self.n = jax.process_index(), jax.process_count()
        self.timeout_s, self.interval_s, self.exit_after_s = timeout_s, interval_s, exit_after_s
        self.progress = -1
        self.failure: str | None = None
        self.stop_request: str | None = None
        self._closed = threading.Event()
        self._deleted = 0  # call blocks deleted so far (process 0)
        self._silent: set[int] = set()  # peers taken for dead

    @property
    def leader(self) -> bool:
        return self.me == 0

    def close(self) -> None:
        """Stop watching (a clean end: the peers stop beating now too)."""
        self._closed.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    def fail(self, reason: str) -> None:
        """Record a failure of the job here and tell the other processes (the first failure published wins)."""
        if self.failure is None:
            self.failure = reason
        try:
            self.client.key_value_set(_key("failed"), reason)
        except jax.errors.JaxRuntimeError:  # another failure came first, or the store is gone
            pass

    def request_stop(self, reason: str) -> None:
        """Ask process 0 to stop the job cleanly (a signal to a follower)."""
        try:
            self.client.key_value_set(_key("stop"), reason)
        except jax.errors.JaxRuntimeError:
            pass

    def _try_get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except jax.errors.JaxRuntimeError as e:
            if "NOT_FOUND" in str(e):
                return None
            raise

    def run(self) -> None:
        beat, started = 0, time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {p: (None, started) for p in range(self.n) if p != self.me}
        while not self._closed.wait(self.interval_s):
            beat += 1
            try:
                self.client.key_value_set(_key("alive", self.me), f"{beat} {self.progress}", allow_overwrite=True)
                failed = self._try_get(_key("failed"))
                if failed is not None and self.failure is None:
                    self.failure = failed
                now = time.monotonic()
                progress = []
                for p, (last, since) in seen.items():
                    value = self._try_get(_key("alive", p))
                    if value != last:
                        seen[p] = (value, now)
                    elif now - since > self.timeout_s and self.failure is None:
                        self._silent.add(p)
                        self.fail(f"process {p} stopped answering: no heartbeat for {now - since:.0f}s (it died or "
                                  f"hangs)")
                    progress.append(int(value.split()[1]) if value else -1)
                if self.leader:
                    self.stop_request = self.stop_request or self._try_get(_key("stop"))
                    self._delete_calls(min(progress, default=-1))
            except jax.errors.JaxRuntimeError as e:
                if self.failure is None:
                    self.failure = f"lost the job's coordination service on process 0: {_first_line(e)}"
            if self.failure is not None:
                log.error("the multi-process job failed: %s", self.failure)
                if not self._closed.wait(self.exit_after_s):
                    log.error("exiting: %s", self.failure)
                    self.leave(1)
                return

    def leave(self, status: int) -> NoReturn:
        """End this process now with `status`: not through the interpreter's exit, whose jax.distributed shutdown
        would wait for every process. Process 0 first waits up to `exit_after_s` for the others that live to leave:
        with it goes the coordination service, and JAX would end them with its own message instead of theirs."""
        try:
            self.client.key_value_set(_key("gone", self.me), str(status))
            deadline = time.monotonic() + self.exit_after_s
            for p in range(1, self.n) if self.leader else ():
                if p not in self._silent:
                    self.client.blocking_key_value_get(_key("gone", p),
                                                       max(1, int(1000 * (deadline - time.monotonic()))))
        except jax.errors.JaxRuntimeError:  # the store is gone, or a process did not leave in time
            pass
        logging.shutdown()
        os._exit(status)

    def _delete_calls(self, ran: int) -> None:
        """Drop the directories of program calls that every follower ran (the store keeps what it is given)."""
        while (self._deleted + 1) * BLOCK <= ran + 1:
            self.client.key_value_delete(_key("call", self._deleted))
            self._deleted += 1
