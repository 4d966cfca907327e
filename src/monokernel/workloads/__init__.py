"""Workloads shaped like the engine's users: a scripted coding-agent loop, and the agent-shaped
prompts of the speculative-decoding bench (spec_workloads.py)."""

from monokernel.workloads.agent_loop import (
    AgentLoopConfig,
    AgentLoopReport,
    EndpointClient,
    EngineClient,
    run_agent_loop,
)

__all__ = [
    "AgentLoopConfig",
    "AgentLoopReport",
    "EndpointClient",
    "EngineClient",
    "run_agent_loop",
]
