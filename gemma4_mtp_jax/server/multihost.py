"""`serve` across processes: the same command on every host with --num-processes, --process-id and
--coordinator-address. Process 0 loads, compiles and serves HTTP, its engine publishing every program call; the
others load and compile the same engine and follow (engine/multihost.py). What is checked at start, and how the job
ends:

- the flags that shape the programs (the "model" and "engine" groups of `serve --help`, checkpoints by content),
  the package's code and JAX's version must be the same on every process, then the KV pools each planned: a
  difference stops every process with an error that names the field and each process's value;
- SIGTERM (or SIGINT) on any process stops the whole job as SIGTERM on a one-process server does: process 0 drains,
  then tells the followers to stop, and every process exits 0;
- a process that dies or hangs (no heartbeat for --peer-timeout-seconds) or fails: every other process logs which
  and why, process 0 ends its requests with an error and stops listening, and each exits with status 1 within a few
  seconds, even from inside a collective that will never complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import NoReturn

import jax

from gemma4_mtp_jax.engine import distributed
from gemma4_mtp_jax.engine.engine import Engine
from gemma4_mtp_jax.engine.multihost import Publisher, Watch, agree, follow, lead
from gemma4_mtp_jax.programs.executable_cache import source_digest

log = logging.getLogger(__name__)

AGREED_GROUPS = ("model", "engine")  # `serve --help`'s groups whose flags shape the programs and the KV pools
# Flags of those groups that may differ between hosts: paths (the checkpoints are compared by content instead) and
# the name only process 0 reports.
PER_HOST = {"ckpt", "assistant", "compilation_cache_dir", "executable_cache_dir", "served_model_name"}
START_TIMEOUT_S = 300.0  # the others' flags must arrive within this long of this process's (as jax.distributed's)
# The others' KV pools come once their engines are built: minutes apart where one host compiles what another loads
# from its executable cache. A peer that dies meanwhile is the watch's to notice.
ENGINE_TIMEOUT_S = 24 * 3600.0
SAMPLES, SAMPLE_BYTES = 8, 1 << 16  # per checkpoint file: bytes read at evenly spaced offsets for its fingerprint


def checkpoint_fingerprint(path: str | None) -> str:
    """What identifies a checkpoint across hosts, cheaply: each file's relative name, size and a few 64 KiB
    samples of its bytes (two fine-tunes of one model have the same names and sizes), or the name itself when it
    is no local directory (a hub id)."""
    root = Path(path).expanduser() if path else None
    if root is None or not root.is_dir():
        return str(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(root)}\0{size}\0".encode())
        with f.open("rb") as fh:
            for i in range(SAMPLES):
                fh.seek(size * i // SAMPLES)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def flag_fields(ap: argparse.ArgumentParser, args: argparse.Namespace, target: str,
                assistant: str | None) -> dict[str, str]:
    """What must be the same on every process, by name: the agreed groups' flags, the checkpoints' fingerprints
    (`target`, `assistant`: their resolved paths), the package's code and the JAX it runs on."""
    import jaxlib

    fields = {"package code": source_digest()[:16], "JAX": f"{jax.__version__} (jaxlib {jaxlib.__version__})",
              "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "--ckpt (its files)": checkpoint_fingerprint(target),
              "--assistant (its files)": checkpoint_fingerprint(assistant)}
    for group in ap._action_groups:
        if group.title in AGREED_GROUPS:
            fields.update({a.option_strings[0]: json.dumps(getattr(args, a.dest)) for a in group._group_actions
                           if a.dest not in PER_HOST})
    return fields


class Job:
    """This process's part of a multi-process server: its watch, and on process 0 the publisher."""

    def __init__(self, peer_timeout_s: float):
        self.process_id, self.num_processes = jax.process_index(), jax.process_count()
        self.watch = Watch(peer_timeout_s)
        self.publisher: Publisher | None = None
        self.watch.start()

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    def check_flags(self, ap: argparse.ArgumentParser, args: argparse.Namespace, target: str,
                    assistant: str | None) -> None:
        """Raise ConfigMismatch unless every process has the same flags, checkpoints, code and JAX."""
        agree("configuration", flag_fields(ap, args, target, assistant), START_TIMEOUT_S)

    def check_engine(self, engine: Engine) -> None:
        """Raise ConfigMismatch unless every process planned the same KV pools (from its own free device memory
        when --kv-cache-memory is not given)."""
        pages = {g: engine.layout.pages(g) for g, _ in engine.layout.pages_per_seq}
        agree("KV pools", {"pages per group (set --kv-cache-memory to make them equal)": json.dumps(pages)},
              ENGINE_TIMEOUT_S)

    def lead(self, engine: Engine) -> None:
        self.publisher = lead(engine)

    def follow(self, engine: Engine) -> int:
        """A follower's life after start-up: run process 0's program calls until it says stop (0), or until the job
        fails (exits 1). SIGTERM or SIGINT here asks process 0 to stop the job."""
        def stop(sig, frame):
            name = signal.Signals(sig).name
            log.info("received %s: asking process 0 to stop the job", name)
            self.watch.request_stop(f"process {self.process_id} received {name}")

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info("process %d of %d: following process 0's program calls", self.process_id, self.num_processes)
        try:
            calls = follow(engine, self.watch)
        except Exception as e:  # noqa: BLE001 - whatever stops a follower stops the job
            self.exit(1, f"process {self.process_id} stopped following: {e}")
        self.watch.close()
        log.info("process 0 stopped the job after %d program calls", calls)
        return 0

    def finish(self) -> int:
        """Process 0, its server stopped: tell the followers to stop (0), or exit 1 if the job failed."""
        if self.watch.failure is not None:
            self.exit(1, self.watch.failure)
        self.watch.close()
        if self.publisher is not None:
            self.publisher.stop()
            log.info("told the other %d process(es) to stop after %d program calls (%.1f ms each to publish)",
                     self.num_processes - 1, self.publisher.calls - 1,
                     1e3 * self.publisher.publish_seconds / max(1, self.publisher.calls))
        return 0

    def exit(self, status: int, reason: str) -> NoReturn:
        """End this process now with `status`, after telling the others why (Watch.leave)."""
        log.error("%s", reason)
        self.watch.fail(reason)
        self.watch.leave(status)


def start(args: argparse.Namespace) -> Job | None:
    """Join the job the flags (or $JAX_COORDINATOR_ADDRESS ...) name and start watching it; None for one process."""
    if not distributed.initialize(args.coordinator_address, args.num_processes, args.process_id):
        return None
    return Job(args.peer_timeout_seconds)


def serve_settings(args: argparse.Namespace) -> list[str]:
    """Refuse what a multi-process server cannot do, and set what it needs; returns what changed, to log."""
    n = len(jax.devices())
    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size must be 1 in a multi-process server (run one server per host "
                         "behind a load balancer for replicas)")
    if args.tensor_parallel_size != n:
        raise ValueError(f"--tensor-parallel-size must be {n} in this job: the engine spans every device of its "
                         f"{jax.process_count()} processes")
    changed = []
    if args.compile_in_background:
        # Every program compiled before serving on every process: no process compiles while its peers wait for
        # it inside a collective, and every process times the same round sizes at start in the same order.
        args.compile_in_background = False
        changed.append("--no-compile-in-background (every process compiles every program before serving)")
    return changed

