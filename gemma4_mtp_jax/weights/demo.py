"""The demo pairs: the trained pair shipped in the package, and a tiny random-weight pair for tests.

`demo_pair()` is the embedded default of `serve` and `generate`: a small Gemma 4-shaped target (sliding and full
layers with proportional RoPE, KV-shared layers, per-layer embeddings, double-wide MLP) and its centroid-head MTP
assistant, trained on public-domain text by `python -m gemma4_mtp_jax.train demo` and shipped in bf16 under
`gemma4_mtp_jax/demo_pair/` (its MODEL_CARD.md says how and on what).

`build_random_pair()` writes a much smaller pair with random weights, deterministically, for tests that need a
checkpoint on disk but not sensible text: it exercises the same code paths at a fraction of the compile time.
Its tokenizer is byte-level (every UTF-8 string round-trips), built with the `tokenizers` library.

Both are in the Hugging Face layout, so they go through the same loader as a real checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.model.config import FULL, SLIDING

DEMO_VERSION = 4  # of the random pair's recipe (its cache directory)
# Special tokens of both pairs' tokenizers, ids 0..5; <eos> and <end_of_turn> both end a generation.
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
PAD_ID, EOS_ID, BOS_ID, END_OF_TURN_ID = 0, 1, 2, 5
_BYTE_OFFSET = len(SPECIALS)
PACKAGED = Path(__file__).resolve().parent.parent / "demo_pair"  # gemma4_mtp_jax/demo_pair
VOCAB = 512  # specials, 256 bytes, unused ids up to a multiple of the centroid count
_S, _F = SLIDING, FULL

_TARGET = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "layer_types": [_S, _S, _S, _F, _S, _S, _S, _F],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
    "num_kv_shared_layers": 3,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": [1, 5],
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "dtype": "float32",
}
_ASSISTANT = {
    "architectures": ["Gemma4AssistantForCausalLM"],
    "model_type": "gemma4_assistant",
    "backbone_hidden_size": 64,
    "use_ordered_embeddings": True,
    "num_centroids": 16,
    "centroid_intermediate_top_k": 4,
    "tie_word_embeddings": True,
    "dtype": "float32",
    "text_config": {
        "model_type": "gemma4_text",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [_S, _S, _S, _F],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "sliding_window": 16,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": 4,
        "final_logit_softcapping": None,
        "max_position_embeddings": 4096,
    },
}


def default_root() -> Path:
    base = os.environ.get("GEMMA4_MTP_JAX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "gemma4_mtp_jax")
    return Path(base) / f"demo-v{DEMO_VERSION}"


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; order by byte value so ids are byte + offset.
    mapping = _bytes_to_unicode()
    for b in range(256):
        vocab[mapping[b]] = _BYTE_OFFSET + b
    assert set(mapping.values()) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (what tokenizers' ByteLevel uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_tokenizer(directory: Path, tokenizer_json: str) -> None:
    """tokenizer.json and a tokenizer_config.json with the pairs' special tokens and chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))


def _write_checkpoint(directory: Path, config: dict, tensors: dict[str, np.ndarray], generation: dict) -> None:
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(directory, _tokenizer_json())


def _random_tensors(abstract: dict, seed: int, hf_name) -> dict[str, np.ndarray]:
    """Deterministic random weights: matrices ~ N(0, 0.2^2), norm weights ~ 1, layer_scalar in [0.5, 1.5]."""
    from gemma4_mtp_jax.weights.hf_loader import flatten_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for path, leaf in sorted(flatten_shapes(abstract).items()):
        if path.endswith("layer_scalar"):
            arr = rng.uniform(0.5, 1.5, leaf.shape)
        elif len(leaf.shape) == 1:
            arr = 1.0 + 0.3 * rng.standard_normal(leaf.shape)
        else:
            arr = 0.2 * rng.standard_normal(leaf.shape)
        out[hf_name(path)] = arr.astype(np.float32)
    return out


def _align_for_acceptance(target: dict, assistant: dict, rng: np.random.Generator, alpha: float = 0.5) -> None:
    """Random models never agree, so the demo's drafts would all be rejected. Make both lean towards the same
    thing: shrink both models' residual branches (they then tend to continue the current token) and give the
    assistant a pre_projection and head aligned with the target's embedding (it then predicts the token it is
    fed). Still random everywhere else, so acceptance is partial, which is what a demo of drafting should show."""
    for weights, scale in ((target, alpha), (assistant, 0.35)):
        for name in list(weights):
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
                              "post_per_layer_input_norm.weight")):
                weights[name] = (weights[name] * scale).astype(np.float32)
    E = target["model.embed_tokens.weight"]  # [V, Hb]
    Hb, Ha = E.shape[1], assistant["model.norm.weight"].shape[0]
    M = np.linalg.qr(rng.standard_normal((Hb, Ha)))[0].T  # [Ha, Hb], orthonormal rows
    pre = assistant["pre_projection.weight"].copy()  # [Ha, 2*Hb]: the first half reads the token embedding
    pre[:, :Hb] = M
    pre[:, Hb:] *= 0.25
    assistant["pre_projection.weight"] = pre.astype(np.float32)
    head = E @ M.T
    assistant["model.embed_tokens.weight"] = (head / np.linalg.norm(head, axis=-1).mean()).astype(np.float32)
    assistant["model.norm.weight"] = np.ones_like(assistant["model.norm.weight"])


def demo_pair() -> tuple[Path, Path]:
    """(target, assistant) directories of the trained pair shipped in the package."""
    tdir, adir = PACKAGED / "target", PACKAGED / "assistant"
    for d in (tdir, adir):
        if not (d / "model.safetensors").is_file():
            raise FileNotFoundError(f"{d / 'model.safetensors'}: the packaged demo pair is missing (an install "
                                    "without package data?); rebuild it with python -m gemma4_mtp_jax.train demo")
    return tdir, adir


def resolve(target: str | os.PathLike | None, assistant: str | os.PathLike | None) -> tuple[str | None, str | None]:
    """Command-line checkpoint arguments with the name 'demo' replaced by the packaged pair's directory (the
    target's for a target argument, the assistant's for an assistant argument); other values pass unchanged."""
    if "demo" not in (target, assistant):
        return target, assistant
    t_dir, a_dir = demo_pair()
    return (str(t_dir) if target == "demo" else target), (str(a_dir) if assistant == "demo" else assistant)


def build_random_pair(root: str | os.PathLike | None = None, force: bool = False) -> tuple[Path, Path]:
    """Write the random-weight test pair under `root` (default ~/.cache/gemma4_mtp_jax/demo-vN) unless there."""
    from gemma4_mtp_jax.api import abstract_assistant_params, abstract_target_params
    from gemma4_mtp_jax.model.config import parse_assistant_config, parse_target_config
    from gemma4_mtp_jax.weights.hf_loader import flax_to_hf_name

    root = Path(root) if root else default_root()
    tdir, adir = root / "target", root / "assistant"
    if not force and (tdir / "model.safetensors").is_file() and (adir / "model.safetensors").is_file():
        return tdir, adir
    tcfg = parse_target_config(_TARGET)
    acfg = parse_assistant_config(_ASSISTANT)
    t = _random_tensors(abstract_target_params(tcfg, jnp.float32), 1234, lambda p: "model." + flax_to_hf_name(p))

    a_abs = abstract_assistant_params(acfg, jnp.float32)
    head = a_abs.pop("masked_embedding")["ordered_embedding"]  # stored canonical-order as embed_tokens
    rng = np.random.default_rng(91011)
    a = _random_tensors(a_abs, 5678,
                        lambda p: ("" if p.startswith(("pre_", "post_")) else "model.") + flax_to_hf_name(p))
    C = _ASSISTANT["num_centroids"]
    order = rng.permutation(VOCAB).astype(np.int64)
    a["model.embed_tokens.weight"] = (0.2 * rng.standard_normal(head.shape)).astype(np.float32)
    _align_for_acceptance(t, a, rng)
    table = a["model.embed_tokens.weight"]
    # Centroids as cluster means of the head rows, as a trained k-means head would roughly be.
    a["masked_embedding.centroids.weight"] = table[order.reshape(C, -1)].mean(1).astype(np.float32)
    a["masked_embedding.token_ordering"] = order

    gen = {"bos_token_id": 2, "eos_token_id": [1, 5], "pad_token_id": 0}
    _write_checkpoint(tdir, _TARGET, t, gen)
    _write_checkpoint(adir, _ASSISTANT, a, {**gen, "num_assistant_tokens": 4})
    return tdir, adir


def main() -> None:
    import argparse
    import time

    from gemma4_mtp_jax import api as g

    ap = argparse.ArgumentParser(description="Run the demo pair's target and one draft round on a prompt.")
    ap.add_argument("--random", metavar="ROOT", help="use the random-weight test pair, built under ROOT")
    ap.add_argument("--prompt", default="It is a truth universally acknowledged")
    args = ap.parse_args()
    t0 = time.time()
    tdir, adir = build_random_pair(args.random) if args.random else demo_pair()
    print(f"demo pair: {tdir} and {adir} ({time.time() - t0:.1f}s)")
    target, assistant = g.load_target(tdir), g.load_assistant(adir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    ids = tok.encode(args.prompt).ids
    out = g.target_forward(target, np.array([ids]))
    bonus = int(jnp.argmax(out.logits[0, -1]))
    kv = out.store_kv
    h, token, drafts = out.hidden[:, -1], np.array([bonus]), []
    for _ in range(4):
        d = g.draft_step(assistant, target, token, h, kv, np.array([len(ids)]))
        token, h = np.asarray(jnp.argmax(d.logits, -1)), d.h_next
        drafts.append(int(token[0]))
    print(json.dumps({"prompt_ids": ids, "next_token": bonus, "drafts": drafts}))


if __name__ == "__main__":
    main()
