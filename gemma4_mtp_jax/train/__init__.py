"""Training MTP assistants (drafters) for a frozen Gemma 4 target.

objective.py   the loss: k-step draft rounds at many bonus positions, against the target's distributions
arch.py        the assistant's config (default from the target), initial parameters, dense-head training form
data.py        corpus reading, sequences, the target's own continuations, held-out split
trainer.py     AdamW + warmup/cosine, the compiled train/eval steps, the loop, the held-out evaluation
centroids.py   balanced k-means for the centroid head (E2B/E4B style) and its coverage check
checkpoint.py  resumable training checkpoints
export.py      the Hugging Face checkpoint directory
cli.py         `python -m gemma4_mtp_jax.train_assistant`
"""
