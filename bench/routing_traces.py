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


BLOCK_TOKENS = 64  # tokens drawn at once for every layer (decode then reads a slice a step)
OVERSAMPLE = 3  # draws with replacement per choice: enough for k distinct but ~1e-9 of rows


class TraceGenerator:
    """Each layer's routing is one endless stream of tokens, drawn BLOCK_TOKENS at a time for
    every layer at once and read in order, however the calls slice it (per layer in eager
    steps, all layers in graph steps): two generators of one seed give every engine the same
    tokens. Drawing a token at a time cost the host ~0.26 ms a decode step at 40 layers x 256
    experts (Gumbel keys for every expert, a Python loop over layers), timed as every engine's
    overhead; a block costs ~10 us a token.

    k distinct choices of E with probabilities p, in order, are drawn as successive draws with
    replacement keeping first occurrences: the law of sampling without replacement, without
    E keys per token. The rare row with fewer than k distinct draws is drawn again."""

    def __init__(self, n_layers: int, n_experts: int, k: int, regime: Regime, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_experts, self.k, self.regime = n_experts, k, regime
        ranks = np.arange(1, n_experts + 1, dtype=np.float64)
        probs = ranks ** (-regime.skew)
        self.probs = probs / probs.sum()
        self._cdf = np.cumsum(self.probs)
        self._cdf[-1] = 1.0
        self.order = np.stack([self.rng.permutation(n_experts) for _ in range(n_layers)])  # [L, E]
        self.last: list[np.ndarray | None] = [None] * n_layers  # each stream's last token drawn
        self._buf = np.empty((n_layers, 0, k), dtype=np.int64)  # [L, drawn - read, k]
        self._read = [0] * n_layers  # tokens of _buf each layer has read

    def draw(self, layer: int, n_tokens: int) -> np.ndarray:
        """[n_tokens, k] expert ids for the next tokens of this layer."""
        lo = self._read[layer]
        if lo + n_tokens > self._buf.shape[1]:
            self._ensure(lo + n_tokens)
            lo = self._read[layer]
        self._read[layer] = lo + n_tokens
        return self._buf[layer, lo : lo + n_tokens].copy()

    def reserve(self, n_tokens: int) -> None:
        """Draw now the next `n_tokens` of every layer's stream (the same stream: blocks are
        drawn whole whenever they are drawn), so that reading them later costs a slice only:
        a measurement reserves its tokens before its clock starts."""
        self._ensure(max(self._read) + n_tokens)

    def draw_all(self, n_tokens: int, layers: list[int] | None = None) -> np.ndarray:
        """[len(layers), n_tokens, k] expert ids for the next tokens of each layer (default:
        every layer: one slice when every stream is read to the same token, as in decode)."""
        if layers is None and min(self._read) == max(self._read):
            lo = self._read[0]
            if lo + n_tokens > self._buf.shape[1]:
                self._ensure(lo + n_tokens)
                lo = self._read[0]
            self._read = [lo + n_tokens] * len(self._read)
            return self._buf[:, lo : lo + n_tokens].copy()
        layers = range(len(self.last)) if layers is None else layers
        return np.stack([self.draw(layer, n_tokens) for layer in layers])

    def _ensure(self, n: int) -> None:
        """At least `n` tokens past what every layer has read: the read part is dropped, then
        blocks are drawn for every layer."""
        done = min(self._read)
        if done:
            self._buf = self._buf[:, done:]
            self._read = [r - done for r in self._read]
            n -= done
        blocks = [self._buf]
        while n > sum(b.shape[1] for b in blocks):  # whole blocks: the stream is the same
            blocks.append(self._block(BLOCK_TOKENS))  # however the calls slice it
        if len(blocks) > 1:
            self._buf = np.concatenate(blocks, axis=1)

    def _block(self, t: int) -> np.ndarray:
        """[L, t, k] the next t tokens of every layer's stream."""
        n_layers, k = len(self.last), self.k
        fresh = self.order[
            np.arange(n_layers)[:, None, None], self._ranks(n_layers * t).reshape(n_layers, t, k)
        ]
        # Locality: a token repeats the previous token's choices in its layer with probability
        # `locality`, so it carries the last fresh draw at or before it (or the stream's last).
        repeat = self.rng.random((n_layers, t)) < self.regime.locality
        src = np.where(repeat, -1, np.arange(t))
        src = np.maximum.accumulate(src, axis=1)  # [L, t]: the fresh token each one shows
        out = fresh[np.arange(n_layers)[:, None], np.maximum(src, 0)]
        for layer, prev in enumerate(self.last):
            carried = src[layer] < 0
            if carried.any():  # repeats before the block's first fresh token
                out[layer, carried] = prev if prev is not None else fresh[layer, 0]
            self.last[layer] = out[layer, -1].copy()
        return out

    def _ranks(self, rows: int) -> np.ndarray:
        """[rows, k] ranks (0 = most popular), k distinct each, in draw order."""
        k, m = self.k, self.k * OVERSAMPLE
        draws = np.searchsorted(self._cdf, self.rng.random((rows, m)), side="right")  # [R, M]
        draws = np.minimum(draws, self.n_experts - 1)
        order = np.argsort(draws, axis=1, kind="stable")
        sorted_draws = np.take_along_axis(draws, order, axis=1)
        first = np.ones_like(sorted_draws, dtype=bool)
        first[:, 1:] = sorted_draws[:, 1:] != sorted_draws[:, :-1]  # first of equal values
        is_first = np.empty_like(first)
        np.put_along_axis(is_first, order, first, axis=1)  # back in draw order
        short = np.flatnonzero(is_first.sum(axis=1) < k)
        pos = np.argsort(~is_first, axis=1, kind="stable")[:, :k]  # the first k first draws
        ranks = np.take_along_axis(draws, pos, axis=1)
        for r in short:  # fewer than k distinct in m draws (skewed and small E): draw again
            ranks[r] = self._ranks_slow()
        return ranks

    def _ranks_slow(self) -> np.ndarray:
        """k distinct ranks by successive draws (the same law, a row at a time)."""
        seen: list[int] = []
        while len(seen) < self.k:
            r = min(int(np.searchsorted(self._cdf, self.rng.random(), side="right")),
                    self.n_experts - 1)  # fmt: skip
            if r not in seen:
                seen.append(r)
        return np.array(seen, dtype=np.int64)


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
        self._staged: torch.Tensor | None = None  # [L, Bp, K] pinned: the step's draws

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

    def reserve(self, n_tokens: int) -> None:
        """Draw the next `n_tokens` of every layer ahead (TraceGenerator.reserve): a block
        drawn inside a timed decode step cost it 2 ms at 12 layers and 8 ms at 48 on the dev
        box, every 64 tokens; the engine's own router has no such cost."""
        self.generator.reserve(n_tokens)

    def before_graph_step(self, n_tokens: int, padded: int) -> None:
        """The step's draws into the graphs' id buffer: through a pinned buffer, one copy the
        graph is queued behind (free again when the step ends: the runner reads its tokens)."""
        ids = self.static_ids
        if self._staged is None or self._staged.shape != ids.shape:
            self._staged = torch.zeros(ids.shape, dtype=ids.dtype, pin_memory=ids.is_cuda)
        staged = self._staged[:, :padded]
        staged.zero_()
        staged[:, :n_tokens] = torch.from_numpy(self.generator.draw_all(n_tokens))
        ids[:, :padded].copy_(staged, non_blocking=True)
