"""GET /v1/memory and POST /v1/memory/budget: the elastic split over HTTP."""

from __future__ import annotations

import random

import pytest
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.loading import dense_nbytes
from freetoken_agent.integrations.server import create_app


@pytest.fixture
def elastic_client(model_dir):
    """The demo model with experts offloaded under a simulated budget (elastic memory)."""
    probe = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096)
    spec = probe.spec
    kv_unit = 2 * len(spec.attention_layers) * 16 * spec.n_kv_heads * spec.head_dim * 4
    budget = (
        dense_nbytes(probe.loaded.model)
        + workspace_bytes(spec, probe.config, offloaded=True)
        + 65 * kv_unit
        + 41 * spec.expert_bytes
    )
    engine = Engine.load(
        model_dir, device="cpu", progress=False, policy="transfer", gpu_budget=budget,
        kv_tokens=1024, max_model_len=1024, elastic_group_bytes=4 * spec.expert_bytes,
    )  # fmt: skip
    assert engine.memory is not None
    with TestClient(create_app(engine)) as client:
        yield client, engine


def test_budget_change_applies_and_is_traced(elastic_client):
    client, engine = elastic_client
    before = client.get("/v1/memory").json()
    loaded = min(engine.config.gpu_budget, engine.memory.max_budget)  # the user's, at most
    assert before["elastic"]["budget"] == loaded  # the arena's ceiling (here: the same)
    assert before["trace"]["records"][0]["reason"] == "load"
    cut = loaded - 8 * engine.spec.expert_bytes
    reply = client.post("/v1/memory/budget", json={"bytes": cut})
    assert reply.status_code == 200, reply.text
    assert reply.json()["elastic"]["budget"] == cut
    assert reply.json()["budget"] == reply.json()["requested"] == cut
    after = client.get("/v1/memory?last=5").json()
    assert after["trace"]["records"][-1]["budget"] == cut  # applied at once: the engine is idle
    assert len(after["trace"]["records"]) <= 5
    engine.check_integrity()
    reply = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"bytes": -5}, "bytes"),
        ({"gb": "eight"}, "gb"),
        ({"bytes": 1, "gb": 1}, None),
        ({}, None),
        ({"bytes": True}, "bytes"),
        ({"bytes": 10}, None),  # below the fixed bytes: the engine says why
    ],
)
def test_bad_budgets_are_400(elastic_client, body, param):
    client, engine = elastic_client
    reply = client.post("/v1/memory/budget", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    assert engine.memory.budget == min(engine.config.gpu_budget, engine.memory.max_budget)


def test_not_elastic_engine_says_so(client):
    reply = client.post("/v1/memory/budget", json={"gb": 8})
    assert reply.status_code == 400
    assert "not elastic" in reply.json()["error"]["message"]
    assert client.get("/v1/memory").json()["trace"] is None


def test_a_budget_past_the_ceiling_answers_the_budget_taken(elastic_client, rng_seed):
    """The engine caps a budget at the ceiling its arena reserved: the answer's `budget` is
    what it took (it echoed the request), `requested` what was asked."""
    client, engine = elastic_client
    ceiling = engine.memory.max_budget
    asked = ceiling + random.Random(rng_seed).randint(1, 1 << 30)
    reply = client.post("/v1/memory/budget", json={"bytes": asked})
    assert reply.status_code == 200, reply.text
    assert reply.json()["requested"] == asked
    assert reply.json()["budget"] == ceiling == engine.memory.budget
