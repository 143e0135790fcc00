"""Gated DeltaNet: the linear-attention (recurrent) layer of Qwen3-Next and Qwen3.5-MoE.

Per token: project x to q, k, v (Hk key heads of Dk, Hv value heads of Dv), an output gate z and
per-value-head b, a; run a short depthwise causal conv + SiLU over the concatenated q, k, v;
beta = sigmoid(b) (write strength), g = -exp(A_log) * softplus(a + dt_bias) (log decay); the
gated delta rule with L2-normalised q, k updates each sequence's [Dk, Dv] state per value head
and reads it with q; a gated RMSNorm over each value head (norm(o) * w * silu(z)); out_proj.

The conv window and the delta-rule state live in pools the runner owns (`RecurrentStateView`,
bound per layer); the step's `RecurrentMetadata` says which pool row each sequence uses and
where to snapshot. A decode step (seq_bounds None) runs without host syncs or data-dependent
branches, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.engine.layers.attention import AttentionMetadata
from freetoken_agent.engine.layers.linear import Linear, ShardedLinear
from freetoken_agent.engine.layers.recurrent import RecurrentStateView
from freetoken_agent.kernels.gated_delta import causal_conv1d, gated_delta_rule

# T tokens of the step, H hidden, Hk / Hv key / value heads, Dk / Dv key / value head dims,
# r = Hv / Hk value heads per key head, C = 2 Hk Dk + Hv Dv conv channels, K conv width


@dataclass(slots=True, frozen=True)
class DeltaNetOptions:
    """How the checkpoint packs the input projection (chosen by the model file).

    grouped (Qwen3-Next): in_proj_qkvz rows are grouped per key head, [q_g, k_g, v_g, z_g] with
    r value heads in v_g and z_g, and in_proj_ba rows [b_g, a_g] likewise; the layer regroups
    the projection's output. Otherwise (Qwen3.5): separate qkv ([q | k | v]), z, b and a."""

    grouped: bool = False


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head, then times silu(z): transformers' Qwen3NextRMSNormGated.
    Statistics in fp32, rounded to the model dtype before the (plain, not zero-centred) weight
    multiply; the gate multiply in fp32, rounded once at the end."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        wide = torch.promote_types(dtype, torch.float32)
        x32 = x.to(wide)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(dtype)
        return (y * F.silu(z.to(wide))).to(dtype)


class CausalConv1d(nn.Module):
    """Depthwise causal conv (no bias) + SiLU over each sequence's [last K - 1 inputs; x]."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        # [C, 1, K], as nn.Conv1d (and so the checkpoint) stores a depthwise kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)

    def forward(
        self, x: torch.Tensor, state: RecurrentStateView, meta: AttentionMetadata
    ) -> torch.Tensor:
        rec = meta.recurrent
        snap_out = state.conv_snap if rec.snap_slots is not None else None
        weight = self.weight.view(self.weight.shape[0], -1)  # [C, K]
        return causal_conv1d(x, weight, state.conv, rec.state_slots, meta.cu_q_lens,
                             rec.seq_bounds, rec.snap_slots, snap_out)  # fmt: skip


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, options: DeltaNetOptions) -> None:
        super().__init__()
        lin = spec.linear
        assert lin is not None, "a gated-DeltaNet layer needs spec.linear"
        hk, hv, dk, dv = lin.n_key_heads, lin.n_value_heads, lin.key_head_dim, lin.value_head_dim
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.r = hv // hk
        self.grouped = options.grouped
        if options.grouped:
            shards = {"qkvz": 2 * hk * dk + 2 * hv * dv, "ba": 2 * hv}
        else:
            shards = {"qkv": lin.conv_channels, "z": hv * dv, "b": hv, "a": hv}
        self.in_proj = ShardedLinear(spec.hidden_size, shards)
        self.conv1d = CausalConv1d(lin.conv_channels, lin.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hv), requires_grad=False)
        self.norm = GatedRMSNorm(dv, spec.rms_norm_eps)
        self.out_proj = Linear(hv * dv, spec.hidden_size)
        self.scale = dk**-0.5
        self.state: RecurrentStateView | None = None  # bound by the runner

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.recurrent is not None and self.state is not None, (
            "a gated-DeltaNet layer needs meta.recurrent and a state view (bind_recurrent_state)"
        )
        t = x.shape[0]
        mixed, z, b, a = self._split(self.in_proj(x))  # [T, C], [T, Hv, Dv], [T, Hv] x2
        mixed = self.conv1d(mixed, self.state, meta)  # [T, C]
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q = q.view(t, self.hk, self.dk)
        k = k.view(t, self.hk, self.dk)
        v = v.view(t, self.hv, self.dv)
        # As transformers: sigmoid in the model dtype, the decay in fp32 (exp(A_log) in fp16
        # could overflow).
        beta = torch.sigmoid(b).float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
        rec, state = meta.recurrent, self.state
        snap_out = state.ssm_snap if rec.snap_slots is not None else None
        o = gated_delta_rule(q, k, v, g, beta, state.ssm, rec.state_slots, meta.cu_q_lens,
                             self.scale, rec.seq_bounds, rec.snap_slots, snap_out)  # fmt: skip
        o = self.norm(o, z)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(t, -1))

    def _split(
        self, proj: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projection as conv input [T, C] (q | k | v), z [T, Hv, Dv], b and a [T, Hv]."""
        t = proj.shape[0]
        if not self.grouped:
            qkv, z, b, a = self.in_proj.split(proj)
            return qkv, z.view(t, self.hv, self.dv), b, a
        qkvz, ba = self.in_proj.split(proj)
        # Key head g carries its q and k, then the r value heads g * r ... g * r + r - 1.
        rdv = self.r * self.dv
        per_head = [self.dk, self.dk, rdv, rdv]
        q, k, v, z = qkvz.view(t, self.hk, sum(per_head)).split(per_head, dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = ba.view(t, self.hk, 2 * self.r).split([self.r, self.r], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, -1), a.reshape(t, -1)
