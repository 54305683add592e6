"""Shared pytest fixtures.

JAX runs on the CPU in float32 for the test-suite: JAX_PLATFORMS is set to "cpu" before anything imports jax (set
GEMMA4_TEST_JAX_PLATFORMS to run the suite elsewhere, e.g. "cuda"), and jax_enable_x64 stays off.

Float32 means float32 on every platform: matmuls run at precision HIGHEST for the whole session. On the CPU that
is what they do anyway; on an NVIDIA GPU the default would be TF32 (10-bit mantissa), so every comparison with
transformers or a float64 oracle would test TF32 rounding instead of our code. Pallas kernels run compiled on
the GPU and in interpret mode elsewhere (`testenv.INTERPRET`).

On the CPU, XLA compiles at LLVM -O0 (XLA_FLAGS, below): the suite's time is mostly compiling.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = os.environ.get("GEMMA4_TEST_JAX_PLATFORMS", "cpu")
os.environ["JAX_ENABLE_X64"] = "0"
# On the CPU, compiling is most of the suite's time (~3200 programs, ~1100 s of compiling threads' time in a 22-minute
# run; the tiny models' runs are the rest), and LLVM's optimization of the generated code a third of each compile.
# At -O0 the suite takes a fifth less time (21:44 -> 17:27 here) and no test runs noticeably slower. XLA's own HLO
# passes still run, and fast-math stays off at every level. The child processes the tests start inherit it.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import pytest  # noqa: E402

_TESTS_DIR = Path(__file__).resolve().parent
for _p in (_TESTS_DIR, _TESTS_DIR.parent):  # hf_tiny; the working tree's gemma4_mtp_jax / checkpoints_convert
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def pytest_configure(config):
    import jax

    jax.config.update("jax_enable_x64", False)
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_runtest_logreport(report):
    """With $GEMMA4_TEST_FAILURES_FILE set (scripts/gpu_suite.sh), each failure's report is appended to that file as
    it happens: pytest prints them only when the session ends, which a device call cut short at its time limit never
    reaches. Under xdist the controller writes (it sees every worker's reports), the workers do not."""
    path = os.environ.get("GEMMA4_TEST_FAILURES_FILE")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_freed():
    """Each module's compiled programs are freed when it ends: JAX's caches keep every program a jitted function
    compiled (module-level functions live as long as the process), and on the CPU each XLA program is ~450 memory
    mappings (one code, read-only and data mapping per kernel). Kept across the suite they passed Linux's limit of
    65530 mappings per process, and XLA:CPU then crashed compiling the next program (a segmentation fault in
    tests/test_speculative.py, which alone reaches ~45000)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict:
    """{family: {"target": Path, "assistant": Path[, "target_multimodal" | "target_sharded" | "target_text": Path]}}
    for the tiny random transformers-built checkpoints of hf_tiny.py (families "e2b", "a26b", "b31b" and the
    unified "u12b"); built once per session."""
    import hf_tiny  # torch + transformers: imported only by the tests that need them

    root = tmp_path_factory.mktemp("hf_tiny")
    t0 = time.time()
    paths = hf_tiny.build_all(root)
    print(f"\n[hf_tiny] built tiny checkpoints in {time.time() - t0:.2f}s under {root}")
    return paths


class _LazyModels:
    """Session cache of loaded JAX models: key (path, kind, dtype) -> model."""

    def __init__(self):
        self._cache = {}

    def _get(self, kind: str, path, dtype: str):
        key = (str(path), kind, dtype)
        if key not in self._cache:
            import hf_tiny

            g = hf_tiny.import_gemma4_mtp_jax()
            load = g.load_target if kind == "target" else g.load_assistant
            self._cache[key] = load(str(path), dtype=dtype)
        return self._cache[key]

    def target(self, path, dtype: str = "float32"):
        return self._get("target", path, dtype)

    def assistant(self, path, dtype: str = "float32"):
        return self._get("assistant", path, dtype)


@pytest.fixture(scope="session")
def jax_models() -> _LazyModels:
    """`jax_models.target(path, dtype)` / `jax_models.assistant(path, dtype)`, each loaded once per session."""
    return _LazyModels()
