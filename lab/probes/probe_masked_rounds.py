"""The demo pair under a JSON schema: a plain engine and a speculative one with masked rounds (CPU, float32).
Greedy outputs must be equal and both must validate; prints the sampled ones and the acceptance length.

    PYTHONPATH=$PWD python lab/probes/probe_masked_rounds.py
"""
import json, time, jax, numpy as np, jsonschema
from gemma4_mtp_jax import api
from gemma4_mtp_jax.engine.config import EngineConfig
from gemma4_mtp_jax.engine.engine import Engine
from gemma4_mtp_jax.engine.grammar import GrammarSpec, Vocabulary, compile_grammar
from gemma4_mtp_jax.model.sampling import SamplingParams
from gemma4_mtp_jax.server.chat import TextTokenizer
D="gemma4_mtp_jax/demo_pair/"
t=api.load_target(D+"target", dtype="float32"); a=api.load_assistant(D+"assistant", dtype="float32")
tok = TextTokenizer(D+"target")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
eng0=Engine(t, EngineConfig(max_num_seqs=2, max_model_len=256, prefill_chunk=32, min_prefill_bucket=32))
vocab = Vocabulary(tok.tokenizer.to_str(), t.config.vocab_size, sorted(eng0.eos_ids))
g = compile_grammar(GrammarSpec.json_schema(SCHEMA), vocab)
prompt = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON with name, age and city."}])
t0=time.time()
eng=Engine(t, EngineConfig(max_num_seqs=2, max_model_len=256, prefill_chunk=32, min_prefill_bucket=32, structured_outputs=True), assistant=a)
print("compile", time.time()-t0)
outs={}
for name, e in (("plain", eng0), ("spec", eng)):
  for temp in (0.0, 1.0):
    r=e.add_request(prompt, 150, SamplingParams(temperature=temp, seed=3, logprobs=1), grammar=g.matcher())
    r2=e.add_request(prompt, 40, SamplingParams())
    e.run()
    text=tok.decode([x for x in r.output if x not in e.eos_ids])
    print(name, temp, r.finish_reason, len(r.output), repr(text[:120]), r.stats().get("mean_acceptance_length"))
    jsonschema.validate(json.loads(text), SCHEMA)
    outs[(name,temp)]=r.output
print("greedy equal", outs[("plain",0.0)]==outs[("spec",0.0)])
