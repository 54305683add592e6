"""`python -m gemma4_mtp_jax.train_assistant --target CKPT --data FILE_OR_DIR... --out DIR`: train an MTP assistant
for a frozen Gemma 4 target (gemma4_mtp_jax/train/); `--help` lists every option."""

try:
    from gemma4_mtp_jax.train.cli import main
except ModuleNotFoundError as e:  # the trainer's one extra dependency
    if e.name != "optax":
        raise
    raise SystemExit("error: the trainer needs optax: pip install -e '.[train]'") from None

if __name__ == "__main__":
    raise SystemExit(main())
