"""`python -m checkpoints_convert`: HF safetensors -> Orbax, checked against loading the HF directory directly.

Every converted array must equal the one `load_target` / `load_assistant` gives for the HF directory, bit for bit
and dtype for dtype; user errors exit with status 2 and a one-line message (no traceback).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import hf_tiny

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run(
        [sys.executable, "-m", "checkpoints_convert", *args],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), err
    assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])
    return lines[-1]


def _flat(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _assert_identical(got_params, want_params) -> None:
    got, want = _flat(got_params), _flat(want_params)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        assert g.shape == w.shape, (k, g.shape, w.shape)
        assert np.array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8)), k


def _loader(kind: str):
    g = hf_tiny.import_gemma4_mtp_jax()
    return g.load_target if kind == "target" else g.load_assistant


def _convert_and_compare(src: Path, out: Path, kind: str, dtype: str | None) -> dict:
    args = ["--hf", str(src), "--out", str(out)] + ([] if dtype is None else ["--dtype", dtype])
    proc = _run(*args)
    _ok(proc)
    assert "[convert] done:" in proc.stdout, proc.stdout
    load = _loader(kind)
    kw = {} if dtype is None else {"dtype": dtype}
    want = load(str(src), **kw)
    got = load(str(out), **kw)
    _assert_identical(got.params, want.params)
    assert got.config == want.config
    encoders = getattr(want, "encoders", None)  # an assistant has none
    assert (getattr(got, "encoders", None) is None) == (encoders is None)
    if encoders is not None:  # a multimodal target's towers travel in the same Orbax checkpoint
        _assert_identical(got.encoders.params, want.encoders.params)
        assert got.encoders.config == want.encoders.config
    # converted checkpoint remembers its dtype: loading it with no dtype gives the same arrays
    if dtype is not None:
        _assert_identical(load(str(out)).params, want.params)
    meta = json.loads((out / "gemma4_mtp_jax.json").read_text())
    assert meta["kind"] == kind
    assert meta["num_tensors"] == len(_flat(want.params)) + (0 if encoders is None else
                                                              len(_flat(want.encoders.params)))
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            assert (out / name).read_bytes() == (src / name).read_bytes(), name
    return meta


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
@pytest.mark.parametrize("kind", ["target", "assistant"])
def test_convert_matches_hf(tiny_ckpts, tmp_path, family, kind):
    src = Path(tiny_ckpts[family][kind])
    meta = _convert_and_compare(src, tmp_path / "out", kind, None)
    assert meta["dtype"] == "float32"  # the tiny checkpoints are float32


@pytest.mark.parametrize("kind", ["target", "assistant"])
def test_convert_bfloat16(tiny_ckpts, tmp_path, kind):
    src = Path(tiny_ckpts["e2b"][kind])
    meta = _convert_and_compare(src, tmp_path / "out", kind, "bfloat16")
    assert meta["dtype"] == "bfloat16"
    assert set(meta["bytes_by_dtype"]) <= {"bfloat16", "int32"}


@pytest.mark.parametrize("layout", ["target_multimodal", "target_sharded"])
def test_convert_other_layouts(tiny_ckpts, tmp_path, layout):
    family = "e2b" if layout == "target_multimodal" else "a26b"
    _convert_and_compare(Path(tiny_ckpts[family][layout]), tmp_path / "out", "target", None)


def test_convert_fp8(tiny_ckpts, tmp_path):
    """--quantize fp8 stores the fp8 model (float8_e4m3fn weights, float32 scales) that loading the HF directory
    with quantization="fp8" gives, bit for bit (numpy quantizes here, XLA there), and marks config.json, so it
    loads quantized by default and dequantized with quantization="none". A compressed-tensors FP8 checkpoint
    converts as it loads (fp8, its own config replaced by ours)."""
    from checkpoints_convert import convert
    from gemma4_mtp_jax.weights.quantize import OWN_METHOD

    load = _loader("target")
    src = Path(tiny_ckpts["a26b"]["target"])
    ct = tmp_path / "ct"
    hf_tiny.write_compressed_tensors_fp8(src, ct)
    for source, quantize, out in ((src, "fp8", tmp_path / "fp8"), (ct, None, tmp_path / "ct_out")):
        summary = convert(str(source), str(out), quantize=quantize, log=lambda _: None)
        assert summary["quantization"] == "fp8"
        want = load(str(source), quantization="fp8")
        _assert_identical(load(str(out)).params, want.params)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == OWN_METHOD
        assert {k: v for k, v in cfg.items() if k != "quantization_config"} == {
            k: v for k, v in json.loads((source / "config.json").read_text()).items() if k != "quantization_config"}
        meta = json.loads((out / "gemma4_mtp_jax.json").read_text())
        assert meta["quantization"] == "fp8" and meta["dtype"] == "float32"
        assert "float8_e4m3fn" in meta["bytes_by_dtype"]
    dequantized, fp8, plain = (_flat(p) for p in (load(str(tmp_path / "fp8"), quantization="none").params,
                                                   want.params, load(str(src)).params))
    assert sorted(dequantized) == sorted(plain)
    q = "['layers_0']['self_attn']['q_proj']['weight']"
    np.testing.assert_array_equal(dequantized[q], fp8[q].astype(np.float32) * fp8[q[:-2] + "_scale']"][:, None])
    norm = "['layers_0']['input_layernorm']['weight']"
    np.testing.assert_array_equal(dequantized[norm], plain[norm])


def test_refuses_nonempty_out_then_force(tiny_ckpts, tmp_path):
    src = Path(tiny_ckpts["b31b"]["assistant"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _user_error(_run("--hf", str(src), "--out", str(out)), "--force", str(out.name))
    _ok(_run("--hf", str(src), "--out", str(out), "--force"))
    _ok(_run("--hf", str(src), "--out", str(out), "--force", "--dtype", "bfloat16"))
    assert json.loads((out / "gemma4_mtp_jax.json").read_text())["dtype"] == "bfloat16"
    assert (out / "keep.txt").exists()


def test_missing_dir(tmp_path):
    missing = tmp_path / "does_not_exist"
    line = _user_error(_run("--hf", str(missing), "--out", str(tmp_path / "out")), str(missing))
    assert "no such checkpoint directory" in line
    assert not (tmp_path / "out").exists()


def test_hf_resolves_as_the_loaders_do(tiny_ckpts, tmp_path, monkeypatch):
    """--hf goes through the loaders' own resolution (weights/resolve.py): a local directory (relative kept by the
    loader, absolute for the converter), a file or a missing non-hub path refused with the same words, and a hub id
    downloaded by one snapshot whose files are all a checkpoint needs (sharded weights and their index included)."""
    import fnmatch

    import huggingface_hub

    from checkpoints_convert import COPIED_FILES, ConvertError, resolve_source
    from gemma4_mtp_jax.model.config import ConfigError
    from gemma4_mtp_jax.weights.resolve import HUB_FILES, resolve_checkpoint

    local = Path(tiny_ckpts["e2b"]["assistant"])
    monkeypatch.chdir(local.parent)
    assert resolve_checkpoint(local.name) == Path(local.name)
    assert resolve_source(local.name, log=pytest.fail) == str(local)
    file, missing = local / "config.json", tmp_path / "missing"
    for arg, words in ((file, "is a file, expected a checkpoint directory or a hub id"),
                       (missing, "no such checkpoint directory")):
        with pytest.raises(ConfigError, match=words):
            resolve_checkpoint(arg)
        with pytest.raises(ConvertError, match=f"^--hf {re.escape(str(arg))}: {words}"):
            resolve_source(str(arg), log=pytest.fail)

    sharded = Path(tiny_ckpts["a26b"]["target_sharded"])
    assert any(f.name.endswith(".index.json") for f in sharded.iterdir())
    for name in [f.name for f in sharded.iterdir()] + list(COPIED_FILES):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILES), name
    downloads = []

    def snapshot_download(repo_id, allow_patterns):
        downloads.append((repo_id, allow_patterns))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    logged = []
    assert resolve_source("org/tiny-assistant", log=logged.append) == str(local)
    assert logged == ["[convert] org/tiny-assistant is not a local directory; fetching it from the Hugging Face hub"]
    want = hf_tiny.import_gemma4_mtp_jax().load_assistant(local, "float32")
    _assert_identical(hf_tiny.import_gemma4_mtp_jax().load_assistant("org/tiny-assistant", "float32").params,
                      want.params)
    assert downloads == [("org/tiny-assistant", HUB_FILES)] * 2

    def offline(repo_id, allow_patterns):
        raise OSError("cannot reach the hub\nretry later")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConvertError, match=r"^--hf org/x: no such directory, and downloading it from the hub failed: "
                                           r"cannot reach the hub$"):
        resolve_source("org/x", log=logged.append)
    with pytest.raises(OSError, match="cannot reach the hub"):
        resolve_checkpoint("org/x")


def test_wrong_model_type(tiny_ckpts, tmp_path):
    src = tmp_path / "llama"
    shutil.copytree(tiny_ckpts["e2b"]["target"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    _user_error(_run("--hf", str(src), "--out", str(tmp_path / "out")), "model_type 'llama'", "gemma4_assistant")


def test_no_config(tmp_path):
    (tmp_path / "src").mkdir()
    _user_error(_run("--hf", str(tmp_path / "src"), "--out", str(tmp_path / "out")), "config.json")


def test_truncated_weights(tiny_ckpts, tmp_path):
    src = tmp_path / "trunc"
    shutil.copytree(tiny_ckpts["e2b"]["assistant"], src)
    f = src / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    _user_error(_run("--hf", str(src), "--out", str(tmp_path / "out")), str(f), "truncated")


def test_already_converted(tiny_ckpts, tmp_path):
    out = tmp_path / "out"
    _ok(_run("--hf", str(tiny_ckpts["e2b"]["assistant"]), "--out", str(out)))
    _user_error(_run("--hf", str(out), "--out", str(tmp_path / "again")), "already")


def test_help():
    proc = _run("--help")
    _ok(proc)
    for flag in ("--hf", "--out", "--dtype", "--quantize", "--force", "bfloat16", "float32", "fp8"):
        assert flag in proc.stdout
