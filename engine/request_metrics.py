"""RequestMetrics: the distribution of finished requests' latencies and how they ended.

`Engine.stats()` reports totals (tokens, finished, errors) and the moment's queue; what an
operator watching a server also asks is how long requests wait and take, which only the
finished requests can tell. Each request that ends (RequestOutcomes.finish) is observed once:

- queue time: arrival to its first admission (a request aborted while waiting has none);
- time to first token: arrival to its first sampled token;
- time per output token: first to last token over the tokens between (two tokens or more);
- end-to-end latency: arrival to its end, whatever the end;
- its prompt and generated token counts;
- its finish reason (stop, length, abort, error, scored).

Histograms keep per-bucket (not cumulative) counts over fixed upper bounds (the bounds vLLM's
metrics use, in seconds or tokens), their sum and their count: what the server's Prometheus
exposition (integrations/server/metrics_route.py) needs, with no metrics library in the engine.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from freetoken_agent.engine.request import Request

# Upper bounds of the buckets (the last bucket, +Inf, is implicit).
QUEUE_BOUNDS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TTFT_BOUNDS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BOUNDS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BOUNDS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                100000, 200000, 500000, 1000000)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket: `counts[i]` holds the values v with
    bounds[i-1] < v <= bounds[i]; `counts[-1]` those above the last bound."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase strictly, got {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def to_json(self) -> dict:
        return {
            "bounds": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.total,
            "count": self.count,
        }


class RequestMetrics:
    """Latency and size histograms of finished requests, and their finish reasons."""

    def __init__(self) -> None:
        self.queue_s = Histogram(QUEUE_BOUNDS_S)
        self.ttft_s = Histogram(TTFT_BOUNDS_S)
        self.tpot_s = Histogram(TPOT_BOUNDS_S)
        self.e2e_s = Histogram(E2E_BOUNDS_S)
        self.prompt_tokens = Histogram(TOKEN_BOUNDS)
        self.generated_tokens = Histogram(TOKEN_BOUNDS)
        self.finish_reasons: Counter[str] = Counter()

    def observe(self, req: Request) -> None:
        """A request that has just ended (its finish_reason and finish_time set)."""
        self.finish_reasons[req.finish_reason or "unknown"] += 1
        arrival, end = req.arrival_time, req.finish_time
        if req.first_admit_time is not None:
            self.queue_s.observe(req.first_admit_time - arrival)
        first = req.first_token_time
        if first is not None:
            self.ttft_s.observe(first - arrival)
            n_out = len(req.output_ids)
            if n_out > 1 and end is not None:
                # The time between the first and the last token, over the tokens after the
                # first (a request's end comes with its last token, or later on an abort).
                self.tpot_s.observe((end - first) / (n_out - 1))
        if end is not None:
            self.e2e_s.observe(end - arrival)
        self.prompt_tokens.observe(len(req.prompt_ids))
        self.generated_tokens.observe(len(req.output_ids))

    def histograms(self) -> dict[str, Histogram]:
        return {
            "queue_seconds": self.queue_s,
            "time_to_first_token_seconds": self.ttft_s,
            "time_per_output_token_seconds": self.tpot_s,
            "e2e_request_latency_seconds": self.e2e_s,
            "request_prompt_tokens": self.prompt_tokens,
            "request_generation_tokens": self.generated_tokens,
        }

    def to_json(self) -> dict:
        return {
            "finish_reasons": dict(self.finish_reasons),
            **{name: h.to_json() for name, h in self.histograms().items()},
        }
