"""Log-probabilities over the OpenAI routes (integrations/openai_logprobs.py): chat's
`logprobs`/`top_logprobs` and the legacy completions' `logprobs`, whole and streamed.

Values are held to the engine's own on a second engine (its score path for chat, whose prompt
is templated; Engine.generate for text); token strings to the tokenizer's decode of each id;
one entry per generated token, stop strings, thinking and tool calls included; a stream's
chunks add up to the whole answer's list, and each carries the tokens since the one before."""

from __future__ import annotations

import json
import random
import string

import pytest
import torch

from freetoken_agent import Engine, SamplingParams

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TOL = 1e-4  # float32 logits computed in other shapes (prefill vs decode, KV reused or not)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


def _stream(client, url: str, body: dict, read_sse) -> list:
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = read_sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1] if e["choices"]]


def _load(model_dir) -> Engine:
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def _clean(tokenizer, ids: list[int], strings: list[str]) -> bool:
    """Whether each token's own string is its part of the text: no partial character (U+FFFD
    alone) and no special token (kept in the strings, skipped in the text)."""
    specials = set(tokenizer.backend.get_added_tokens_decoder())
    return not any("\ufffd" in s for s in strings) and not specials.intersection(ids)


def _check_chat_entry(entry: dict, k: int, seed: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}, seed
    assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"], seed
    assert len(entry["top_logprobs"]) == k, (seed, k)
    values = [t["logprob"] for t in entry["top_logprobs"]]
    assert values == sorted(values, reverse=True), seed
    for top in entry["top_logprobs"]:
        assert set(top) == {"token", "logprob", "bytes"}, seed
        assert bytes(top["bytes"]).decode("utf-8", "replace") == top["token"], seed


def test_chat_logprobs_are_the_engine_s_whole_and_streamed(client, model_dir, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    k = rng.choice([None, 0, rng.randint(1, 20), 20])
    sid = f"lp-{rng_seed}"
    body = {"messages": [{"role": "user", "content": _words(rng, rng.randint(1, 8))}],
            "max_tokens": rng.randint(2, 12), "temperature": 0, "ignore_eos": True,
            "logprobs": True, **({} if k is None else {"top_logprobs": k})}  # fmt: skip
    r = client.post(CHAT, json=body, headers={"X-Session-Id": sid})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    state = client.app.state.server
    session = state.hub.lookup(sid).session
    prompt = session.last_prompt.token_ids + session.last_suffix_ids
    out_ids = session.last_output_ids
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    content = logprobs["content"]
    assert len(content) == len(out_ids) == r.json()["usage"]["completion_tokens"], rng_seed
    tokenizer = state.service.tokenizer
    ref = torch.log_softmax(_load(model_dir).score(prompt + out_ids).double(), dim=-1)
    for i, (entry, token) in enumerate(zip(content, out_ids, strict=True)):
        _check_chat_entry(entry, k or 0, rng_seed)
        row = ref[len(prompt) - 1 + i]
        assert entry["token"] == tokenizer.decode([token], skip_special_tokens=False), rng_seed
        assert abs(entry["logprob"] - row[token].item()) <= TOL, (rng_seed, i)
        expected = row.topk(k or 0).values.tolist()
        got = [t["logprob"] for t in entry["top_logprobs"]]
        assert all(abs(a - b) <= TOL for a, b in zip(got, expected, strict=True)), (rng_seed, i)
        if k:  # greedy: the token taken is the most likely (its value, up to a tie)
            assert abs(got[0] - entry["logprob"]) <= TOL, (rng_seed, i)
    strings = [e["token"] for e in content]
    message = choice["message"]
    if _clean(tokenizer, out_ids, strings) and not message.get("reasoning_content"):
        assert "".join(strings) == message["content"], rng_seed

    chunks = _stream(client, CHAT, body, read_sse)
    pieces = [c["choices"][0]["logprobs"] for c in chunks]
    # A chunk without tokens (the role chunk, say) has null logprobs, as OpenAI's and vLLM's.
    assert pieces[0] is None and all(p is None or p["content"] for p in pieces), rng_seed
    assert all(p is None or p["refusal"] is None for p in pieces), rng_seed
    streamed = [e for p in pieces if p is not None for e in p["content"]]
    assert [e["token"] for e in streamed] == strings, rng_seed
    for a, b in zip(streamed, content, strict=True):
        _check_chat_entry(a, k or 0, rng_seed)
        assert abs(a["logprob"] - b["logprob"]) <= TOL, rng_seed
    if _clean(tokenizer, out_ids, strings):  # each chunk: the tokens whose text it carries
        for c, p in zip(chunks, pieces, strict=True):
            text = c["choices"][0]["delta"].get("content") or ""
            assert "".join(e["token"] for e in (p or {"content": []})["content"]) == text, rng_seed


def _text_block_ok(lp: dict, k: int, seed: int) -> None:
    n = len(lp["tokens"])
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, seed
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                  strict=True):  # fmt: skip
        if k == 0:
            assert top is None, seed
        else:  # the k most likely and the sampled token ("up to logprobs + 1"); ids decoding
            # alike share a key, which keeps the likelier one's value
            assert 1 <= len(top) <= k + 1 and top[token] >= chosen - TOL, seed


def test_text_offsets_do_not_move_with_stop_strings(client, read_sse, rng_seed):
    """While stop strings are set, the text that could start one is held back, and each
    offset was the characters released before its token: all but the first lagged by up to
    the longest stop's length - 1. A stop that never matches leaves every offset as without
    stops; one that matches keeps the offsets of the tokens before it, a token it cut away
    pointing at the text's end; streamed, the chunks' offsets are the same."""
    rng = random.Random(rng_seed)
    met = 0
    for _ in range(12):
        body = {"prompt": _words(rng, rng.randint(1, 6)), "max_tokens": rng.randint(6, 12),
                "temperature": 0, "ignore_eos": True, "logprobs": rng.randint(0, 2)}  # fmt: skip
        free = client.post(TEXT, json=body).json()["choices"][0]
        text, offsets = free["text"], free["logprobs"]["text_offset"]
        absent = "".join(rng.choices("qxz", k=rng.randint(4, 9)))
        assert absent not in text
        stops = [{**body, "stop": [absent]}]
        if len(text) > 3:
            at = rng.randrange(1, len(text) - 1)
            stop = text[at : at + rng.randint(1, 3)]
            stops.append({**body, "stop": [absent, stop]})
        for asked in stops:
            choice = client.post(TEXT, json=asked).json()["choices"][0]
            got = choice["logprobs"]["text_offset"]
            cut = text.find(asked["stop"][-1]) if asked["stop"][-1] != absent else len(text)
            assert choice["text"] == text[:cut], rng_seed
            assert got == [min(o, cut) for o in offsets[: len(got)]], (got, offsets, rng_seed)
            met += cut < len(text)
            streamed, sent = [], ""
            for c in _stream(client, TEXT, asked, read_sse):
                one = c["choices"][0]
                sent += one["text"]
                block = one["logprobs"] or {"text_offset": []}
                streamed += block["text_offset"]
                if one["finish_reason"] is None:  # a token's entry comes with its text
                    assert all(o < len(sent) for o in block["text_offset"]), rng_seed
            assert streamed == got and sent == choice["text"], (streamed, got, rng_seed)
    assert met, f"seed {rng_seed}: no stop string matched"


def test_text_logprobs_line_up_with_the_text(client, model_dir, read_sse, rng_seed):
    """Greedy completions: one entry per token, the engine's values, each offset where its
    token's text begins in the reply (the characters the tokens before it released, as the
    engine's events release them), the strings concatenating to the text where each token is
    its own text (some prompt's output is: a test that never met one fails), chunk by chunk
    when streamed."""
    rng = random.Random(rng_seed)
    tokenizer = client.app.state.server.service.tokenizer
    reference = _load(model_dir)
    clean = 0
    for _ in range(30):
        k = rng.randint(0, 5)
        prompt = _words(rng, rng.randint(1, 8))
        body = {"prompt": prompt, "max_tokens": rng.randint(2, 6), "temperature": 0,
                "ignore_eos": True, "logprobs": k}  # fmt: skip
        answer = client.post(TEXT, json=body).json()
        choice, usage = answer["choices"][0], answer["usage"]
        lp = choice["logprobs"]
        _text_block_ok(lp, k, rng_seed)
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        sp = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True,
                            logprobs=k)  # fmt: skip
        events = [e for e in reference.stream(ids, sp) if e.token_id is not None]
        out_ids = [e.token_id for e in events]
        assert len(lp["tokens"]) == usage["completion_tokens"] == len(out_ids), rng_seed
        want = [tokenizer.decode([t], skip_special_tokens=False) for t in out_ids]
        assert lp["tokens"] == want, rng_seed
        for got, event in zip(lp["token_logprobs"], events, strict=True):
            assert abs(got - event.logprob) <= TOL, rng_seed
        released = [e.text for e in events]
        offsets = [sum(len(t) for t in released[:i]) for i in range(len(released))]
        assert lp["text_offset"] == offsets and "".join(released) == choice["text"], rng_seed
        chunks = _stream(client, TEXT, body, read_sse)
        blocks = [c["choices"][0]["logprobs"] for c in chunks]
        # A chunk without tokens (the finish chunk, say) has null logprobs, as chat's.
        assert all(b is None or b["tokens"] for b in blocks), rng_seed
        blocks = [b or {"tokens": [], "text_offset": []} for b in blocks]
        assert [o for b in blocks for o in b["text_offset"]] == offsets, rng_seed
        assert [t for b in blocks for t in b["tokens"]] == lp["tokens"], rng_seed
        if not _clean(tokenizer, out_ids, want):
            continue
        clean += 1
        assert "".join(lp["tokens"]) == choice["text"], rng_seed
        for c, block in zip(chunks, blocks, strict=True):
            if block["tokens"]:
                _text_block_ok(block, k, rng_seed)
            assert "".join(block["tokens"]) == c["choices"][0]["text"], rng_seed
        if clean >= 2:
            break
    assert clean, f"seed {rng_seed}: no prompt gave an output of whole-character tokens"


def test_legacy_top_logprobs_hold_the_sampled_token(client, rng_seed):
    """OpenAI's "up to logprobs + 1" entries: the sampled token is among a token's
    top_logprobs even when it is not among the k most likely (forced here by logit_bias)."""
    rng = random.Random(rng_seed)
    vocab = client.app.state.server.service.spec.vocab_size
    forced = rng.randrange(3, vocab)
    k = rng.randint(1, 5)
    body = {"prompt": _words(rng, rng.randint(1, 6)), "max_tokens": rng.randint(2, 8),
            "temperature": rng.choice([0, 1.0]), "seed": rng_seed, "ignore_eos": True,
            "logprobs": k, "logit_bias": {str(forced): 100}}  # fmt: skip
    lp = client.post(TEXT, json=body).json()["choices"][0]["logprobs"]
    _text_block_ok(lp, k, rng_seed)
    assert len(set(lp["tokens"])) == 1, (lp["tokens"], rng_seed)


def test_tokens_a_stop_string_cut_keep_their_entries(client, read_sse, rng_seed):
    """As vLLM: every generated token has an entry, those of the stop string cut from the text
    too; the whole answer's and the stream's agree."""
    rng = random.Random(rng_seed)
    for _ in range(20):  # a prompt whose greedy output has text to cut
        body = {"prompt": _words(rng, rng.randint(2, 8)), "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "logprobs": rng.randint(0, 3)}  # fmt: skip
        full = client.post(TEXT, json=body).json()["choices"][0]
        if len(full["text"]) >= 6:
            break
    text = full["text"]
    start = rng.randrange(2, len(text) - 1)
    stop = text[start : start + rng.randint(1, 3)]
    cut = client.post(TEXT, json={**body, "stop": [stop]}).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)]
    n = cut["usage"]["completion_tokens"]
    tokens = choice["logprobs"]["tokens"]
    assert tokens == full["logprobs"]["tokens"][:n] and len(tokens) == n, rng_seed
    # The stop string's own tokens are there: they reach past the text.
    assert sum(len(t) for t in tokens) >= len(choice["text"]) + 1 or "\ufffd" in "".join(tokens)
    chunks = _stream(client, TEXT, {**body, "stop": [stop]}, read_sse)
    blocks = [c["choices"][0]["logprobs"] or {"tokens": []} for c in chunks]
    assert [t for b in blocks for t in b["tokens"]] == tokens, rng_seed


def test_thinking_and_tool_call_tokens_have_entries(scripted_client, read_sse, rng_seed):
    """Every token of a reply with reasoning, content and a tool call has its entry in
    `content`, in order (vLLM lists them all there too); streamed, the reasoning chunks and the
    tool call's one delta carry theirs, and the chunks add up to the whole list."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    name = _words(rng, 1)
    args = {_words(rng, 1): rng.randint(-99, 99)}
    reply = (
        f"<think>\n{_words(rng, rng.randint(1, 5))}\n</think>\n\n{_words(rng, 2)}\n"
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    )
    fake.replies = [(reply, "stop")] * 2
    k = rng.randint(0, 1)
    body = {
        "messages": [{"role": "user", "content": _words(rng, 3)}],
        "logprobs": True,
        "top_logprobs": k,
        "tools": [{"type": "function", "function": {"name": name}}],
    }
    ids = fake.tokenizer.encode(reply)
    strings = [fake.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    expected = [(s, -0.5 * (i + 1)) for i, s in enumerate(strings)]  # ScriptedEngine's values
    whole = client.post(CHAT, json=body).json()["choices"][0]
    assert whole["message"]["tool_calls"] and whole["message"].get("reasoning_content")
    assert [(e["token"], e["logprob"]) for e in whole["logprobs"]["content"]] == expected
    assert all(len(e["top_logprobs"]) == k for e in whole["logprobs"]["content"])
    chunks = _stream(client, CHAT, body, read_sse)
    pieces = [c["choices"][0]["logprobs"] for c in chunks]
    assert pieces[0] is None and all(p is None or p["content"] for p in pieces), rng_seed
    streamed = [e for p in pieces if p is not None for e in p["content"]]
    assert [(e["token"], e["logprob"]) for e in streamed] == expected, rng_seed
    for c, p in zip(chunks, pieces, strict=True):
        delta, entries = c["choices"][0]["delta"], (p or {"content": []})["content"]
        if delta.get("tool_calls"):
            assert entries and entries[-1]["token"] == "</tool_call>", (rng_seed, delta)
        text = delta.get("reasoning_content") or delta.get("content")
        if text:  # the tokens since the chunk before end with the one(s) of this text
            assert "".join(e["token"] for e in entries).endswith(text), (rng_seed, delta)


def test_not_asked_is_null_everywhere(client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    chat = {"messages": [{"role": "user", "content": _words(rng, 3)}], "max_tokens": 4}
    assert client.post(CHAT, json=chat).json()["choices"][0]["logprobs"] is None
    assert all(c["choices"][0]["logprobs"] is None for c in _stream(client, CHAT, chat, read_sse))
    text = {"prompt": _words(rng, 3), "max_tokens": 4}
    assert client.post(TEXT, json=text).json()["choices"][0]["logprobs"] is None
    assert all(c["choices"][0]["logprobs"] is None for c in _stream(client, TEXT, text, read_sse))


@pytest.mark.parametrize(
    ("url", "fields", "param"),
    [
        (CHAT, {"logprobs": "yes"}, "logprobs"),
        (CHAT, {"logprobs": 1}, "logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # OpenAI: needs logprobs: true
        (CHAT, {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
        (TEXT, {"logprobs": 21}, "logprobs"),
        (TEXT, {"logprobs": -1}, "logprobs"),
        (TEXT, {"logprobs": True}, "logprobs"),
        (TEXT, {"logprobs": "3"}, "logprobs"),
        (TEXT, {"logprobs": 2, "echo": "yes"}, "echo"),
        (TEXT, {"prompt_logprobs": 21}, "prompt_logprobs"),  # vLLM's: served in 0..20
        (TEXT, {"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary: not
        (CHAT, {"prompt_logprobs": True}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": 1.0}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": "2"}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),  # as in vLLM
    ],
)
def test_bad_values_are_400_naming_the_param(client, api_error, url, fields, param):
    base = {"prompt": "hello"} if url == TEXT else {"messages": [{"role": "user", "content": "hi"}]}
    error = api_error(client.post(url, json={**base, "max_tokens": 2, **fields}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"], error
    asked = {"logprobs": 2} if url == TEXT else {"logprobs": True, "top_logprobs": 2}
    assert client.post(url, json={**base, "max_tokens": 2, **asked}).status_code == 200


@pytest.mark.parametrize("route", [CHAT, "/v1/responses"])
def test_the_bytes_of_a_replys_tokens_join_to_its_text(scripted_client, route, rng_seed):
    """Characters split across tokens (CJK, emoji with a skin tone): each entry's `bytes` are
    its token's own (OpenAI's, for joining them), not U+FFFD's, so they join to the reply's
    UTF-8; the token strings read U+FFFD where a character is split."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    reply = " ".join([rng.choice(["中文", "👍🏽"])] + [rng.choice(["中文", "👍🏽", "Ωμέγα",
                     "naïve", _words(rng, 1)]) for _ in range(rng.randint(1, 5))])  # fmt: skip
    fake.replies = [(reply, "stop")]
    messages = [{"role": "user", "content": _words(rng, 3)}]
    if route == CHAT:
        body = {"messages": messages, "logprobs": True, "top_logprobs": rng.randint(0, 2)}
        choice = client.post(route, json=body).json()["choices"][0]
        text, entries = choice["message"]["content"], choice["logprobs"]["content"]
    else:
        body = {"input": messages, "include": ["message.output_text.logprobs"]}
        part = client.post(route, json=body).json()["output"][-1]["content"][0]
        text, entries = part["text"], part["logprobs"]
    assert text == reply
    assert b"".join(bytes(e["bytes"]) for e in entries) == reply.encode("utf-8")
    assert any(e["token"] == "\ufffd" for e in entries)  # a split character: U+FFFD alone


def test_the_token_bytes_table_is_built_once_not_per_request(client, monkeypatch, rng_seed):
    """It reads the whole tokenizer spec (~1 s for a 150k vocabulary, on the event loop):
    built for the first request that asks for logprobs, then shared; never without them."""
    from freetoken_agent.engine.text import tokenizer as tokenizer_module

    built = []
    real = tokenizer_module.TokenBytes
    monkeypatch.setattr(tokenizer_module, "TokenBytes", lambda b: built.append(1) or real(b))
    rng = random.Random(rng_seed)
    for logprobs in (False, False, True, True, True):
        body = {"messages": [{"role": "user", "content": _words(rng, 3)}], "max_tokens": 2,
                "logprobs": logprobs}  # fmt: skip
        assert client.post(CHAT, json=body).status_code == 200
        assert len(built) == (0 if not logprobs else 1)
