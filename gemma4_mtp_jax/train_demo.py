"""`python -m gemma4_mtp_jax.train_demo --corpus DIR --out DIR [--install]`: build the trained demo pair (target
trained from scratch, then its MTP assistant) from a public-domain corpus (gemma4_mtp_jax/train/demo_recipe.py)."""

try:
    from gemma4_mtp_jax.train.demo_recipe import main
except ModuleNotFoundError as e:  # the trainer's one extra dependency
    if e.name != "optax":
        raise
    raise SystemExit("error: training needs optax: pip install -e '.[train]'") from None

if __name__ == "__main__":
    raise SystemExit(main())
