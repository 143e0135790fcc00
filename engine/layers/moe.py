"""The MoE block: route, then hand the tokens to the expert bank.

Expert weights are not parameters of this module. The block owns the router (and a shared
expert where the family has one) and calls `bank(layer, hidden, topk_ids, topk_weights)`, so the
bank alone decides where experts live and run: resident on the GPU, in GPU cache slots, or on
the CPU. Routing is computed exactly as each family defines it and is the same whatever the bank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from freetoken_agent.engine.layers.linear import Linear, project
from freetoken_agent.engine.layers.mlp import SwiGLU
from freetoken_agent.kernels.router import route, softmax_topk

# T tokens, H hidden, E experts, K top-k


class ExpertBank(Protocol):
    """Computes sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for one MoE layer."""

    def __call__(
        self,
        layer: int,  # MoE-layer ordinal (lid = layer * n_experts + expert)
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int32 expert ids within the layer
        topk_weights: torch.Tensor,  # [T, K] float32
    ) -> torch.Tensor: ...  # [T, H] in hidden.dtype


@dataclass(slots=True, frozen=True)
class RouterOptions:
    top_k: int
    norm_topk_prob: bool  # renormalise the k kept probabilities to sum to one
    # Qwen and OLMoE round the routing weights to the model dtype before use; Mixtral keeps fp32.
    weights_in_model_dtype: bool = True


# The fused router (EngineConfig.fused_router) runs steps of at most this many rows: on the H200
# host route took 6.5 us for one row against 8.4 for F.linear and the top-k, 15.3 against 8.4
# for four (`bench gemv` router rows; its programs each read a tile of every row).
FUSED_ROUTER_ROWS = 1


class TopKRouter(nn.Module):
    """Softmax over all experts, keep the top k (transformers' TopKRouter)."""

    def __init__(self, hidden: int, n_experts: int, options: RouterOptions) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden), requires_grad=False)
        self.options = options
        self.skinny = False  # linear.use_skinny_gemv
        self.fused = False  # use_fused_router
        self._scratch = None  # route's, this router's own (made at its first CUDA decode)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        opts = self.options
        round_to = x.dtype if opts.weights_in_model_dtype else None
        if self.fused and x.dim() == 2 and x.shape[0] <= FUSED_ROUTER_ROWS:
            if self._scratch is None and x.is_cuda:
                from freetoken_agent.kernels.triton.route import new_scratch

                self._scratch = new_scratch(x.device)
            return route(x, self.weight, opts.top_k, opts.norm_topk_prob, round_to,
                         scratch=self._scratch)  # fmt: skip
        logits = project(x, self.weight, None, self.skinny)  # [T, E] in the model dtype
        # One kernel for softmax, top-k, renormalisation and rounding: [T, K] ids and weights.
        return softmax_topk(logits, opts.top_k, opts.norm_topk_prob, round_to)


def use_fused_router(model: nn.Module, on: bool = True) -> None:
    """Switch every MoE router to `route` (EngineConfig.fused_router), or back (`on` False;
    captured graphs keep the kernels they were captured with)."""
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.fused = on


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden: int,
        n_experts: int,
        moe_layer: int,
        bank: ExpertBank,
        router: RouterOptions,
        shared_intermediate: int = 0,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, n_experts, router)
        self.moe_layer = moe_layer
        self._bank = bank  # a plain attribute: the bank's tensors are not module parameters
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = Linear(hidden, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self._bank(self.moe_layer, x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
