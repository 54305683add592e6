"""``python -m checkpoints_convert`` / ``gemma4-convert``: Hugging Face safetensors -> Orbax.

Exit codes: 0 success; 2 user error (one line on stderr, no traceback); 1 unexpected failure.
"""

from __future__ import annotations

import argparse
import sys

from checkpoints_convert import DTYPES, QUANTIZATIONS, ConvertError, convert

EPILOG = """\
The model kind comes from config.json's model_type: gemma4 / gemma4_text / gemma4_unified /
gemma4_unified_text -> target, gemma4_assistant / gemma4_unified_assistant -> MTP assistant (drafter). The output directory receives params/ (Orbax),
gemma4_mtp_jax.json (metadata), config.json, generation_config.json and the tokenizer files;
pass it to gemma4_mtp_jax.load_target / load_assistant or to `python -m gemma4_mtp_jax.serve --ckpt`.

examples:
  python -m checkpoints_convert --hf ~/models/gemma-4-E2B-it --out ckpt/e2b
  python -m checkpoints_convert --hf google/gemma-4-E2B-it-assistant --out ckpt/e2b-assistant --dtype bfloat16
  python -m checkpoints_convert --hf google/gemma-4-31B-it --out ckpt/31b-fp8 --dtype bfloat16 --quantize fp8
  python -m checkpoints_convert --hf google/gemma-4-12B-it --out ckpt/12b --dtype bfloat16
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face Gemma 4 checkpoint (target or MTP assistant, safetensors) "
        "into a gemma4_mtp_jax Orbax checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hf",
        required=True,
        metavar="DIR_OR_HUB_ID",
        help="source: a local Hugging Face checkpoint directory (config.json + model.safetensors or "
        "sharded model-*.safetensors with model.safetensors.index.json), or a hub id such as "
        "google/gemma-4-E2B-it, which is downloaded first",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="destination directory; created if missing, must be empty unless --force",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="store floating-point weights in this dtype (integer tensors such as the assistant's "
        "token_ordering are stored as int32); default: the checkpoint's own dtype (config.json "
        "'dtype' / 'torch_dtype', else bfloat16)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: store the weights as float8_e4m3fn with per-output-channel float32 scales (weight-only; "
        "embeddings, norms and the router stay in --dtype), loaded quantized by default; none: store an fp8 "
        "source (e.g. a compressed-tensors FP8 checkpoint) dequantized to --dtype. Default: the source's own",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing checkpoint (or other files) in --out",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert(args.hf, args.out, dtype=args.dtype, quantize=args.quantize, force=args.force)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # CheckpointError and the loader's validation errors
        msg = " ".join(str(e).split()) or type(e).__name__
        where = "" if (args.hf in msg or "/" in msg.split(":")[0]) else f"{args.hf}: "
        print(f"error: {where}{msg}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
