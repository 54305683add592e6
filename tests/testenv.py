"""Where the suite runs: kernels compile on the GPU and run in interpret mode elsewhere (conftest.py sets the
platform before this is imported). And what tests read from compiled programs."""

import re

import jax

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


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
