"""`python -m gemma4_mtp_jax.serve [--ckpt ...] [--assistant ...]`: the OpenAI-compatible server (see --help)."""

from gemma4_mtp_jax.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
