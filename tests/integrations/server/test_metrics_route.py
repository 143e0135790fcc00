"""GET /metrics: the engine's figures in Prometheus's text format, parsed back with the
library's own parser and compared with what the requests made."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.integrations.server import create_app


def _scrape(client: TestClient, **headers: str) -> dict[str, list]:
    reply = client.get("/metrics", headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(reply.text)}


def _value(samples: list, name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and all(
        s.labels.get(k) == v for k, v in labels.items())]  # fmt: skip
    assert len(found) == 1, (name, labels, samples)
    return found[0]


def test_the_page_counts_the_requests_served(client, engine, rng_seed):
    rng = random.Random(rng_seed)
    first = _scrape(client)
    assert _value(first["freetoken_requests_running"], "freetoken_requests_running") == 0
    assert first["freetoken_requests_finished"] == []  # nothing ended yet
    usages, reasons = [], {}
    for _ in range(rng.randint(2, 5)):
        body = {
            "messages": [{"role": "user", "content": f"say {rng.random():.6f}"}],
            "max_tokens": rng.randint(1, 12),
            "temperature": rng.choice([0, 1.0]),
            "seed": rng.randrange(1 << 30),
        }
        reply = client.post("/v1/chat/completions", json=body).json()
        usages.append(reply["usage"])
        reason = reply["choices"][0]["finish_reason"]
        reasons[reason] = reasons.get(reason, 0) + 1
    page = _scrape(client)
    n = len(usages)
    for reason, count in reasons.items():
        name = "freetoken_requests_finished_total"
        assert _value(page["freetoken_requests_finished"], name, reason=reason) == count
    generated = _value(page["freetoken_generation_tokens"], "freetoken_generation_tokens_total")
    assert generated == sum(u["completion_tokens"] for u in usages)
    prompt = page["freetoken_prompt_tokens_prefilled"] + page["freetoken_prompt_tokens_reused"]
    assert sum(s.value for s in prompt) == sum(u["prompt_tokens"] for u in usages)
    ttft = page["freetoken_time_to_first_token_seconds"]
    assert _value(ttft, "freetoken_time_to_first_token_seconds_count") == n
    buckets = [s for s in ttft if s.name.endswith("_bucket")]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf" and counts[-1] == n
    sizes = page["freetoken_request_prompt_tokens"]
    assert _value(sizes, "freetoken_request_prompt_tokens_sum") == sum(
        u["prompt_tokens"] for u in usages
    )
    usage = _value(page["freetoken_kv_cache_usage_ratio"], "freetoken_kv_cache_usage_ratio")
    assert 0 <= usage <= 1
    info = page["freetoken_model_info"][0]
    assert info.labels["arch"] == engine.spec.arch and info.labels["policy"] == engine.config.policy
    assert info.labels["placement"] == "resident"
    parts = {s.labels["part"]: s.value for s in page["freetoken_memory_bytes"]}
    assert parts["kv"] == engine.kv.nbytes and parts["dense"] > 0


def test_an_offloaded_engine_reports_its_expert_cache(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = Engine.load(model_dir, device="cpu", progress=False, policy="transfer",
                         expert_slots=rng.randint(1, 8), kv_tokens=1024,
                         max_model_len=512)  # fmt: skip
    with TestClient(create_app(engine)) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": rng.randint(2, 6)}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        page = _scrape(client)
    experts = engine.stats()["experts"]
    assert _value(page["freetoken_expert_slots"], "freetoken_expert_slots") == experts["slots"]
    lookups = _value(page["freetoken_expert_lookups"], "freetoken_expert_lookups_total")
    hits = _value(page["freetoken_expert_hits"], "freetoken_expert_hits_total")
    assert lookups == experts["experts_touched"] > 0 and hits == experts["hits"] < lookups
    assert page["freetoken_model_info"][0].labels["placement"] == "offloaded"
    fills = _value(page["freetoken_expert_fills"], "freetoken_expert_fills_total")
    assert fills == experts["fetched"] > 0


def test_the_page_is_behind_the_api_key(make_client):
    client = make_client(api_key="k-metrics")
    assert client.get("/metrics").status_code == 401
    assert "freetoken_model_info" in _scrape(client, authorization="Bearer k-metrics")


@pytest.mark.parametrize("method", ["post", "put"])
def test_other_methods_are_refused(client, method):
    assert getattr(client, method)("/metrics").status_code == 405
