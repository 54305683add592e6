"""The assistant trainer (gemma4_mtp_jax/train, `python -m gemma4_mtp_jax.train assistant`), on the tiny transformers-
built pairs of hf_tiny.py (CPU, float32).

One training run is shared by the module (`trained`): a fresh assistant for the tiny e2b target (PLE, KV-shared
layers, so the default architecture has the centroid head), 40 steps of k=3 rounds on random token ids, half of the
training sequences replaced by the target's own continuations, checkpoints at steps 20 and 40.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_tiny
from hf_tiny import assert_close

K = 3
SEQ = 48
ARGS = ["--steps", "40", "--batch-size", "4", "--seq-len", str(SEQ), "--positions-per-seq", "16", "--k", str(K),
        "--lr", "1e-2", "--warmup-steps", "4", "--prompt-len", "12", "--self-distill-fraction", "0.5",
        "--gen-batch", "4", "--save-every", "20", "--keep-checkpoints", "2", "--centroid-fit-batches", "32",
        "--centroid-fit-steps", "500", "--max-heldout-seqs", "8", "--heldout-fraction", "0.1", "--seed", "3"]


def _run(argv: list[str]) -> int:
    from gemma4_mtp_jax.train.cli import main

    return main(argv)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """80 documents of random token ids (.npy, one document per row)."""
    path = tmp_path_factory.mktemp("corpus") / "ids.npy"
    np.save(path, np.random.default_rng(0).integers(3, hf_tiny.VOCAB, size=(80, SEQ)).astype(np.int32))
    return path


@pytest.fixture(scope="module")
def trained(tiny_ckpts, corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run") / "assistant"
    argv = ["--target", str(tiny_ckpts["e2b"]["target"]), "--data", str(corpus), "--out", str(out), *ARGS]
    assert _run(argv) == 0
    return out, json.loads((out / "eval.json").read_text())


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------------------------
# The objective is the served draft round
# ----------------------------------------------------------------------------------------------------------------------
def test_objective_is_the_served_draft_round(tiny_ckpts, jax_models):
    """draft_rounds on a whole sequence, at bonus positions P, equals draft_step run k times on the target forward of
    the prefix 0..P-1 alone (its K/V and last hidden; x_P fed; the greedy draft and h_next fed back), and the
    teacher at step j is the target's distribution at P+j-1. No gradient reaches the target's parameters."""
    import gemma4_mtp_jax as g
    from gemma4_mtp_jax.train import arch
    from gemma4_mtp_jax.train.objective import Objective, draft_rounds, round_loss, target_log_probs, target_pass

    p = tiny_ckpts["e2b"]
    target = jax_models.target(p["target"])
    served = jax_models.assistant(p["assistant"])
    params, _ = arch.dense_params(served)  # the training form of the released-style centroid assistant
    module = g.Assistant(arch.dense(served.config), params, jnp.float32, served.path, {})
    tokens = np.random.default_rng(4).integers(3, hf_tiny.VOCAB, size=(2, 24)).astype(np.int32)
    Ps = [1, 13]  # the first possible P, and one whose sliding layers see only the last W+1 = 9 keys
    positions = np.array([Ps, Ps[::-1]], np.int32)

    @jax.jit
    def rounds(pa, pt, tokens, positions):
        tp = target_pass(target.module, pt, tokens)
        return tp, draft_rounds(module.module, target.module, pa, pt, tokens, tp, positions, K), \
            target_log_probs(target.module, pt, tp, positions, K)

    tp, drafts, log_p = rounds(params, target.params, jnp.asarray(tokens), jnp.asarray(positions))
    full = g.target_forward(target, tokens)
    for P in Ps:
        prefix = g.target_forward(target, tokens[:, :P])  # the committed tokens alone
        tok, h = tokens[:, P], prefix.hidden[:, -1]
        for j in range(K):
            d = g.draft_step(module, target, tok, h, prefix.store_kv, np.array([P, P]))
            for b in range(2):
                n = list(positions[b]).index(P)
                where = f"row {b} P={P} step {j + 1}"
                assert_close(f"{where} draft log-probs", drafts.log_q[b, n, j], jax.nn.log_softmax(d.logits[b]))
                assert int(drafts.tokens[b, n, j]) == int(jnp.argmax(d.logits[b])), where
                assert_close(f"{where} teacher", log_p[b, n, j], jax.nn.log_softmax(full.logits[b, P + j]))
            tok, h = np.asarray(jnp.argmax(d.logits, -1)), d.h_next

    @jax.jit
    def grad_target(pt):  # the loss's gradient with respect to the target's parameters
        def loss(pt):
            tp = target_pass(target.module, pt, jnp.asarray(tokens))
            return round_loss(Objective(K), module.module, target.module, params, pt, jnp.asarray(tokens), tp,
                              jnp.asarray(positions), jnp.ones(positions.shape, bool))[0]

        return jax.grad(loss)(pt)

    grad_t = grad_target(target.params)
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree_util.tree_leaves(grad_t)), "gradient into the target"


# ----------------------------------------------------------------------------------------------------------------------
# The training run
# ----------------------------------------------------------------------------------------------------------------------
def test_loss_goes_down(trained):
    """Training loss over the 40 steps, and the held-out loss and greedy acceptance before vs after."""
    out, report = trained
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 41))
    first, last = np.mean([r["loss"] for r in log[:8]]), np.mean([r["loss"] for r in log[-8:]])
    assert last < 0.8 * first, (first, last)  # ~0.69 (the random target's own entropy bounds the cross-entropy)
    before, after = report["heldout_initial"], report["heldout_trained_dense_head"]
    assert after["all"]["loss"] < 0.9 * before["all"]["loss"], (before["all"]["loss"], after["all"]["loss"])
    for j in range(K):
        assert after["all"]["kl_per_step"][j] < 0.85 * before["all"]["kl_per_step"][j]
    acc_before, acc_after = (r["target_greedy"]["acceptance_per_position"][0] for r in (before, after))
    assert acc_after > acc_before + 0.2, (acc_before, acc_after)  # 0.0 -> ~0.36
    data = report["data"]
    assert data["train_self_distilled"] == data["train_sequences"] // 2 and data["heldout_greedy"] > 0
    served = report["heldout_served"]["target_greedy"]
    assert served["pairs"] > 0 and served["expected_accepted_per_round"] == pytest.approx(
        sum(served["acceptance_per_position"]))


def test_checkpoint_loads_here_in_the_converter_and_in_transformers(trained, tiny_ckpts, tmp_path):
    """The written directory loads with load_assistant, the Orbax converter and transformers'
    Gemma4AssistantForCausalLM; transformers' first draft step agrees with ours within 1e-4 (float32)."""
    import gemma4_mtp_jax as g
    from checkpoints_convert import convert

    out, _ = trained
    assert json.loads((out / "generation_config.json").read_text())["num_assistant_tokens"] == K
    p = tiny_ckpts["e2b"]
    assistant = g.load_assistant(out)
    assert assistant.config.use_ordered_embeddings and assistant.config.num_centroids == 16
    target = g.load_target(p["target"])
    tokens = np.random.default_rng(7).integers(3, hf_tiny.VOCAB, size=(2, 13)).astype(np.int32)
    fwd = g.target_forward(target, tokens)
    bonus = jnp.argmax(fwd.logits[:, -1], -1)
    d = g.draft_step(assistant, target, bonus, fwd.hidden[:, -1], fwd.store_kv, np.array([13, 13]))
    for b in range(2):
        ref = hf_tiny.hf_draft_steps(p["target"], out, tokens[b:b + 1], 1)[0]
        assert ref["token"] == int(bonus[b])
        assert_close(f"row {b} logits vs transformers", d.logits[b], ref["logits"])
        assert_close(f"row {b} h_next vs transformers", d.h_next[b], ref["h_next"])

    convert(str(out), str(tmp_path / "orbax"), log=lambda _: None)
    orbax = g.load_assistant(tmp_path / "orbax")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(assistant.params),
                            jax.tree_util.tree_leaves(orbax.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_speculative_greedy_with_the_trained_assistant_is_lossless(trained, tiny_ckpts):
    """The trained assistant drafts in the engine; greedy speculative output equals plain greedy output, the trained
    drafts do get accepted, and every round's accepted count is the one the training objective's greedy acceptance
    gives at that round's bonus position (the objective scores exactly the rounds the engine runs)."""
    import gemma4_mtp_jax as g
    from gemma4_mtp_jax.engine import Engine, EngineConfig
    from gemma4_mtp_jax.generate import generate
    from gemma4_mtp_jax.train.objective import draft_rounds, target_log_probs, target_pass

    out, _ = trained
    target = g.load_target(tiny_ckpts["e2b"]["target"])
    assistant = g.load_assistant(out)
    cfg = dict(max_num_seqs=2, max_model_len=64, page_size=4, prefill_chunk=16, min_prefill_bucket=16)
    L, new = 14, 24
    prompts = np.random.default_rng(11).integers(3, hf_tiny.VOCAB, size=(4, L)).tolist()
    plain = generate(target, prompts, new, engine=Engine(target, EngineConfig(**cfg)))
    spec = generate(target, prompts, new, engine=Engine(target, EngineConfig(**cfg), assistant=assistant))
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert len({t for r in plain for t in r.tokens}) > 8, "degenerate reference: the test would prove little"
    assert all(r.stats["drafted"] == K * r.stats["rounds"] for r in spec)
    rounds = [r.stats["accepted_per_round"] for r in spec]
    assert sum(map(sum, rounds)) > 0

    @jax.jit
    def accepted(tokens, positions):  # greedy drafts accepted per round under the objective's convention
        tp = target_pass(target.module, target.params, tokens)
        d = draft_rounds(assistant.module, target.module, assistant.params, target.params, tokens, tp, positions, K)
        greedy = jnp.argmax(target_log_probs(target.module, target.params, tp, positions, K), -1)
        return jnp.sum(jnp.cumprod(d.tokens == greedy, -1), -1)

    tokens = np.array([p + r.tokens for p, r in zip(prompts, plain)], np.int32)
    starts = [list(L + np.cumsum([0] + [n + 1 for n in rs[:-1]])) for rs in rounds]  # round r's bonus position
    checked = [[i for i, P in enumerate(st) if P + K <= L + new - 1] for st in starts]  # whole round in the text
    width = max(len(c) for c in checked)
    positions = np.array([[starts[b][i] for i in c] + [L] * (width - len(c)) for b, c in enumerate(checked)])
    got = np.asarray(accepted(jnp.asarray(tokens), jnp.asarray(positions, np.int32)))
    for b, c in enumerate(checked):
        assert got[b, :len(c)].tolist() == [rounds[b][i] for i in c], f"prompt {b}: rounds at {positions[b]}"
    assert sum(map(len, checked)) >= 20


def test_resume_gives_the_uninterrupted_run(trained, tmp_path, tiny_ckpts):
    """A run stopped after its step-20 checkpoint (its out dir holding that checkpoint only) and started again with
    the same command ends with exactly the parameters and optimizer state of the uninterrupted run, and retrains
    steps 21..40 with the same losses; the prepared data is reused, not regenerated. Changed options are refused."""
    from gemma4_mtp_jax.train import checkpoint

    out, _ = trained
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [20, 40]
    resumed = tmp_path / "assistant"
    resumed.mkdir()
    for name in ("run.json", "eval_initial.json", "data"):
        (shutil.copytree if (out / name).is_dir() else shutil.copy)(out / name, resumed / name)
    (resumed / "checkpoints").mkdir()
    shutil.copytree(out / "checkpoints" / "step_00000020", resumed / "checkpoints" / "step_00000020")
    (resumed / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _log(out)[:20]))
    data_before = (resumed / "data" / "train.npz").read_bytes()

    argv = ["--target", str(tiny_ckpts["e2b"]["target"]), "--out", str(resumed), *ARGS]
    assert _run([*argv[:-2], "--seed", "4"]) == 2  # a changed option: refused before anything is trained
    assert _run(argv) == 0
    final = "checkpoints/step_00000040/state.msgpack"
    assert (resumed / final).read_bytes() == (out / final).read_bytes()
    assert [r["loss"] for r in _log(resumed)] == [r["loss"] for r in _log(out)]
    assert (resumed / "data" / "train.npz").read_bytes() == data_before
    assert (resumed / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


# ----------------------------------------------------------------------------------------------------------------------
# The centroid head
# ----------------------------------------------------------------------------------------------------------------------
def test_balanced_kmeans_gives_equal_clusters_and_a_permutation():
    """Exactly V/C rows per cluster and a permutation, for clustered and for structureless rows; on clustered rows
    k-means recovers the planted clusters."""
    from gemma4_mtp_jax.train.centroids import cluster_of_tokens, fit_centroid_head

    rng = np.random.default_rng(0)
    V, C, d = 512, 16, 24
    planted = rng.permutation(np.repeat(np.arange(C), V // C))
    clustered = 4.0 * rng.standard_normal((C, d))[planted] + 0.3 * rng.standard_normal((V, d))
    for rows in (clustered, rng.standard_normal((V, d))):
        centroids, ordering = fit_centroid_head(rows.astype(np.float32), C, 10, seed=1, progress=False)
        assert centroids.shape == (C, d)
        assert np.array_equal(np.sort(ordering), np.arange(V))
        cluster = cluster_of_tokens(ordering, C)
        assert np.array_equal(np.bincount(cluster, minlength=C), np.full(C, V // C))
    cluster = cluster_of_tokens(fit_centroid_head(clustered.astype(np.float32), C, 10, seed=1, progress=False)[1], C)
    # the same partition up to cluster names: every planted cluster maps to one found cluster
    assert all(len(set(cluster[planted == c])) == 1 for c in range(C))


def test_trained_centroid_head(trained):
    """The written head: token_ordering is a permutation with V/C tokens per centroid, the centroids are fitted (not
    the dense head's cluster means), and the coverage check was made on held-out data and is reported."""
    import gemma4_mtp_jax as g
    from gemma4_mtp_jax.train.centroids import cluster_means, cluster_of_tokens

    out, report = trained
    a = g.load_assistant(out)
    me = a.params["masked_embedding"]
    ordering = np.asarray(me["token_ordering"])
    assert np.array_equal(np.sort(ordering), np.arange(hf_tiny.VOCAB))
    cluster = cluster_of_tokens(ordering, 16)
    assert np.array_equal(np.bincount(cluster), np.full(16, hf_tiny.VOCAB // 16))
    canonical = np.empty_like(np.asarray(me["ordered_embedding"]))
    canonical[ordering] = np.asarray(me["ordered_embedding"])
    assert not np.allclose(np.asarray(me["centroids"]["weight"]), cluster_means(canonical, cluster, 16))
    cov = report["heldout_trained_dense_head"]["centroid_coverage"]
    assert len(cov["per_step"]) == K and 0.0 <= cov["mean"] <= 1.0 and cov["goal"] == 0.99
    print(f"\n[centroid coverage on held-out data] {cov['mean']:.4f} per step {cov['per_step']}")
    assert cov["mean"] > 0.9  # 16 clusters, top 4: the means alone cover ~0.65 here


# ----------------------------------------------------------------------------------------------------------------------
# Default architectures and the writer, every family
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_default_architecture_written_and_read_by_transformers(family, tiny_ckpts, tmp_path):
    """The default assistant for each tiny target (centroid head for the PLE target e2b, dense for the others,
    whose full layers have other K/V geometry) is accepted by our config checks and, initialised and written,
    loads in transformers with the same first draft step as ours."""
    import gemma4_mtp_jax as g
    from gemma4_mtp_jax.model.config import read_config_json
    from gemma4_mtp_jax.train import arch
    from gemma4_mtp_jax.train.centroids import fit_centroid_head
    from gemma4_mtp_jax.train.export import checkpoint_tensors, generation_config, write_assistant

    tdir = tiny_ckpts[family]["target"]
    target = g.load_target(tdir)
    cfg_json = arch.default_assistant_config(read_config_json(tdir), target.config)
    acfg = arch.parse_for_target(cfg_json, target.config, "default")
    assert acfg.use_ordered_embeddings == (family == "e2b")
    params = arch.init_params(acfg, seed=5)
    centroids = ordering = None
    if acfg.use_ordered_embeddings:
        centroids, ordering = fit_centroid_head(arch.canonical_head(params), acfg.num_centroids, 3, 0, progress=False)
    write_assistant(tmp_path, cfg_json, generation_config({}, 2),
                    checkpoint_tensors(params, jnp.float32, centroids, ordering), jnp.float32)
    assistant = g.load_assistant(tmp_path)
    tokens = np.random.default_rng(3).integers(3, hf_tiny.VOCAB, size=(1, 11)).astype(np.int32)
    fwd = g.target_forward(target, tokens)
    d = g.draft_step(assistant, target, jnp.argmax(fwd.logits[:, -1], -1), fwd.hidden[:, -1], fwd.store_kv,
                     np.array([11]))
    ref = hf_tiny.hf_draft_steps(tdir, tmp_path, tokens, 1)[0]
    assert_close(f"{family} logits vs transformers", d.logits[0], ref["logits"])
    assert_close(f"{family} h_next vs transformers", d.h_next[0], ref["h_next"])


# ----------------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------------
def test_data_files(tmp_path):
    """Text (with the demo's byte tokenizer), .jsonl (text and ids), .ids and .npy files, directories searched; errors
    name the file and line."""
    from gemma4_mtp_jax.weights.demo import build_random_pair
    from gemma4_mtp_jax.generate import load_tokenizer
    from gemma4_mtp_jax.train.data import DataError, data_files, read_documents, windows

    tok = load_tokenizer(build_random_pair()[0])
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("héllo")
    (d / "sub" / "b.jsonl").write_text('{"text": "hi"}\n\n{"ids": [7, 8, 9]}\n')
    (d / "c.ids").write_text("1 2 3\n4,5\n")
    np.save(d / "d.npy", np.arange(6, dtype=np.int64).reshape(2, 3))
    (d / "ignored.bin").write_bytes(b"\x00")
    files = data_files([str(d)])
    assert [f.name for f in files] == ["a.txt", "c.ids", "d.npy", "b.jsonl"]
    docs = [doc.tolist() for f in files for doc in read_documents(f, tok, 512)]
    assert docs[0] == tok.encode("héllo").ids and len(docs[0]) == 1 + len("héllo".encode())  # <bos> + bytes
    assert docs[1:] == [[1, 2, 3], [4, 5], [0, 1, 2], [3, 4, 5], tok.encode("hi").ids, [7, 8, 9]]
    assert [w.tolist() for w in windows(np.arange(10), 4, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    (d / "bad.ids").write_text("1 2\n3 x\n")
    with pytest.raises(DataError, match=r"bad\.ids:2"):
        list(read_documents(d / "bad.ids", tok, 512))
    (d / "big.ids").write_text("1 600\n")
    with pytest.raises(DataError, match=r"big\.ids:1: token id 600 is outside"):
        list(read_documents(d / "big.ids", tok, 512))
    with pytest.raises(DataError, match=r"a\.txt: text data needs the target's tokenizer"):
        list(read_documents(d / "a.txt", None, 512))
    with pytest.raises(DataError, match="no such file"):
        data_files([str(tmp_path / "missing")])


# ----------------------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------------------
def test_train_commands_reach_their_own_parsers(capsys, tmp_path):
    """`python -m gemma4_mtp_jax.train COMMAND ...` hands everything after COMMAND, --help included, to that command's
    parser (each lists an option only it has), and runs the command; a missing or unknown command is a usage error."""
    from gemma4_mtp_jax.train.__main__ import main

    for command, own_option in (("assistant", "--init"), ("demo", "--install")):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and out.startswith(f"usage: python -m gemma4_mtp_jax.train {command} "), out
        assert own_option in out, out
    missing = tmp_path / "missing"
    assert main(["assistant", "--target", str(missing), "--data", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {missing}: no such checkpoint directory" in capsys.readouterr().err
    for argv, error in (([], "required: COMMAND"), (["nope"], "invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and error in capsys.readouterr().err
