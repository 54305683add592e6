"""Training MTP assistants (drafters) for a frozen Gemma 4 target, and the demo pair from scratch.

objective.py   the loss: k-step draft rounds at many bonus positions, against the target's distributions
arch.py        the assistant's config (default from the target), initial parameters, dense-head training form
data.py        corpus reading, sequences, the target's own continuations, held-out split
trainer.py     AdamW + warmup/cosine, the compiled train/eval steps, the loop, the held-out evaluation
centroids.py   balanced k-means for the centroid head (E2B/E4B style) and its coverage check
checkpoint.py  resumable training checkpoints
export.py      the Hugging Face checkpoint directory
cli.py         `python -m gemma4_mtp_jax.train assistant`
tokenizer.py   byte-level BPE for a model trained from scratch; documents as token ids
pretrain.py    a target from scratch (next-token cross-entropy)
demo_recipe.py `python -m gemma4_mtp_jax.train demo`: tokenizer, target, assistant, the shipped pair
"""

import importlib
from typing import Callable


def entry_point(module: str) -> Callable[..., int]:
    """The `main` of a training CLI module, or a clear exit naming the extra when optax (training's one extra
    dependency) is not installed."""
    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if e.name != "optax":
            raise
        raise SystemExit("error: training needs optax: pip install -e '.[train]'") from None
