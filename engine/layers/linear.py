"""Linear layers whose weight is stacked from several checkpoint tensors.

q/k/v (and gate/up) run as one GEMM: one launch and one pass over the activations instead of
three. The checkpoint still stores them apart, so the loader writes each shard into its rows.

`skinny` (set by `use_skinny_gemv`, EngineConfig.skinny_gemv): decode-sized inputs on CUDA take
the Triton skinny matmul (kernels/gemv.py) instead of torch's choice of cuBLAS kernel. Off by
default: no faster than cuBLAS on the H200 host (`bench gemv`, `bench fusions` variant
`both+skinny`; NOTES, twenty-third session).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken_agent.kernels.gemv import gemv


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, skinny: bool):
    """x @ weight.T (+ bias); with `skinny`, through kernels/gemv.py (the Triton kernel for
    decode-sized CUDA inputs, F.linear otherwise)."""
    if skinny and x.dim() == 2:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def use_skinny_gemv(model: nn.Module, on: bool = True) -> None:
    """Switch every layer with a `skinny` flag to the skinny matmul (or back, `on=False`)."""
    for m in model.modules():
        if hasattr(m, "skinny"):
            m.skinny = on


class ShardedLinear(nn.Module):
    """y = x @ W.T (+ b), W = cat([W_shard for shard in shards]) along the output dim."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = dict(shards)  # name -> output rows
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, rows in self.shards.items():
            self.offsets[name] = offset
            offset += rows
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None
        self.skinny = False

    def shard_view(self, param: str, shard: str) -> torch.Tensor:
        """The rows of `param` ("weight" or "bias") that hold `shard`: the loader copies into it."""
        tensor = getattr(self, param)
        start = self.offsets[shard]
        return tensor[start : start + self.shards[shard]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.skinny)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, list(self.shards.values()), dim=-1)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.skinny = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.skinny)
