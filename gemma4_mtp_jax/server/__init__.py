"""The OpenAI-compatible server (`python -m gemma4_mtp_jax.serve`).

app.py           the ASGI app: endpoints, /health, /metrics, the edge every response passes
generation.py    an accepted generation: JSON or SSE answers, usage, cancelling on disconnect
connection.py    uvicorn's HTTP/1.1 protocol with header / body deadlines (slow clients)
async_engine.py  the engine thread and the queues between it and the event loop
protocol.py      request validation (OpenAI-style 4xx errors, errors.py)
prepare.py       a request's body -> parameters and prompt ids: on the event loop, or in worker processes if large
detokenize.py    incremental, UTF-8-safe detokenization with stop strings
chat.py          tokenizer + chat template (jinja2, sandboxed)
chat_output.py   a chat's output -> content, reasoning_content, tool_calls: the parsers of the model and request
tool_calls.py    Gemma 4's tool-call syntax -> OpenAI tool_calls, whole or streamed
reasoning.py     Gemma 4's thinking channel -> reasoning_content, whole or streamed
metrics.py       Prometheus metrics
flags.py         the command line: every flag, its default and its checks
cli.py           start-up (load, check, compile), uvicorn with a draining SIGTERM
"""

from gemma4_mtp_jax.server.cli import create_server, main
from gemma4_mtp_jax.server.flags import build_parser

__all__ = ["build_parser", "create_server", "main"]
