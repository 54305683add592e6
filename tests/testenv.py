"""Where the suite runs: kernels compile on the GPU and run in interpret mode elsewhere (conftest.py sets the
platform before this is imported). And what tests read from compiled programs."""

import contextlib
import re
from typing import Iterator

import jax

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


@contextlib.contextmanager
def compilations() -> Iterator[list[float]]:
    """The XLA compilations inside the block, as their durations (a test of "nothing compiles while serving"). JAX
    keeps a listener for the process's life: this one stops recording when the block ends."""
    seen, listening = [], [True]

    def on_event(event: str, duration: float, **kw) -> None:
        if listening[0] and event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seen
    finally:
        listening[0] = False


def hlo_parameter_users(text: str, shape: str) -> list[str]:
    """The ENTRY instructions of an optimized HLO module (`compiled.as_text()`) that take its one parameter of
    `shape` (e.g. "s32[2,48]") as an operand."""
    entry = text[text.index("\nENTRY "):]
    entry = entry[: entry.index("\n}")]
    params = re.findall(rf"(%\S+) = {re.escape(shape)}(?:\{{[^}}]*\}})? parameter\(", entry)
    assert len(params) == 1, f"one parameter of shape {shape}: {params}"
    return [line.strip()[:160] for line in entry.splitlines()
            if re.search(rf"[(,]\s*{re.escape(params[0])}[,)]", line) and " parameter(" not in line]


def hlo_outputs_of_their_own(text: str) -> list[int]:
    """The outputs of an optimized HLO module (`compiled.as_text()`) that alias no parameter, by index: each lives
    in an allocation of its own, one XLA may also fill with temporaries before the output is written."""
    header = text.splitlines()[0]
    aliased = {int(i) for i in re.findall(r"\{(\d+)\}: \(\d+, ", header)}
    result = header[header.index(")->") + 3:]
    depth, count = 0, 1
    for ch in result:  # top-level commas of the result tuple "(s32[2,4]{1,0}, f32[...]{...}, ...)"
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            break
        count += ch == "," and depth == 1
    return [i for i in range(count) if i not in aliased]


def kl_and_top1(reference, approx) -> tuple[float, float]:
    """(mean KL(softmax(reference) || softmax(approx)) in nats, share of positions where the argmaxes agree), over
    the leading axes of two logit arrays [..., V]: how far a quantized model's next-token law strays from the exact
    one, the measure the fp8 accuracy tests bound."""
    import numpy as np

    ref = np.asarray(reference, np.float64).reshape(-1, np.shape(reference)[-1])
    got = np.asarray(approx, np.float64).reshape(-1, np.shape(approx)[-1])
    log_p = ref - ref.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = got - got.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))
    return kl, float(np.mean(ref.argmax(-1) == got.argmax(-1)))
