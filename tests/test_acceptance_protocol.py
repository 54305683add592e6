"""benchmarks/acceptance.py under vLLM's protocol: its per-prompt averaging and where its prompt sets come from.
No model runs here (the benchmark itself is the check of the numbers)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import acceptance


def _stats(accepted_per_round: list[int], k: int = 2) -> dict:
    """A request's stats as Request.stats() gives them (generated tokens: a bonus per round, its drafts, the first)."""
    if not accepted_per_round:
        return {"generated_tokens": 1, "finish_reason": "stop"}
    return {"generated_tokens": 1 + sum(accepted_per_round) + len(accepted_per_round), "finish_reason": "length",
            "rounds": len(accepted_per_round), "accepted": sum(accepted_per_round),
            "accepted_per_position": [sum(n > j for n in accepted_per_round) for j in range(k)]}


def test_per_prompt_mean_against_pooled():
    """Prompt A: 4 rounds accepting 1 each, L = 2; prompt B: one round accepting 2, L = 3; prompt C: no round (it
    stopped at its first token), L = 1 as vLLM counts it. Per prompt: (2 + 3 + 1) / 3 = 2.0; pooled over the 5
    rounds: (6 accepted + 5 rounds) / 5 = 2.2, so the two figures differ and each is computed as stated."""
    stats = [_stats([1, 1, 1, 1]), _stats([2]), _stats([])]
    rec = acceptance.summarize_per_prompt(stats, k=2)
    assert rec["per_prompt_acceptance_length"] == [2.0, 3.0, 1.0]
    assert rec["per_prompt_mean_acceptance_length"] == pytest.approx(2.0)
    assert rec["mean_acceptance_length"] == pytest.approx(2.2)
    assert rec["rate_per_position"] == [1.0, 0.2]  # 5 rounds: all accepted a first draft, one a second
    assert rec["prompts"] == 3 and rec["finish_reasons"] == {"length": 2, "stop": 1}


def test_prompt_sets_from_files_in_the_protocol_wording(tmp_path, monkeypatch):
    monkeypatch.setattr(acceptance.importlib.util, "find_spec", lambda name: None)  # no package, no datasets
    he = tmp_path / "HumanEval.jsonl.gz"
    he.write_bytes(gzip.compress(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n"}).encode() + b"\n"))
    gsm = tmp_path / "test.jsonl"
    gsm.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    mt = tmp_path / "mt.json"  # a JSON list, HuggingFaceH4/mt_bench_prompts' field
    mt.write_text(json.dumps([{"prompt": ["First turn.", "Second turn."]}]))
    for name, path, want in [
            ("humaneval", he, "Write a solution to the following problem and make sure that it passes the tests:\n"
                              "```python\ndef f(x):\n\n```"),
            ("gsm8k", gsm, "What is 2 + 2?\nPlease reason step by step, and put your final answer within \\boxed{}."),
            ("mt-bench", mt, "First turn.")]:
        records, where = acceptance.find_prompt_set(name, str(path))
        assert where == str(path)
        assert acceptance.protocol_requests(name, records, where) == [want]
    records, why = acceptance.find_prompt_set("gsm8k", None)
    assert records is None and "--prompt-file gsm8k=" in why
