"""POST /v1/completions: the legacy text endpoint, its prompt given to the engine as is.

At temperature 0 the engine's results are exact, so the served text is checked against
`Engine.generate` on a second engine for the same ids and settings; streamed and whole answers
against each other; the real `openai` SDK against a live server.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
from types import SimpleNamespace

import openai
import pytest
from asgi_disconnect import post_and_leave

from freetoken_agent import Engine
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.integrations.server import create_app
from freetoken_agent.integrations.server.errors import BadParam
from freetoken_agent.integrations.server.text_run import TextRun

URL = "/v1/completions"
MODEL = "freetoken-demo"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


def _prompt(rng: random.Random, vocab: int) -> str | list[int]:
    """A fresh prompt: words, or token ids drawn from the whole vocabulary."""
    if rng.random() < 0.5:
        return _words(rng, rng.randint(1, 12))
    return [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]


def _reference(model_dir, prompt, **sampling) -> tuple[str, str, int, int]:
    """(text, finish_reason, prompt tokens, completion tokens) from Engine.generate."""
    engine = Engine.load(
        model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024
    )
    try:
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        out = engine.generate(ids, SamplingParams(**sampling))
        return out.text, out.finish_reason, len(ids), len(out.token_ids)
    finally:
        engine.close()


def _stream(client, body: dict, read_sse) -> list:
    with client.stream("POST", URL, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_sse(list(r.iter_lines()))


def _streamed(events: list, include_usage: bool) -> tuple[str, str, dict | None]:
    """(text, finish_reason, usage) from SSE payloads, checking their shape on the way."""
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"] if include_usage else None
    if include_usage:
        assert events[-2]["choices"] == []
    chunks = events[: -2 if include_usage else -1]
    assert all("usage" not in c for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert all(c["object"] == "text_completion" for c in events[:-1])
    assert events[0]["id"].startswith("cmpl-")
    choices = [c["choices"][0] for c in chunks]
    assert all(c["index"] == 0 and c["logprobs"] is None for c in choices)
    assert all(c["finish_reason"] is None for c in choices[:-1])
    assert choices[-1]["text"] == ""
    return "".join(c["text"] for c in choices), choices[-1]["finish_reason"], usage


def test_greedy_text_is_engine_generate_s(client, model_dir, rng_seed):
    rng = random.Random(rng_seed)
    vocab = client.app.state.server.service.spec.vocab_size
    served = client.get("/v1/models").json()["data"][0]["id"]
    for _ in range(3):
        prompt = _prompt(rng, vocab)
        max_tokens, ignore_eos = rng.randint(1, 24), rng.random() < 0.5
        body = {"model": served, "prompt": rng.choice([prompt, [prompt]]), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": ignore_eos}  # fmt: skip
        r = client.post(URL, json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
        assert answer["model"] == served
        (choice,) = answer["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        text, reason, n_prompt, n_out = _reference(
            model_dir, prompt, max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos
        )
        assert (choice["text"], choice["finish_reason"]) == (text, reason)
        usage = answer["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n_prompt, n_out)
        assert usage["total_tokens"] == n_prompt + n_out
        if ignore_eos:  # nothing ends it early: max_tokens does
            assert reason == "length" and n_out == max_tokens


def test_streamed_and_whole_agree(client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    vocab = client.app.state.server.service.spec.vocab_size
    body = {"prompt": _prompt(rng, vocab), "max_tokens": rng.randint(1, 30), "temperature": 0}
    whole = client.post(URL, json=body).json()
    include_usage = rng.random() < 0.5
    events = _stream(client, {**body, "stream_options": {"include_usage": include_usage}}, read_sse)
    text, reason, usage = _streamed(events, include_usage)
    choice = whole["choices"][0]
    assert (text, reason) == (choice["text"], choice["finish_reason"])
    if include_usage:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage[key] == whole["usage"][key]
        # The repeat reuses the first request's KV (same prompt): reported as cached tokens,
        # all but the last, which is computed again for its logits (a one-token prompt: none).
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == usage["prompt_tokens"] - 1 if usage["prompt_tokens"] > 1 else cached == 0


def test_stop_strings_cut_as_in_the_engine(client, model_dir, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(20):  # a prompt whose greedy output has text to cut
        prompt = _words(rng, rng.randint(2, 10))
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        full = client.post(URL, json=body).json()["choices"][0]["text"]
        if len(full) >= 4:
            break
    start = rng.randrange(1, len(full) - 1)
    stop = full[start : start + rng.randint(1, 3)]
    stops = [stop, _words(rng, 1) + "#"]  # the second never comes
    cut = client.post(URL, json={**body, "stop": stops}).json()["choices"][0]
    text, reason, _, _ = _reference(
        model_dir, prompt, max_tokens=24, temperature=0, ignore_eos=True, stop=stops
    )
    assert (
        (cut["text"], cut["finish_reason"]) == (text, reason) == (full[: full.index(stop)], "stop")
    )
    streamed, streamed_reason, _ = _streamed(
        _stream(client, {**body, "stop": stop}, read_sse), False
    )
    assert (streamed, streamed_reason) == (text, "stop")
    # vLLM's include_stop_str_in_output: cut after the stop string, whole and streamed.
    kept = {**body, "stop": stops, "include_stop_str_in_output": True}
    with_stop = full[: full.index(stop) + len(stop)]
    cut = client.post(URL, json=kept).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (with_stop, "stop")
    assert _streamed(_stream(client, kept, read_sse), False)[:2] == (with_stop, "stop")


def test_openai_sdk_parses_plain_and_streamed(start_server, model_dir, rng_seed, nothing_held):
    server = start_server(model_dir, model_id=MODEL)
    sdk = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    rng = random.Random(rng_seed)
    request = {"model": MODEL, "prompt": _words(rng, rng.randint(2, 9)),
               "max_tokens": rng.randint(1, 20), "temperature": 0}  # fmt: skip
    plain = sdk.completions.create(**request)
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-")
    (choice,) = plain.choices
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    assert plain.usage.completion_tokens <= request["max_tokens"]
    chunks = list(
        sdk.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    # echo (lm-evaluation-harness's log-likelihood form: the prompt's logprobs, no token)
    echoed = sdk.completions.create(**{**request, "max_tokens": 0}, echo=True, logprobs=1)
    (choice,) = echoed.choices
    assert choice.text == request["prompt"] and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) > 0
    assert all(isinstance(v, float) for v in choice.logprobs.token_logprobs[1:])
    assert echoed.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(**{**request, "max_tokens": 0})
    assert refused.value.body["param"] == "max_tokens"
    nothing_held(server.state.service)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "\n    return x\n"),
        ("echo", "yes"),
        ("echo", 1),
        ("logprobs", 21),  # served in 0..20 (tests/integrations/server/test_logprobs.py)
        ("logprobs", True),
        ("best_of", 2),
        ("logit_bias", {"50": 101}),
        ("logit_bias", {"999999": 1}),  # outside the vocabulary: the engine's refusal
        ("n", 0),  # 1..16 are served (test_choices.py)
        ("n", 17),
        ("n", "2"),
        ("presence_penalty", 2.5),
        ("min_p", 1.5),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_k", -2),  # -1 is vLLM's "no top-k"
        ("seed", 1.5),
        ("max_tokens", 0),  # without echo: nothing asked (tests/.../test_echo.py)
        ("prompt_logprobs", 21),
        ("stop", [""]),
        ("ignore_eos", "yes"),
        ("stream", "yes"),
        ("stream_options", ["include_usage"]),
        ("prompt", ["one", "two"]),
        ("prompt", [[1, 2], [3]]),
        ("prompt", [1.5, 2]),
        ("prompt", {"text": "x"}),
        ("prompt", None),
        ("prompt", [999_999]),  # outside the vocabulary
        ("prompt", ""),
    ],
)
def test_refused_fields_are_400_naming_them(client, field, value):
    body = {"prompt": "hello", "max_tokens": 2, field: value}
    r = client.post(URL, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert client.post(URL, json={"prompt": "hello", "max_tokens": 2}).status_code == 200


def test_wrong_model_and_context_overflow_answer_as_chat_does(client, rng_seed):
    rng = random.Random(rng_seed)
    r = client.post(URL, json={"model": "gpt-" + _words(rng, 1), "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    long = " ".join(["zz qq"] * rng.randint(700, 900))
    text = client.post(URL, json={"prompt": long})
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}
    )
    assert text.status_code == chat.status_code == 400
    error, chat_error = text.json()["error"], chat.json()["error"]
    assert error["code"] == chat_error["code"] == "context_length_exceeded"
    assert error["type"] == chat_error["type"] and error["param"] == "prompt"
    assert "1024" in error["message"] and "tokens" in error["message"]


def test_bad_requests_leave_the_server_serving(client, engine, rng_seed):
    rng = random.Random(rng_seed)
    good = {"prompt": _words(rng, 6), "max_tokens": 8, "temperature": 0}
    expected = client.post(URL, json=good).json()["choices"][0]["text"]
    for bad in [
        b'{"prompt": ',
        json.dumps({"prompt": [rng.randrange(10**6, 10**7)]}).encode(),
        json.dumps({"prompt": "x " * 3000}).encode(),
        json.dumps({"prompt": "x", "suffix": "y", "stream": True}).encode(),
    ]:
        assert client.post(URL, content=bad).status_code == 400
        again = client.post(URL, json=good)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    service = client.app.state.server.service
    with service.lock:
        assert not engine.has_unfinished()
        engine.check_integrity()


def test_a_streaming_client_that_leaves_aborts_its_request(client, engine, rng_seed):
    rng = random.Random(rng_seed)
    service = client.app.state.server.service
    body = {"prompt": _words(rng, 5), "max_tokens": 900, "ignore_eos": True, "stream": True,
            "temperature": 0.7, "seed": rng.randrange(2**31)}  # fmt: skip
    seen = 0
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 4:
                break  # leaving the block closes the connection mid-stream
    stats = service.stats()
    assert stats["requests"]["finished"] == 1  # ended (aborted), not running on
    assert 0 < stats["tokens"]["generated"] < 900
    with service.lock:
        assert not engine.has_unfinished()
        engine.check_integrity()
        engine.radix.reset()
        assert engine.kv.allocator.n_free == engine.kv.allocator.capacity


def test_a_waiting_client_that_leaves_aborts_its_request(engine, rng_seed):
    """Driven as raw ASGI: the server sees the disconnect while it collects the text."""
    rng = random.Random(rng_seed)
    app = create_app(engine)
    service = app.state.server.service
    body = json.dumps({"prompt": _words(rng, 5), "max_tokens": 900, "ignore_eos": True}).encode()
    try:
        sent = post_and_leave(app, URL, body)
        stats = service.stats()
        assert stats["requests"]["finished"] == 1
        assert 0 < stats["tokens"]["generated"] < 900
        assert sent[0]["status"] == 499
    finally:
        service.close()


def test_an_engine_error_mid_generation_is_reported_as_for_chat(
    scripted_client, read_sse, rng_seed
):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    reply = _words(rng, rng.randint(1, 6))
    fake.replies = [(reply, "stop"), (reply, "error"), (reply, "error"), (reply, "error")]
    assert client.post(URL, json={"prompt": "x"}).json()["choices"][0]["text"] == reply
    r = client.post(URL, json={"prompt": "x"})
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == chat.status_code == 500
    assert r.json()["error"]["type"] == chat.json()["error"]["type"] == "server_error"
    events = _stream(client, {"prompt": "x"}, read_sse)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == reply


def test_a_model_without_a_tokenizer_takes_only_ids():
    """create_app needs a tokenizer (for chat); the text route's own check still names the
    field, should the model reach it without one."""
    run = TextRun(SimpleNamespace(tokenizer=None), "some text", SamplingParams())
    with pytest.raises(BadParam) as refused:
        asyncio.run(run.start())
    assert refused.value.param == "prompt" and "token ids" in str(refused.value)
