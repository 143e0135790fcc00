"""How well the next layer's router, applied to this layer's hidden state, predicts the next
layer's experts in a random model: the question before building a pre-gated prefetch (fill
layer l+1's likely misses while layer l computes), on any CPU.

    python -m freetoken_agent.bench routing-prediction [--layers 24] [--tokens 128]

A causal forward of --tokens tokens through a Qwen3-MoE-shaped decoder (bench/random_model's
Qwen3-30B-A3B shape: GQA attention with q/k norms and RoPE, a softmax top-k router with
renormalised weights, SwiGLU experts) with N(0, --std) weights and norms at 1, as
bench/random_model draws them for the device benches. Each layer's weights are drawn when the
forward reaches it and dropped after it (a 30B-shaped layer's experts are ~2.4 GB in fp32), so
it runs in a few GB. This is the model's mathematics written out, not the engine's kernels: the
routing it measures is the random model's, which is what `bench offload`'s native regime routes
by (its trace regimes cannot be predicted from hidden states at all).

Per layer l >= 1 it reports:
- recall: the share of layer l's routed (token, expert) pairs that layer l's router picks
  from layer l-1's hidden state after attention (the earliest point a prefetch could start,
  a whole MoE and attention ahead);
- new / caught: the pairs whose expert no earlier token routed to at layer l (after the
  first --warm tokens), the misses of a cache that holds every expert once used, which is what
  a prefetch would have to catch (the hits need no prefetch), and how many the prediction
  names;
- wasted: predicted experts outside that cache that the token does not route to: copies a
  prefetch would make for nothing, on the link the misses need.

The fortieth session's run (24 layers, 128 tokens, std 0.02; `routing_prediction_s40.json`,
bench/results/NOTES.md): recall 0.15-0.46 over layers 1-4, 0.56-0.91 past them; of 260 misses,
116 predicted (0.45), against 2,901 predicted experts outside the cache and not routed: 25
copies for nothing a caught miss. A pre-gated prefetch would flood the link in this model.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from freetoken_agent.bench.random_model import QWEN3_30B_A3B
from freetoken_agent.help_format import DefaultsHelpFormatter


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    rope_theta: float

    @classmethod
    def of(cls, cfg: dict) -> Shape:
        return cls(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                   cfg["head_dim"], cfg["num_experts"], cfg["num_experts_per_tok"],
                   cfg["moe_intermediate_size"], cfg["rope_theta"])  # fmt: skip


@dataclass
class LayerRow:
    layer: int
    recall: float  # of all routed pairs, from the previous layer's post-attention state
    new_pairs: int  # pairs whose expert no earlier token routed to (after the warm tokens)
    new_caught: int  # of those, predicted
    wasted: int  # predicted experts outside that cache and not routed: copies for nothing
    distinct: int  # experts routed by any token at this layer


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm with unit weights (random models keep norms at 1)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, half-split form. x: [T, n, D]; positions: [T]."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = positions[:, None].float() * inv[None]  # [T, D/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def route(state: torch.Tensor, gate: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on a layer's post-attention residual state. state: [T, H], gate: [E, H].
    Returns (weights [T, k] renormalised, experts [T, k])."""
    probs = (rms_norm(state) @ gate.T).softmax(-1)
    weights, experts = probs.topk(k, -1)
    return weights / weights.sum(-1, keepdim=True), experts


def predicted_share(predicted: torch.Tensor, routed: torch.Tensor) -> float:
    """The share of routed (token, expert) pairs that the prediction names. Both [T, k]."""
    hit = (routed[:, :, None] == predicted[:, None, :]).any(-1)  # [T, k]
    return hit.sum().item() / hit.numel()


def new_pairs(routed: torch.Tensor, predicted: torch.Tensor, warm: int) -> tuple[int, int, int]:
    """Counting tokens from `warm` on, with a cache that holds every expert an earlier token
    routed to: (misses: pairs whose expert no earlier token routed to, of them predicted,
    wasted: predicted experts outside the cache that the token does not route to, which a
    prefetch would copy for nothing). routed, predicted: [T, k]."""
    seen: set[int] = set()
    new = caught = wasted = 0
    for t in range(routed.shape[0]):
        row, guess = set(routed[t].tolist()), set(predicted[t].tolist())
        if t >= warm:
            fresh = row - seen
            new += len(fresh)
            caught += len(fresh & guess)
            wasted += len(guess - seen - row)
        seen |= row
    return new, caught, wasted


class RandomDecoder:
    """The random model's layers, drawn one at a time from one generator (layer l's weights do
    not depend on how many layers run after it)."""

    def __init__(self, shape: Shape, std: float, seed: int):
        self.shape, self.std = shape, std
        self.gen = torch.Generator().manual_seed(seed)

    def draw(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.gen) * self.std

    def attention(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A causal GQA attention block's output (before the residual add). h: [T, H]."""
        s = self.shape
        t, d = h.shape[0], s.head_dim
        x = rms_norm(h)
        q = (x @ self.draw(s.heads * d, s.hidden).T).view(t, s.heads, d)
        k = (x @ self.draw(s.kv_heads * d, s.hidden).T).view(t, s.kv_heads, d)
        v = (x @ self.draw(s.kv_heads * d, s.hidden).T).view(t, s.kv_heads, d)
        q = rotate(rms_norm(q), positions, s.rope_theta)
        k = rotate(rms_norm(k), positions, s.rope_theta)
        group = s.heads // s.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("tnd,snd->nts", q, k) / math.sqrt(d)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        mixed = torch.einsum("nts,snd->tnd", scores.masked_fill(future, -math.inf).softmax(-1), v)
        return mixed.reshape(t, s.heads * d) @ self.draw(s.hidden, s.heads * d).T

    def experts(self, state: torch.Tensor, weights: torch.Tensor, routed: torch.Tensor):
        """The routed SwiGLU experts' weighted sum. Each expert's weights are drawn in id order
        (as a bank would hold them), whether or not a token routes to it."""
        s = self.shape
        x, out = rms_norm(state), torch.zeros_like(state)
        for e in range(s.experts):
            gate, up = self.draw(s.expert_width, s.hidden), self.draw(s.expert_width, s.hidden)
            down = self.draw(s.hidden, s.expert_width)
            rows, place = (routed == e).nonzero(as_tuple=True)
            if rows.numel():
                xe = x[rows]
                y = (F.silu(xe @ gate.T) * (xe @ up.T)) @ down.T
                out.index_add_(0, rows, weights[rows, place, None] * y)
        return out


def measure(shape: Shape, layers: int, tokens: int, std: float, seed: int, warm: int):
    """The forward, with each layer's routing beside its prediction from the layer before."""
    model = RandomDecoder(shape, std, seed)
    gates = [model.draw(shape.experts, shape.hidden) for _ in range(layers)]
    h = model.draw(tokens, shape.hidden)  # the embeddings of random tokens
    positions = torch.arange(tokens)
    rows, before = [], None
    for layer in range(layers):
        h = h + model.attention(h, positions)
        weights, routed = route(h, gates[layer], shape.top_k)
        if before is not None:
            _, predicted = route(before, gates[layer], shape.top_k)
            new, caught, wasted = new_pairs(routed, predicted, warm)
            rows.append(LayerRow(layer, predicted_share(predicted, routed), new, caught, wasted,
                                 routed.unique().numel()))  # fmt: skip
        before = h
        h = h + model.experts(h, weights, routed)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench routing-prediction", description=__doc__,
                                 formatter_class=DefaultsHelpFormatter)  # fmt: skip
    ap.add_argument("--layers", type=int, default=24, help="layers of the forward")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the causal forward")
    ap.add_argument("--std", type=float, default=0.02, help="weights' N(0, std), as the benches")
    ap.add_argument("--seed", type=int, default=0, help="the weights' generator seed")
    ap.add_argument(
        "--warm",
        type=int,
        default=8,
        help="tokens before new experts are counted (the cache's cold start)",
    )
    ap.add_argument(
        "--scale",
        type=int,
        default=1,
        help="divide hidden, heads, kv heads and expert width by this (a smaller run)",
    )
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args(argv)
    cfg = dict(QWEN3_30B_A3B)
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "moe_intermediate_size",
    ):
        cfg[key] = max(1, cfg[key] // args.scale)
    shape = Shape.of(cfg)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = measure(shape, args.layers, args.tokens, args.std, args.seed, args.warm)
    new = sum(r.new_pairs for r in rows)
    caught = sum(r.new_caught for r in rows)
    wasted = sum(r.wasted for r in rows)
    for r in rows:
        print(f"layer {r.layer:3d}  recall {r.recall:.3f}  distinct {r.distinct:4d}  "
              f"new {r.new_pairs:3d}  caught {r.new_caught:3d}  wasted {r.wasted:3d}")  # fmt: skip
    print(
        f"new experts predicted: {caught} of {new} ({caught / max(new, 1):.2f}); "
        f"predicted copies for nothing: {wasted}"
    )
    if args.out:
        report = {"shape": asdict(shape), "args": vars(args), "rows": [asdict(r) for r in rows],
                  "new_pairs": new, "new_caught": caught, "wasted": wasted}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
