"""monokernel: latency-first, batch-1 LLM inference."""

from monokernel.runtime.engine import Completion, Engine, EngineConfig, Timings, TokenEvent
from monokernel.runtime.sampling import SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams", "Timings", "TokenEvent"]
__version__ = "0.1.0"
