"""The demo recipe's own parts: the byte-level BPE tokenizer and pretraining a target from scratch (the assistant's
trainer has its own tests)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_mtp_jax.weights.demo import BOS_ID, EOS_ID, SPECIALS

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife.\n\nIn the beginning, God created the heavens and the earth.\n\ndef f(x):\n    return x + 1\n")


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(TEXT * 20)
    chat = "<bos><start_of_turn>user\nHello?<end_of_turn>\n<start_of_turn>model\nGood day.<end_of_turn>\n"
    (d / "chat.jsonl").write_text(json.dumps({"text": chat}) + "\n")
    return [d / "a.txt", d / "chat.jsonl"]


@pytest.fixture(scope="module")
def tokenizer(corpus_files):
    from gemma4_mtp_jax.train.tokenizer import train_bpe

    return train_bpe(corpus_files, 320)


def test_tokenizer_is_byte_level_with_the_pairs_specials(tokenizer):
    assert [tokenizer.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    assert tokenizer.get_vocab_size() <= 320
    for s in ["Mr. Darcy bowed.", "naïve café — ünïcödé ✓ 你好", "\t\n  x=1\r\n", "\x00\x7f"]:
        enc = tokenizer.encode(s)
        assert enc.ids[0] == BOS_ID  # the post-processor prepends <bos>, as Gemma's tokenizer does
        assert tokenizer.decode(enc.ids[1:]) == s
    merged = tokenizer.encode("universally acknowledged", add_special_tokens=False).ids
    assert len(merged) <= 0.6 * len("universally acknowledged")  # merges learned from the text (bytes: 24 ids)


def test_documents_are_bos_text_eos_once(tokenizer, corpus_files):
    from gemma4_mtp_jax.train.tokenizer import encode_documents

    docs = encode_documents(tokenizer, corpus_files)
    assert len(docs) == 2
    for d in docs:
        assert d[0] == BOS_ID and d[-1] == EOS_ID and BOS_ID not in d[1:].tolist()
    chat = tokenizer.decode(docs[1].tolist(), skip_special_tokens=False)
    assert chat.startswith("<bos><start_of_turn>user\nHello?<end_of_turn>")


def test_pretraining_lowers_heldout_loss_and_exports_a_loadable_target(tokenizer, corpus_files, tmp_path):
    import jax

    from gemma4_mtp_jax.api import load_target
    from gemma4_mtp_jax.model.config import parse_target_config
    from gemma4_mtp_jax.train.demo_recipe import GENERATION_CONFIG, TARGET_CONFIG
    from gemma4_mtp_jax.train.export import target_checkpoint_tensors, write_checkpoint
    from gemma4_mtp_jax.train.pretrain import PretrainConfig, Pretrainer, init_params, pretrain
    from gemma4_mtp_jax.train.tokenizer import encode_documents

    stream = np.concatenate(encode_documents(tokenizer, corpus_files))
    cfg_json = {**TARGET_CONFIG, "vocab_size": 320, "vocab_size_per_layer_input": 320, "hidden_size": 32,
                "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16, "global_head_dim": 32,
                "sliding_window": 8, "hidden_size_per_layer_input": 8, "max_position_embeddings": 64}
    cfg = parse_target_config(cfg_json, "test")
    tc = PretrainConfig(steps=40, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=5, eval_every=20,
                        compute_dtype="float32")
    held = stream[: 5 * 33]
    before = Pretrainer(cfg, tc).heldout_loss(init_params(cfg, 0), held.reshape(5, 33), 4)
    params, summary = pretrain(cfg, stream, held, tc)
    assert summary["heldout_loss"] < before - 1.0
    assert summary["best_step"] in (20, 40) and len(summary["history"]) == 2

    write_checkpoint(tmp_path, {**cfg_json, "dtype": "float32"}, GENERATION_CONFIG,
                     target_checkpoint_tensors(params, "float32"))
    loaded = load_target(tmp_path)
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
