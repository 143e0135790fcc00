"""CPU expert kernels: SwiGLU experts for a few tokens straight from the host expert pool."""

from freetoken_agent.kernels.cpu.experts import backend, cpu_experts

__all__ = ["backend", "cpu_experts"]
