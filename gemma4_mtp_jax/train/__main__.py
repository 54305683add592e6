"""`python -m gemma4_mtp_jax.train COMMAND ...`: the training commands (both need the `train` extra, optax).

`python -m gemma4_mtp_jax.train COMMAND --help` lists a command's options.
"""

from __future__ import annotations

import argparse
import sys

from gemma4_mtp_jax.train import entry_point

PROG = "python -m gemma4_mtp_jax.train"

# command -> (the module whose `main` runs it, its line in --help)
COMMANDS = {
    "assistant": ("gemma4_mtp_jax.train.cli",
                  "train an MTP assistant (drafter) for a frozen Gemma 4 target"),
    "demo": ("gemma4_mtp_jax.train.demo_recipe",
             "build the trained demo pair (target from scratch, then its assistant) from a public-domain corpus"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description="Train a Gemma 4 MTP assistant, or the demo pair from scratch (the `train` extra).",
        epilog=f"`{PROG} COMMAND --help` lists a command's options.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_line) in COMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False)  # the command's own parser handles its options
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only the command's name is parsed here: everything after it, --help included, belongs to the command.
    command = build_parser().parse_args(argv[:1]).command
    return entry_point(COMMANDS[command][0])(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
