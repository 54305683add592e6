"""The demo target, greedy and sampled, on the CPU, its logits masked by a grammar matcher at every position (a
full forward per token over a fixed padded window: no engine): does its output parse and validate, and in how many
tokens? The engine's own test of the same lands with the device side.

    PYTHONPATH=$PWD python lab/probes/probe_grammar_demo.py

Seen on the CPU (window 192 tokens, prompt 20): the 3-property schema (a string of <= 20 characters, an integer,
an enum) ends and validates, greedy in 71 tokens and sampled at T=1 in 79, the tiny model padding gaps with
whitespace up to the grammar's 64 characters; a choice ends in one token and the stop. {"type": "object"} does
not end within the window at either temperature: the model writes prose inside its first key's string. A
grammar cannot make a truncated output parse: an engine test of "always valid" needs bounded strings (maxLength)
or a max_tokens the document fits in.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np

from gemma4_mtp_jax.api import load_target, target_forward
from gemma4_mtp_jax.engine.grammar import GrammarSpec, Vocabulary, compile_grammar
from gemma4_mtp_jax.server.chat import TextTokenizer

DEMO = Path(__file__).resolve().parents[2] / "gemma4_mtp_jax" / "demo_pair" / "target"
WINDOW = 192
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def main() -> None:
    target = load_target(str(DEMO), dtype="float32")
    tok = TextTokenizer(DEMO)
    vocab = Vocabulary(tok.tokenizer.to_str(), target.config.vocab_size, (1, 5))
    fwd = jax.jit(lambda t: target_forward(target, t).logits[0])
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON with name, age and city."}])
    for spec, check in [(GrammarSpec.json_schema(SCHEMA), lambda s: jsonschema.validate(json.loads(s), SCHEMA)),
                        (GrammarSpec.json_schema({"type": "object"}), lambda s: json.loads(s)),
                        (GrammarSpec.choice(["yes", "no", "maybe"]), lambda s: s in ("yes", "no", "maybe"))]:
        for temperature in (0.0, 1.0):
            m = compile_grammar(spec, vocab).matcher()
            ids, rng = list(prompt), np.random.default_rng(0)
            mask = vocab.new_masks()
            t0 = time.perf_counter()
            while len(ids) < WINDOW and not m.is_terminated():
                logits = np.asarray(fwd(jnp.asarray([ids + [0] * (WINDOW - len(ids))])))[len(ids) - 1]
                m.fill_mask(mask)
                bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: logits.shape[0]].astype(bool)
                logits = np.where(bits, logits, -np.inf)
                if temperature == 0:
                    t = int(np.argmax(logits))
                else:
                    p = np.exp((logits - logits.max()) / temperature)
                    t = int(rng.choice(len(p), p=p / p.sum()))
                assert m.accept(t)
                ids.append(t)
            out = ids[len(prompt):]
            text = tok.decode(out[:-1] if m.is_terminated() else out)
            ok = m.is_terminated()
            try:
                check(text)
            except Exception as e:  # noqa: BLE001 -- a probe reports
                ok = f"invalid: {e}"
            print(f"{spec.kind:6s} T={temperature}: {len(out)} tokens, {time.perf_counter() - t0:.1f} s, "
                  f"terminated+valid={ok}: {text!r}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
