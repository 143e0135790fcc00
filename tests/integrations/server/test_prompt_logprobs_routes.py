"""vLLM's `prompt_logprobs` over the OpenAI routes (integrations/openai_logprobs.PromptLogprobs):
on a text completion's choice and a chat completion's top level, one entry per prompt token,
the first null, each a dict keyed by token id (a string) holding the prompt token first (its
value, rank and string) and the k most likely (ranks 1..k); not with a stream (as vLLM).

Values are held to `Engine.score` of the same prompt on a second engine."""

from __future__ import annotations

import random
import string

import pytest
import torch

from freetoken_agent import Engine

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TOL = 1e-4  # float32 logits computed in other shapes (the server's chunks vs score's)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


def _scored(model_dir, ids: list[int]) -> torch.Tensor:
    engine = Engine.load(
        model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024
    )
    try:
        return torch.log_softmax(engine.score(ids).double(), dim=-1)
    finally:
        engine.close()


def _check(written: list, ids: list[int], ref: torch.Tensor, k: int, tokenizer, seed) -> None:
    """`written` (vLLM's prompt_logprobs) against `ref` = the prompt's scored log-softmax."""
    assert isinstance(written, list) and len(written) == len(ids) and written[0] is None, seed
    for p in range(1, len(ids)):
        where = (seed, p)
        position, row, token = written[p], ref[p - 1], ids[p]
        keys = list(position)
        # The prompt token first; then the k most likely (it keeps its place if among them).
        assert keys[0] == str(token) and len(keys) in (k, k + 1), (where, keys)
        for key, item in position.items():
            assert set(item) == {"logprob", "rank", "decoded_token"}, where
            assert item["decoded_token"] == tokenizer.decode([int(key)], skip_special_tokens=False)
            assert abs(item["logprob"] - row[int(key)].item()) <= TOL, (where, key)
        value, rank = row[token].item(), position[str(token)]["rank"]
        assert int((row > value + TOL).sum()) + 1 <= rank <= int((row >= value - TOL).sum()), where
        top = sorted(
            (position[key] for key in (keys[1:] if len(keys) > k else keys)),
            key=lambda item: item["rank"],
        )
        assert [item["rank"] for item in top] == list(range(1, k + 1)), (where, top)
        want = row.topk(k).values.tolist()
        assert all(abs(a["logprob"] - b) <= TOL for a, b in zip(top, want, strict=True)), where


@pytest.mark.parametrize("echo", [False, True])
def test_text_completion_choice_carries_them(client, model_dir, rng_seed, echo):
    """Alone (k 0..20), and beside echo with logprobs, which keeps its own count of
    alternatives (fewer than prompt_logprobs' here)."""
    rng = random.Random(rng_seed)
    tokenizer = client.app.state.server.service.tokenizer
    prompt = _words(rng, rng.randint(1, 10))
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    k = rng.randint(2, 20) if echo else rng.choice([0, 1, rng.randint(2, 20), 20])
    echo_k = rng.randint(1, k - 1) if echo else None
    body = {"prompt": prompt, "max_tokens": rng.randint(0 if echo else 1, 4),
            "temperature": 0, "ignore_eos": True, "prompt_logprobs": k,
            **({"echo": True, "logprobs": echo_k} if echo else {})}  # fmt: skip
    r = client.post(TEXT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    _check(choice["prompt_logprobs"], ids, _scored(model_dir, ids), k, tokenizer, rng_seed)
    if echo:  # the k most likely and the token (ids decoding alike share a key: fewer)
        tops = choice["logprobs"]["top_logprobs"][1 : len(ids)]
        assert all(1 <= len(t) <= echo_k + 1 for t in tops), rng_seed


def test_chat_completion_carries_them_at_the_top(client, model_dir, rng_seed):
    rng = random.Random(rng_seed)
    sid = f"plp-{rng_seed}"
    k = rng.randint(1, 20)
    body = {"messages": [{"role": "user", "content": _words(rng, rng.randint(1, 8))}],
            "max_tokens": rng.randint(1, 4), "temperature": 0, "prompt_logprobs": k}  # fmt: skip
    r = client.post(CHAT, json=body, headers={"X-Session-Id": sid})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "prompt_logprobs" not in answer["choices"][0], rng_seed
    session = client.app.state.server.hub.lookup(sid).session
    prompt = session.last_prompt.token_ids + session.last_suffix_ids
    tokenizer = client.app.state.server.service.tokenizer
    _check(answer["prompt_logprobs"], prompt, _scored(model_dir, prompt), k, tokenizer, rng_seed)
    # Asked again: the prompt is cached now, but computed again (no entry missing).
    again = client.post(CHAT, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, rng_seed
    assert [list(p) if p else p for p in again["prompt_logprobs"]] == [
        list(p) if p else p for p in answer["prompt_logprobs"]
    ], rng_seed


def test_not_asked_or_streamed(client, read_sse, rng_seed, api_error):
    """Not asked: no such field. With a stream: above 0 refused naming the field (a stream
    has no place for them, as in vLLM), 0 accepted and nothing sent."""
    rng = random.Random(rng_seed)
    text = {"prompt": _words(rng, 3), "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": _words(rng, 3)}], "max_tokens": 2}
    assert "prompt_logprobs" not in client.post(TEXT, json=text).json()["choices"][0]
    assert "prompt_logprobs" not in client.post(CHAT, json=chat).json()
    for url, body in ((TEXT, text), (CHAT, chat)):
        asked = {**body, "stream": True, "prompt_logprobs": rng.randint(1, 20)}
        error = api_error(client.post(url, json=asked), 400)
        assert error["param"] == "prompt_logprobs" and "stream" in error["message"], error
        with client.stream("POST", url, json={**asked, "prompt_logprobs": 0}) as r:
            assert r.status_code == 200
            events = read_sse(list(r.iter_lines()))
        assert not any("prompt_logprobs" in str(e) for e in events), url
