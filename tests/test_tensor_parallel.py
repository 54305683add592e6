"""Tensor parallelism in a child process (the device count is fixed when JAX starts): on CPU devices
(`--xla_force_host_platform_device_count`), or on the GPUs when the suite runs on a machine with two or more:
greedy output and speculative acceptance at TP = 2 (and 4) equal TP = 1 for every tiny family, parameters and KV
pages are split as sharding.py says, and serving compiles nothing after start-up. Clear errors for sizes the model
cannot take."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The children import the repository first and keep the rest of the path (the GPU image installs wheels there).
PYTHONPATH = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])

CHILD = r"""
import json, sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # float32 means float32 on a GPU too (conftest.py)
import numpy as np
from gemma4_mtp_jax.api import load_assistant, load_target
from gemma4_mtp_jax.engine import Engine, EngineConfig
from gemma4_mtp_jax.model.sampling import SamplingParams

paths = json.loads(sys.argv[1])  # family -> target, assistant, tensor-parallel sizes, modes
assert len(jax.devices()) >= max(max(p["sizes"]) for p in paths.values()), jax.devices()
compiles = []
listening = [False]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: compiles.append(event)
    if listening[0] and event == "/jax/core/compile/backend_compile_duration" else None)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 400, size=n).tolist() for n in (5, 13, 22)]
out = {}
for family, p in paths.items():
    target = load_target(p["target"], "float32")
    assistant = load_assistant(p["assistant"], "float32")
    for tp in p["sizes"]:
        for spec in [m == "spec" for m in p["modes"]]:
            # One prefill bucket (8 tokens, every chunk padded to it): a program less per engine, ~40 s of the suite.
            # The one-device engines are the reference alone: they compile only the programs they run (not the
            # processed variant, ~6 s each), and their compiling nothing while serving is tests/test_engine.py's.
            cfg = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=4, prefill_chunk=8, min_prefill_bucket=8,
                               tensor_parallel_size=tp, num_speculative_tokens=3 if spec else None,
                               compile_at_start=tp > 1)
            eng = Engine(target, cfg, assistant=assistant if spec else None)
            q = eng.steps.params["layers_0"]["self_attn"]["q_proj"]["weight"]
            listening[0] = tp > 1
            reqs = [eng.add_request(x, 12, SamplingParams(temperature=0.8 * (i == 1), seed=i))
                    for i, x in enumerate(prompts)]
            eng.run()
            listening[0] = False
            pages = next(iter(eng.state.pages.values()))[0]  # the live pool (each step donates the last)
            out[f"{family}/tp{tp}/{'spec' if spec else 'plain'}"] = {
                "outputs": [r.output for r in reqs],
                "accepted": [r.accepted_per_round for r in reqs],
                "q_shard_rows": q.addressable_shards[0].data.shape[0], "q_rows": q.shape[0],
                "q_devices": len(q.sharding.device_set),
                "pages_kv_heads_per_shard": pages.addressable_shards[0].data.shape[0], "pages_kv_heads": pages.shape[0],
            }
print("RESULT " + json.dumps({"runs": out, "compiles_after_start": len(compiles)}))
"""


def _gpus() -> int:
    """The GPUs the suite runs on (0 off the GPU): with two or more, the children split the models over them."""
    import jax

    return len(jax.devices()) if jax.default_backend() == "gpu" else 0


def _child_env(devices: int) -> dict[str, str]:
    """A child's environment: the suite's GPUs when there are at least `devices` of them, else that many CPU
    devices."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    if _gpus() >= devices:
        return env | {"JAX_PLATFORMS": os.environ["JAX_PLATFORMS"]}
    return env | {"JAX_PLATFORMS": "cpu",
                  "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}


def _run_children(tiny_ckpts, groups: list[list[str]], sizes: dict[str, list[int]], modes: dict[str, list[str]],
                  devices: int) -> dict:
    """CHILD for each group of families, the groups' children at once on CPU devices (XLA:CPU compiles one program
    at a time in a process, and the CI machine has two cores; GPU children would each take most of the GPUs' memory,
    so there one child runs every group), their results merged."""
    if _gpus() >= devices:
        groups = [[f for g in groups for f in g]]
    def run(group):
        paths = {f: {"target": str(tiny_ckpts[f]["target"]), "assistant": str(tiny_ckpts[f]["assistant"]),
                     "sizes": sizes[f], "modes": modes[f]} for f in group}
        return subprocess.run([sys.executable, "-c", CHILD, json.dumps(paths)], env=_child_env(devices),
                              capture_output=True, text=True, timeout=1200)

    assert sorted(f for g in groups for f in g) == sorted(sizes)
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        procs = list(pool.map(run, groups))
    got = {"runs": {}, "compiles_after_start": 0}
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        one = json.loads(line[len("RESULT "):])
        got["runs"] |= one["runs"]
        got["compiles_after_start"] += one["compiles_after_start"]
    return got


def test_tensor_parallel_equals_one_device(tiny_ckpts):
    """TP = 2 for a26b, b31b and u12b (the unified 12B: its sliding pages split by KV head, its one full-layer KV
    head replicated), TP = 4 for e2b (the only tiny checkpoint whose heads 4 divides), in two processes (two
    families each) with four CPU devices, greedy and sampled rows: speculative for every family (its prefill and
    verify run the target's forward, its rounds the drafter over the split pages), plain decode for e2b; the split
    engines compile nothing after start-up. (Each engine costs ~20 s of the CPU suite, so e2b at TP = 2 is left to
    the other families.) On a machine with two or three GPUs, e2b runs at TP = 2 on them instead."""
    e2b = 4 if _gpus() in (0, 1) or _gpus() >= 4 else 2
    sizes = {"e2b": [1, e2b], "a26b": [1, 2], "b31b": [1, 2], "u12b": [1, 2]}
    modes = {"e2b": ["plain", "spec"], "a26b": ["spec"], "b31b": ["spec"], "u12b": ["spec"]}
    got = _run_children(tiny_ckpts, [["e2b", "u12b"], ["a26b", "b31b"]], sizes, modes, devices=e2b)
    runs = got["runs"]
    for family, family_sizes in sizes.items():
        for n in family_sizes[1:]:
            for mode in modes[family]:
                one, many = runs[f"{family}/tp1/{mode}"], runs[f"{family}/tp{n}/{mode}"]
                assert many["outputs"] == one["outputs"], f"{family} {mode}: TP={n} output differs from one device"
                assert many["accepted"] == one["accepted"], f"{family} {mode}: TP={n} acceptance differs"
                assert many["q_devices"] == n and many["q_shard_rows"] * n == many["q_rows"], "q_proj not split"
                kv = many["pages_kv_heads"]
                assert many["pages_kv_heads_per_shard"] == (kv // n if kv % n == 0 else kv)
    assert got["compiles_after_start"] == 0


COLLECTIVES_CHILD = r"""
import json, sys
from benchmarks.collectives import engine_programs, summarize
from benchmarks.common import lower_program
from gemma4_mtp_jax.api import assistant_shapes, target_shapes

out = {}
for family, p in json.loads(sys.argv[1]).items():
    target, assistant = target_shapes(p["target"]), assistant_shapes(p["assistant"])
    programs = engine_programs(target, assistant, tp=2, batch=2, k=3, context=64, page_size=4)
    for prog in p["programs"]:
        text = lower_program(programs[prog]()).compile().as_text()
        out[f"{family}/{prog}"] = summarize(text, target.config.num_layers, k=3) | {
            "target_layers": target.config.num_layers}
print("RESULT " + json.dumps(out))
"""


def test_collectives_per_step_program(tiny_ckpts):
    """The tensor-parallel goals, counted in the optimized HLO of the tiny families' sampled speculative programs at
    TP = 2 (benchmarks/collectives.py; compiled from the checkpoints' shapes alone): at most 2 all-reduces per target
    layer (attention's and the MLP's or the experts'), no collective in the draft steps (the assistant, its embedding
    lookup and head whole on every device, over pages whole on every device), and outside the layers only the one
    gather of the logits for the draw (e2b: and PLE's lookup, which XLA may fold into a layer's all-reduce). The
    sampled round holds every piece of the greedy one but its argmax over split logits, and its drafts' own
    sampling besides; the greedy program would cost as much again (~7 s of lowering and compiling a program)."""
    programs = {f: ["speculative_sampled"] for f in ("e2b", "a26b", "b31b", "u12b")}
    paths = {f: {"target": str(tiny_ckpts[f]["target"]), "assistant": str(tiny_ckpts[f]["assistant"]),
                 "programs": progs} for f, progs in programs.items()}
    proc = subprocess.run([sys.executable, "-c", COLLECTIVES_CHILD, json.dumps(paths)], env=_child_env(2),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert sorted(got) == sorted(f"{f}/{p}" for f, progs in programs.items() for p in progs)
    for where, s in got.items():
        layers = s["parts"]["layers"]["by_kind"]
        assert layers.get("all-reduce", 0) <= 2 * s["target_layers"], (where, layers)
        assert s["draft_collectives"] == 0, (where, [c for c in s["each"] if c["part"] == "draft"])
        outside = [c for c in s["each"] if c["part"] in ("target", "step")]
        assert sum(c["count"] for c in outside) <= (2 if where.startswith("e2b") else 1), (where, outside)


def test_sizes_the_model_cannot_take_are_refused(tiny_ckpts, jax_models):
    import jax

    from gemma4_mtp_jax.engine import Engine, EngineConfig
    from gemma4_mtp_jax.model.sharding import ShardingError

    target = jax_models.target(tiny_ckpts["e2b"]["target_plain"])  # 4 query heads
    with pytest.raises(ShardingError, match="num_attention_heads=4"):
        Engine(target, EngineConfig(tensor_parallel_size=3, compile_at_start=False))
    n = len(jax.devices())  # 1 on CPU; 2 on the two-GPU machine
    if n < 4:  # a size the heads allow but the visible devices do not
        with pytest.raises(ShardingError, match=f"only {n} devices"):
            Engine(target, EngineConfig(tensor_parallel_size=4 if n > 1 else 2, compile_at_start=False))
    with pytest.raises(ShardingError, match=">= 1"):
        Engine(target, EngineConfig(tensor_parallel_size=0, compile_at_start=False))


def test_fp8_scales_split_like_their_weights_output_rows(tiny_ckpts):
    """An fp8 weight's scale (one per output row) is split where its weight's rows are (q / k / v, gate / up, the
    experts) and whole beside the row-parallel o_proj / down_proj, whose outputs the all-reduce sums: the specs of
    the MoE family's fp8 parameters at TP = 2, read off the shapes alone (an engine at TP = 2 costs ~20 s here)."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from gemma4_mtp_jax.api import target_shapes
    from gemma4_mtp_jax.model.sharding import Placement
    from gemma4_mtp_jax.weights.hf_loader import flatten_shapes
    from gemma4_mtp_jax.weights.quantize import is_scale

    target = target_shapes(tiny_ckpts["a26b"]["target"], "float32", quantization="fp8")
    placement = Placement(AbstractMesh((2,), ("tp",)))
    shapes = flatten_shapes(target.params)
    spec = {n: placement.target_param_spec(target.config, n, tuple(a.shape)) for n, a in shapes.items()}
    split, whole = set(), set()
    for name in filter(is_scale, spec):
        weight = spec[name[: -len("_scale")]]
        rows_split = len(weight) > 0 and weight[0] == "tp"
        assert spec[name] == (P("tp", *(None,) * (len(shapes[name].shape) - 1)) if rows_split else P()), name
        (split if rows_split else whole).add(name.split(".", 1)[1])
    assert {"self_attn.q_proj.weight_scale", "mlp.up_proj.weight_scale", "experts.down_proj_scale"} <= split
    assert {"self_attn.o_proj.weight_scale", "mlp.down_proj.weight_scale"} <= whole
    assert spec["layers_0.self_attn.o_proj.weight"] == P(None, "tp")


def test_what_the_assistant_reads_is_whole_and_counted_per_device(tiny_ckpts):
    """At TP = 2 with the assistant: the target's embedding and the K/V (projections, pages) of the store layers the
    assistant reads are whole on every device, the other layers' K/V split by KV head; memory planning counts the
    whole pages and weights once per device (`page_copies`, `extra_copies`). Read off the shapes alone."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from gemma4_mtp_jax.api import assistant_shapes, target_shapes
    from gemma4_mtp_jax.model.config import owning_layers
    from gemma4_mtp_jax.model.kv_state import page_bytes
    from gemma4_mtp_jax.model.sharding import Placement
    from gemma4_mtp_jax.programs.compiled import placement_for
    from gemma4_mtp_jax.steps.speculative import AssistantDrafter

    target = target_shapes(tiny_ckpts["a26b"]["target"], "float32")  # sliding layers: 2 KV heads; full: 1
    cfg = target.config
    drafter = AssistantDrafter(assistant_shapes(tiny_ckpts["a26b"]["assistant"], "float32"))
    placement = placement_for(Placement(AbstractMesh((2,), ("tp",))), drafter, cfg)
    read = set(cfg.store_layers.values())
    assert placement.whole_kv == read
    split = [i for i in owning_layers(cfg) if cfg.layers[i].layer_type == "sliding_attention" and i not in read]
    assert split and all(placement.kv_split(cfg, i) for i in split)
    spec = lambda name, shape: placement.target_param_spec(cfg, name, shape)  # noqa: E731
    for i in read:
        assert spec(f"layers_{i}.self_attn.k_proj.weight", (32, 48)) == P()
    assert spec(f"layers_{split[0]}.self_attn.k_proj.weight", (32, 48)) == P("tp", None)
    assert spec("embed_tokens.weight", (512, 48)) == P()
    whole = [i for i in owning_layers(cfg) if i in read or cfg.layers[i].num_kv_heads % 2]
    assert placement.page_copies(cfg) == {i: 2 for i in whole}
    plain, counted = page_bytes(cfg, 4, "float32"), page_bytes(cfg, 4, "float32", placement.page_copies(cfg))
    assert counted["sliding_attention"] > plain["sliding_attention"]
    copies = placement.extra_copies(target.params, placement.target_params(cfg, target.params))
    assert (512, 48) in [c.shape for c in copies]  # the embedding, whole on both devices


DP_CHILD = r"""
import json, sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # float32 means float32 on a GPU too (conftest.py)
from gemma4_mtp_jax.api import load_target
from gemma4_mtp_jax.engine import Engine, EngineConfig
from gemma4_mtp_jax.server.async_engine import Replicas
from gemma4_mtp_jax.server.cli import create_server

target_dir = sys.argv[1]
target = load_target(target_dir, "float32")
prompts = [[5, 9, 13, 200, 7], [3] * 11]
cfg = EngineConfig(max_num_seqs=2, max_model_len=48, page_size=4, prefill_chunk=8, min_prefill_bucket=8)
outs = []
for dev in jax.devices()[:2]:
    eng = Engine(target, cfg, devices=[dev])
    reqs = [eng.add_request(p, 10) for p in prompts]
    eng.run()
    outs.append([r.output for r in reqs])
    pool_devices = {d.id for k, _ in eng.state.pages.values() for d in k.devices()}
    param_devices = {d.id for a in jax.tree_util.tree_leaves(eng.steps.params) for d in a.devices()}
    assert pool_devices == param_devices == {dev.id}, (pool_devices, param_devices, dev)
server, _ = create_server(["--ckpt", target_dir, "--assistant", "none", "--data-parallel-size", "2",
                           "--max-num-seqs", "2", "--max-model-len", "48", "--prefill-chunk", "8", "--page-size", "4",
                           "--compilation-cache-dir", "none", "--executable-cache-dir", "none"])
front = server.engine
devs = [{d.id for k, _ in r.engine.state.pages.values() for d in k.devices()} for r in front.replicas]
print("RESULT " + json.dumps({"outputs": outs, "replica_devices": [sorted(d) for d in devs],
                              "is_replicas": isinstance(front, Replicas)}))
"""


def test_data_parallel_replicas_run_on_their_own_devices(tiny_ckpts):
    """Each replica's parameters and pages live on its own device and give the same output; the server's
    --data-parallel-size 2 builds one engine per device behind Replicas."""
    env = _child_env(2)
    proc = subprocess.run([sys.executable, "-c", DP_CHILD, str(tiny_ckpts["b31b"]["target_plain"])], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert got["outputs"][0] == got["outputs"][1]
    assert got["is_replicas"] and got["replica_devices"] == [[0], [1]]


def test_two_processes_on_localhost_equal_one(tiny_ckpts):
    """Multi-host in miniature: `generate` in two processes (one CPU device each, jax.distributed with gloo),
    tensor parallel over both, prints the greedy tokens of a single-process run (process 0 prints, process 1 not)."""
    from test_server_support import free_port

    port = free_port()
    base = [sys.executable, "-m", "gemma4_mtp_jax.generate", "--ckpt", str(tiny_ckpts["a26b"]["target_plain"]),
            "--prompt-ids", "5,9,13,200,7", "--prompt-ids", "3,3,3,3,3,3,3,3,3,3,3", "--max-new-tokens", "10",
            "--dtype", "float32", "--max-model-len", "48", "--page-size", "4", "--json",
            "--compilation-cache-dir", "none"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": PYTHONPATH}
    single = subprocess.run(base, env=env, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    procs = [subprocess.Popen(base + ["--tensor-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{port}",
                                      "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    def printed(stdout):  # the JSON line (gloo writes its own lines to stdout too)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("[{")]
        return [r["tokens"] for r in json.loads(lines[-1])] if lines else None

    assert printed(outs[0][0]) == printed(single.stdout) is not None
    assert printed(outs[1][0]) is None
