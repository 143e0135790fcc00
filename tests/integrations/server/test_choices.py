"""OpenAI's `n` on both routes (integrations/server/choices.py): n choices indexed 0..n-1, each
its own generation; seeded, choice i is seed + i (so they differ, and each is the single
request of that seed); greedy ones are identical. Streamed, the chunks of each index add up to
the whole response's choice, each choice has one finish chunk and the usage comes once; the
usage counts the prompt once and the completions of all. Tool calls and logprobs are per
choice; the prompt is prefilled once and reused by the other choices; a failing choice fails
the request and ends the others; a client that leaves ends them all; bad n values are 400s."""

from __future__ import annotations

import json
import random
import string

import pytest
from hybrid_chat import make_hybrid_chat
from lookup_tool import LOOKUP_TOOL
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.integrations.server import create_app

ROUTES = ["/v1/chat/completions", "/v1/completions"]
TOOL = LOOKUP_TOOL


def _words(rng: random.Random, lo: int = 3, hi: int = 12) -> str:
    letters = string.ascii_lowercase
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))
        for _ in range(rng.randint(lo, hi))
    )


def _body(route: str, rng: random.Random, **extra) -> dict:
    if route == "/v1/completions":
        return {"prompt": _words(rng), "max_tokens": 8, **extra}
    return {"messages": [{"role": "user", "content": _words(rng)}], "max_tokens": 8, **extra}


def _answer(route: str, choice: dict) -> str:
    return choice["text"] if route == "/v1/completions" else choice["message"]["content"]


def _stream(client: TestClient, route: str, body: dict, read_sse) -> list:
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return read_sse(list(r.iter_lines()))


@pytest.mark.parametrize("route", ROUTES)
def test_seeded_choices_differ_and_each_is_its_seeds_single_request(client, rng_seed, route):
    rng = random.Random(rng_seed)
    n, seed = rng.randint(2, 4), rng.randrange(2**31)
    body = _body(route, rng, temperature=1.0, seed=seed, ignore_eos=True, max_tokens=12, n=n)
    r = client.post(route, json=body).json()
    assert [c["index"] for c in r["choices"]] == list(range(n)), r
    answers = [_answer(route, c) for c in r["choices"]]
    assert len(set(answers)) > 1, answers  # 12 sampled tokens each: the same would be a fluke
    again = client.post(route, json=body).json()
    assert [_answer(route, c) for c in again["choices"]] == answers
    for i, answer in enumerate(answers):  # vLLM's rule: choice i is seeded seed + i
        alone = client.post(route, json={**body, "n": 1, "seed": seed + i}).json()
        assert _answer(route, alone["choices"][0]) == answer, (i, seed)
    assert r["usage"]["completion_tokens"] == 12 * n
    assert r["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]  # counted once


@pytest.mark.parametrize("route", ROUTES)
def test_greedy_choices_are_identical(client, rng_seed, route):
    rng = random.Random(rng_seed)
    body = _body(route, rng, temperature=0, n=3)
    r = client.post(route, json=body).json()
    alone = client.post(route, json={**body, "n": None}).json()
    assert [_answer(route, c) for c in r["choices"]] == [_answer(route, alone["choices"][0])] * 3
    assert [c["finish_reason"] for c in r["choices"]] == [alone["choices"][0]["finish_reason"]] * 3


@pytest.mark.parametrize("route", ROUTES)
def test_streamed_chunks_reassemble_into_the_whole_choices(client, read_sse, rng_seed, route):
    rng = random.Random(rng_seed)
    n = rng.randint(2, 4)
    body = _body(route, rng, temperature=0.8, seed=rng.randrange(2**31), n=n, logprobs=True)
    if route == "/v1/completions":
        body["logprobs"] = 1
    whole = client.post(route, json=body).json()
    body["stream_options"] = {"include_usage": True}
    events = _stream(client, route, body, read_sse)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == []
    for key in ("prompt_tokens", "completion_tokens"):  # cached_tokens: the first run's prompt
        assert usage["usage"][key] == whole["usage"][key]
    texts, reasons, logprobs, offsets = {}, {}, {}, {}
    for chunk in chunks:
        (choice,) = chunk["choices"]  # one choice a chunk, under its index
        i = choice["index"]
        if route == "/v1/chat/completions" and i not in texts:  # each choice's first chunk
            assert choice["delta"] == {"role": "assistant", "content": ""}, chunk
        piece = choice.get("text") if route == "/v1/completions" else choice["delta"].get("content")
        texts[i] = texts.get(i, "") + (piece or "")
        if choice["finish_reason"] is not None:
            assert i not in reasons, f"choice {i} finished twice"
            reasons[i] = choice["finish_reason"]
        if choice["logprobs"] is not None:
            key = "tokens" if route == "/v1/completions" else "content"
            logprobs.setdefault(i, []).extend(choice["logprobs"][key])
            offsets.setdefault(i, []).extend(choice["logprobs"].get("text_offset", []))
    want = whole["choices"]
    assert [texts[i] for i in range(n)] == [_answer(route, c) or "" for c in want]
    assert [reasons[i] for i in range(n)] == [c["finish_reason"] for c in want]
    # Each choice's entries, in its own chunks: the tokens the whole response lists for it
    # (their values may differ in the last bits: the second request reuses the cached prompt).
    key = "tokens" if route == "/v1/completions" else "content"
    tokens = [[e if route == "/v1/completions" else e["token"] for e in c["logprobs"][key]]
              for c in want]  # fmt: skip
    assert [[e if route == "/v1/completions" else e["token"] for e in logprobs[i]]
            for i in range(n)] == tokens  # fmt: skip
    assert sum(map(len, tokens)) == whole["usage"]["completion_tokens"]
    if route == "/v1/completions":  # offsets into each choice's own text
        assert [offsets[i] for i in range(n)] == [c["logprobs"]["text_offset"] for c in want]


def test_forced_tool_calls_are_made_by_every_choice(client, read_sse, rng_seed):
    """tool_choice "required": each choice is constrained and parsed on its own, so each has
    its call, numbered 0 within it, streamed or whole."""
    rng = random.Random(rng_seed)
    n = rng.randint(2, 3)
    body = _body("/v1/chat/completions", rng, tools=[TOOL], tool_choice="required", n=n,
                 temperature=1.0, seed=rng.randrange(2**31), max_tokens=40)  # fmt: skip
    r = client.post("/v1/chat/completions", json=body).json()
    calls = []
    for choice in r["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "lookup"
        calls.append(json.loads(call["function"]["arguments"]))
    streamed: dict[int, list] = {}
    for chunk in _stream(client, "/v1/chat/completions", body, read_sse)[:-1]:
        (choice,) = chunk["choices"]
        streamed.setdefault(choice["index"], []).extend(choice["delta"].get("tool_calls", []))
    assert [[c["index"] for c in streamed[i]] for i in range(n)] == [[0]] * n
    got = [json.loads(streamed[i][0]["function"]["arguments"]) for i in range(n)]
    assert got == calls


@pytest.mark.parametrize(
    ("route", "hybrid"), [(r, False) for r in ROUTES] + [(r, True) for r in ROUTES]
)
def test_the_other_choices_reuse_the_prompt(model_dir, tmp_path, rng_seed, route, hybrid):
    """The first choice prefills the prompt, 64 tokens a step; the others find it cached (its
    full pages). Started beside it, they would prefill it too: the cache takes a prompt only
    once its prefill ends. A hybrid model resumes from a recurrent checkpoint, which a text
    completion's prompt had only at its end (the others prefilled it all), and a chat's at the
    template's anchors, the deepest in the prompt's partial last page, which the cache takes
    only when the first choice ends (the others prefilled from the turn's start)."""
    rng = random.Random(rng_seed)
    if hybrid:
        make_hybrid_chat(tmp_path, rng_seed)
        model_dir = tmp_path
    engine = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024, max_batched_tokens=64)  # fmt: skip
    assert engine.spec.is_hybrid == hybrid
    with TestClient(create_app(engine)) as client:
        n = rng.randint(2, 4)
        # Long replies (min_tokens): the first choice still runs when the others start, so
        # only what it cached while prefilling can serve them, not its finished prompt.
        body = _body(route, rng, max_tokens=300, min_tokens=300, n=n, temperature=1.0)
        if route == "/v1/completions":
            body["prompt"] = [rng.randrange(3, 1000) for _ in range(rng.randint(120, 300))]
        else:
            body["messages"][0]["content"] = _words(rng, 60, 90)
            # A prompt whose template anchors all lie in its partial last page (the generation
            # prompt, a few tokens, fits in the 8 or more past its last full page), where the
            # hybrid choices cannot resume without the prompt's page-boundary checkpoint.
            count = lambda: client.post("/tokenize", json={"messages": body["messages"]})  # noqa: E731
            while count().json()["count"] % engine.kv.page_size < 8:
                body["messages"][0]["content"] += " " + _words(rng, 1, 1)
        r = client.post(route, json=body).json()
        assert len(r["choices"]) == n
        totals, page = engine.outcomes.totals, engine.kv.page_size
        length = r["usage"]["prompt_tokens"]
        where = (totals, length)
        assert totals["reused"] >= (n - 1) * (length - page), where
        assert totals["prefilled"] <= length + (n - 1) * page, where


@pytest.mark.parametrize("route", ROUTES)
def test_bad_n_is_a_400_naming_n(client, api_error, rng_seed, route):
    rng = random.Random(rng_seed)
    for value in [0, -1, 17, rng.randint(17, 10**6), True, 1.0, "2", [2]]:
        error = api_error(client.post(route, json=_body(route, rng, n=value)), 400)
        assert error["param"] == "n" and "n must be" in error["message"], (value, error)
    r = client.post(route, json=_body(route, rng, n=16, max_tokens=1))
    assert len(r.json()["choices"]) == 16


@pytest.fixture
def paced(paced_client):
    """A PacedEngine behind a started client: long replies written slowly."""
    paced_client[0].slow_after = 1
    return paced_client


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_choice_fails_the_request_and_ends_the_others(paced, read_sse, rng_seed,
                                                                  stream):  # fmt: skip
    """Choice 1's engine request fails: the response is the engine's error (a 500 whole, an
    error object streamed), as for a single choice, and the other choices are aborted long
    before their replies would end."""
    rng = random.Random(rng_seed)
    fake, client = paced
    n, broken = 3, rng.randint(1, 2)
    long = _words(rng, 300, 300)
    message = _words(rng, 2, 4)
    fake.replies = [(long, "stop")] * n
    fake.replies[broken] = ("", "error", message)
    body = _body("/v1/chat/completions", rng, n=n, max_tokens=2000)
    if stream:
        events = _stream(client, "/v1/chat/completions", body, read_sse)
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == message, events[-2:]
        assert not any(c["choices"] and c["choices"][0]["finish_reason"] for c in events[:-2])
    else:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["message"] == message, r.text
    # All ended, only the broken one by itself: the others were aborted, not run to their end.
    assert fake.submitted == n and not fake.running and fake.finished == 1


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_first_choice_failing_at_once_starts_no_other(paced, read_sse, rng_seed, route,
                                                        stream):  # fmt: skip
    """Choice 0's request fails before its first token: the others wait for that first event
    to start (the prompt's cache), and now never start; the response is the error."""
    rng = random.Random(rng_seed)
    fake, client = paced
    n = rng.randint(2, 4)
    message = _words(rng, 2, 4)
    fake.replies = [("", "error", message)] + [(_words(rng, 300, 300), "stop")] * (n - 1)
    body = _body(route, rng, n=n, max_tokens=2000)
    if stream:
        events = _stream(client, route, body, read_sse)
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == message, events[-2:]
    else:
        r = client.post(route, json=body)
        assert r.status_code == 500 and r.json()["error"]["message"] == message, r.text
    assert fake.submitted == 1 and not fake.running


def test_a_client_that_leaves_ends_every_choice(paced, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = paced
    n = rng.randint(2, 4)
    fake.replies = [(_words(rng, 300, 300), "stop")] * n
    body = _body("/v1/completions", rng, n=n, max_tokens=2000, stream=True)
    seen = set()
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == n:
                break  # every choice has begun: leave
    service = client.app.state.server.service
    with service.lock:
        assert fake.submitted == n and not fake.running and fake.finished == 0


def test_a_session_keeps_the_first_choice(client, rng_seed):
    """With X-Session-Id, choice 0 runs on the session (its history keeps that reply); the
    others run beside it on sessions of their own, which the hub does not keep."""
    rng = random.Random(rng_seed)
    sid = f"choices-{rng.randrange(10**6)}"
    hub = client.app.state.server.hub
    body = _body("/v1/chat/completions", rng, n=3, temperature=1.0, seed=rng.randrange(2**31))
    r = client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid}).json()
    assert len(hub) == 1
    assert hub.get(sid).history[-1].content == r["choices"][0]["message"]["content"]
