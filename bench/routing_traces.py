"""Synthetic routing with controlled skew and temporal locality, for cache benchmarks.

Random routers on random weights do not route like trained models: consecutive tokens of one
sequence land on nearly the same experts (a miss rate near zero with any cache), and across
sequences the choice is near-uniform. Trained MoE routing sits in between: some experts are
popular (skew), and a token often reuses experts of the tokens just before it (locality). This
module replays such routing: `TracedRouting` wraps an expert bank and replaces each layer's
top-k ids by draws from the regime below, keeping everything else (weights, kernels, cache)
real.

Regime (per layer, per token):
- with probability `locality`, each of the k choices repeats one of the previous token's choices
  in this layer (the expert set drifts slowly);
- otherwise, choices are drawn without replacement from a Zipf distribution over the layer's
  experts, P(rank r) ~ 1 / r^skew (skew 0 = uniform), the ranking a fixed random permutation per
  layer (each layer has its own popular experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, frozen=True)
class Regime:
    skew: float = 0.0
    locality: float = 0.0

    @property
    def name(self) -> str:
        return f"zipf{self.skew:g}-loc{self.locality:g}"

    @classmethod
    def parse(cls, text: str) -> Regime:
        """ "uniform", or "zipf:1.0,loc:0.5" style."""
        if text == "uniform":
            return cls()
        fields = dict(part.split(":") for part in text.split(","))
        return cls(float(fields.get("zipf", 0)), float(fields.get("loc", 0)))


class TraceGenerator:
    def __init__(self, n_layers: int, n_experts: int, k: int, regime: Regime, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_experts, self.k, self.regime = n_experts, k, regime
        ranks = np.arange(1, n_experts + 1, dtype=np.float64)
        probs = ranks ** (-regime.skew)
        self.probs = probs / probs.sum()
        self.order = [self.rng.permutation(n_experts) for _ in range(n_layers)]
        self.last: list[np.ndarray | None] = [None] * n_layers

    def draw(self, layer: int, n_tokens: int) -> np.ndarray:
        """[n_tokens, k] expert ids for the next tokens of this layer."""
        return self.draw_all(n_tokens, [layer])[0]

    def draw_all(self, n_tokens: int, layers: list[int] | None = None) -> np.ndarray:
        """[len(layers), n_tokens, k] expert ids for the next tokens of each layer (default:
        every layer), vectorised over layers: the step's trace must cost the host microseconds,
        not the milliseconds per-layer sampling took, or it would be timed as engine overhead.
        Sampling k of E without replacement with probabilities p is the Gumbel top-k: the k
        largest of log p + Gumbel noise (the same law as successive draws)."""
        layers = list(range(len(self.last))) if layers is None else layers
        out = np.empty((len(layers), n_tokens, self.k), dtype=np.int64)
        log_p = np.log(self.probs)
        for t in range(n_tokens):
            keys = log_p + self.rng.gumbel(size=(len(layers), self.n_experts))  # [L', E]
            ranks = np.argpartition(-keys, self.k - 1, axis=1)[:, : self.k]  # [L', k]
            repeat = self.rng.random(len(layers)) < self.regime.locality
            for j, layer in enumerate(layers):
                prev = self.last[layer]
                ids = prev if prev is not None and repeat[j] else self.order[layer][ranks[j]]
                out[j, t] = ids
                self.last[layer] = ids
        return out


class TracedRouting:
    """An expert bank whose top-k ids come from a TraceGenerator (weights stay the router's).

    Under captured decode graphs the ids come from a static device buffer that
    `before_graph_step` fills with the step's draws for every layer (the segmented graphs call
    it before the step; a re-run segment reads the same draws).

    `max_tokens`: calls with more tokens keep the router's own ids (None: every call is
    traced). Decode-only tracing: a prefill chunk streams every expert whatever its ids, and
    drawing ids for thousands of tokens in Python would be timed as engine overhead."""

    def __init__(self, bank, generator: TraceGenerator, max_tokens: int | None = None) -> None:
        self.bank, self.generator, self.max_tokens = bank, generator, max_tokens
        self.static_ids: torch.Tensor | None = None  # [L, Bp, K] on the device

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        io = getattr(self.bank, "graph_io", None)
        if io is not None and io.active:  # captured graphs run decode steps only
            if self.static_ids is None:
                shape = (len(self.generator.last), *io.ids.shape[1:])
                self.static_ids = torch.zeros(shape, dtype=topk_ids.dtype, device=hidden.device)
            traced = self.static_ids[layer, : topk_ids.shape[0]]
        elif self.max_tokens is not None and topk_ids.shape[0] > self.max_tokens:
            traced = topk_ids
        else:
            ids = self.generator.draw(layer, topk_ids.shape[0])
            traced = torch.from_numpy(ids).to(device=topk_ids.device, dtype=topk_ids.dtype)
        return self.bank(layer, hidden, traced, topk_weights)

    def before_graph_step(self, n_tokens: int, padded: int) -> None:
        draws = np.zeros((len(self.generator.last), padded, self.generator.k), dtype=np.int64)
        draws[:, :n_tokens] = self.generator.draw_all(n_tokens)
        self.static_ids[:, :padded].copy_(torch.from_numpy(draws), non_blocking=False)
