"""GET /metrics: the engine's figures in Prometheus's text format, for a scraper or a dashboard
(vLLM, SGLang and llama.cpp's server expose the same kind of page).

Read at each scrape from `EngineService.stats()` (one engine lock, as GET /health takes), not
kept twice: a collector turns that dict into metric families, so the page always says what the
engine holds now. Names are prefixed `freetoken_`; counters end in `_total`.

- requests: running and waiting (gauges), finished by reason, preemptions (counters), the
  server's sessions (WebSocket and X-Session-Id);
- tokens of finished requests: prompt tokens prefilled and reused from the prefix cache,
  generated tokens (the work done: a request preempted and readmitted counts its re-prefill
  here too, where its usage reports its prompt once);
- memory: device bytes by part, KV pages (capacity, free, held by the prefix cache), the KV
  cache's use, and under elastic memory the budget and the slots the split gives experts;
- experts, when offloaded: the GPU cache's slots, lookups, hits, fills, misses run on the CPU
  or read from host memory, bytes filled and streamed over PCIe (the counters since the load);
- latency of finished requests (histograms): queue, time to first token, time per output
  token, end to end, and their prompt and generated sizes (engine/request_metrics.py);
- `freetoken_model_info`: model, arch, policy, expert placement, device and dtype as labels.

The page sits behind the API key when the server has one (Prometheus sends it with
`authorization: {credentials: ...}`), like every route but the web page.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PREFIX = "freetoken_"

# engine_stats()["experts"] key -> (counter name, help)
_EXPERT_COUNTERS = {
    "experts_touched": ("expert_lookups", "Distinct (layer, expert) pairs routed, per step"),
    "hits": ("expert_hits", "Expert lookups found in the GPU cache"),
    "fetched": ("expert_fills", "Missed experts copied into GPU slots"),
    "on_cpu": ("expert_cpu_runs", "Missed experts run on the CPU from host memory"),
    "direct": ("expert_direct_reads", "Missed experts read by GPU kernels from host memory"),
    "bytes_filled": ("expert_fill_bytes", "Bytes copied into GPU expert slots"),
    "bytes_streamed_h2d": ("expert_streamed_bytes", "Bytes of whole layers streamed in prefill"),
    "layers_streamed": ("expert_streamed_layers", "Layers of experts streamed in prefill"),
}
_MEMORY_PARTS = {
    "dense_bytes": "dense",
    "kv_bytes": "kv",
    "expert_bytes": "experts",
    "host_embedding_bytes": "host_embedding",
}
_LATENCY_HELP = {
    "queue_seconds": "Time from arrival to first admission",
    "time_to_first_token_seconds": "Time from arrival to the first generated token",
    "time_per_output_token_seconds": "Time per generated token after the first",
    "e2e_request_latency_seconds": "Time from arrival to the end of the request",
    "request_prompt_tokens": "Prompt tokens of finished requests",
    "request_generation_tokens": "Generated tokens of finished requests",
}


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield CounterMetricFamily(PREFIX + name, doc, value=value)


def histogram_family(name: str, doc: str, figures: dict) -> HistogramMetricFamily:
    """request_metrics.Histogram.to_json() as a family: Prometheus's buckets are cumulative."""
    buckets, running = [], 0
    for bound, count in zip([*figures["bounds"], float("inf")], figures["counts"], strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=figures["sum"])


def families(stats: dict[str, Any], sessions: int, model_id: str) -> Iterator[Metric]:
    """Engine.stats()'s dict (and the server's session count) as metric families."""
    info = GaugeMetricFamily(
        PREFIX + "model_info",
        "The served model (value 1; the labels say which)",
        labels=["model", "arch", "policy", "placement", "device", "dtype"],
    )
    placement = stats["experts"]["placement"]  # resident or offloaded
    info.add_metric(
        [model_id, stats["model"], stats["policy"], placement, stats["device"], stats["dtype"]], 1
    )
    yield info
    requests, tokens, memory = stats["requests"], stats["tokens"], stats["memory"]
    yield from _gauge("requests_running", "Requests being computed", requests["running"])
    yield from _gauge("requests_waiting", "Requests queued for admission", requests["waiting"])
    yield from _gauge(
        "sessions", "Sessions the server keeps (WebSocket and X-Session-Id)", sessions
    )
    yield from _counter("preemptions", "Requests preempted for memory", requests["preemptions"])
    latency = stats["latency"]
    finished = CounterMetricFamily(
        PREFIX + "requests_finished", "Finished requests by finish reason", labels=["reason"]
    )
    for reason, count in sorted(latency["finish_reasons"].items()):
        finished.add_metric([reason], count)
    yield finished
    yield from _counter(
        "prompt_tokens_prefilled", "Prompt tokens computed (finished requests)", tokens["prefilled"]
    )
    yield from _counter(
        "prompt_tokens_reused", "Prompt tokens taken from the prefix cache", tokens["reused"]
    )
    yield from _counter("generation_tokens", "Generated tokens (finished requests)",
                        tokens["generated"])  # fmt: skip
    parts = GaugeMetricFamily(PREFIX + "memory_bytes", "Memory by part", labels=["part"])
    for key, part in _MEMORY_PARTS.items():
        parts.add_metric([part], memory[key])
    yield parts
    capacity, free = memory["kv_pages"], memory["kv_pages_free"]
    yield from _gauge("kv_pages_capacity", "KV cache pages", capacity)
    yield from _gauge("kv_pages_free", "KV cache pages free", free)
    yield from _gauge("kv_pages_cached", "KV pages held by the prefix cache",
                      memory["kv_pages_cached"])  # fmt: skip
    yield from _gauge("kv_cache_usage_ratio", "Share of KV pages in use",
                      (capacity - free) / capacity if capacity else 0.0)  # fmt: skip
    elastic = stats.get("elastic")
    if elastic is not None:
        yield from _gauge("gpu_budget_bytes", "Elastic memory: the GPU budget", elastic["budget"])
        yield from _gauge("elastic_expert_slots", "Elastic memory: slots given to experts",
                          elastic["slots"])  # fmt: skip
    experts = stats["experts"]
    if experts.get("placement") == "offloaded":
        yield from _gauge("expert_slots", "GPU expert cache slots", experts["slots"])
        yield from _gauge("expert_pool_bytes", "Experts in host memory", experts["pool_bytes"])
        yield from _gauge("expert_miss_rate", "Share of expert lookups missed (since the load)",
                          experts["miss_rate"])  # fmt: skip
        for key, (name, doc) in _EXPERT_COUNTERS.items():
            yield from _counter(name, doc, experts.get(key))
    for name, figures in latency.items():
        if name != "finish_reasons":
            yield histogram_family(name, _LATENCY_HELP[name], figures)


class _StatsCollector(Collector):
    """Collects the families of one stats read (taken before `generate_latest`, off the event
    loop: the engine's lock may wait for a step)."""

    def __init__(self, stats: dict, sessions: int, model_id: str) -> None:
        self.stats, self.sessions, self.model_id = stats, sessions, model_id

    def collect(self) -> Iterator[Metric]:
        return families(self.stats, self.sessions, self.model_id)


async def metrics(request: Request) -> Response:
    state = request.app.state.server
    stats = await asyncio.to_thread(state.service.stats)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, len(state.hub), state.model_id))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
