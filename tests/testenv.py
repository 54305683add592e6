"""Where the suite runs: kernels compile on the GPU and run in interpret mode elsewhere (conftest.py sets the
platform before this is imported)."""

import jax

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
