"""`python -m gemma4_mtp_jax.train_assistant --target CKPT --data FILE_OR_DIR... --out DIR`: train an MTP assistant
for a frozen Gemma 4 target (gemma4_mtp_jax/train/); `--help` lists every option."""

from gemma4_mtp_jax.train import entry_point

main = entry_point("gemma4_mtp_jax.train.cli")

if __name__ == "__main__":
    raise SystemExit(main())
