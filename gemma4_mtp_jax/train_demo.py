"""`python -m gemma4_mtp_jax.train_demo --corpus DIR --out DIR [--install]`: build the trained demo pair (target
trained from scratch, then its MTP assistant) from a public-domain corpus (gemma4_mtp_jax/train/demo_recipe.py)."""

from gemma4_mtp_jax.train import entry_point

main = entry_point("gemma4_mtp_jax.train.demo_recipe")

if __name__ == "__main__":
    raise SystemExit(main())
