"""The continuous-batching engine (engine.py) and its parts: the scheduler, the KV cache manager, the runner."""

from gemma4_mtp_jax.engine.config import EngineConfig, powers_of_two_upto
from gemma4_mtp_jax.engine.engine import Engine, compile_ahead
from gemma4_mtp_jax.engine.memory import DeviceMemoryError, pool_memory_left
from gemma4_mtp_jax.engine.request import Request, RequestError, StepEvent

__all__ = ["DeviceMemoryError", "Engine", "EngineConfig", "Request", "RequestError", "StepEvent", "compile_ahead",
           "pool_memory_left", "powers_of_two_upto"]
