"""POST /v1/completions with `echo` (integrations/server/echo.py): the prompt's text first in
the choice's text and, with `logprobs`, the prompt's tokens first in its logprobs (the first
with nulls, the rest the engine's prompt entries), whole and in the first chunk of a stream;
`max_tokens: 0` with echo answers the prompt alone (lm-evaluation-harness's form), and without
echo is refused naming max_tokens.

Values are held to a second engine's Engine.generate of the same ids with the same settings
(prompt_logprobs asked: no prefix reuse, so the server's computation is the same, alone)."""

from __future__ import annotations

import random
import string
from types import SimpleNamespace

import pytest

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.text.detokenizer import unfinished_tail

URL = "/v1/completions"
TOL = 1e-5  # the same computation as the reference's, in the same shapes


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


def _prompt(rng: random.Random, kind: str, tokenizer, vocab: int) -> str | list[int]:
    """Words; the ids of words with a special token among them (each token its own text);
    or ids drawn from the whole vocabulary (partial characters, specials)."""
    if kind == "words":
        return _words(rng, rng.randint(1, 10))
    if kind == "ids":
        ids = tokenizer.encode(_words(rng, rng.randint(1, 8)))
        special = rng.choice(sorted(tokenizer.special_token_ids))
        return [*ids[: (cut := rng.randint(0, len(ids)))], special, *ids[cut:]]
    return [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]


def _reference(model_dir, ids: list[int], sp: SamplingParams, **options) -> SimpleNamespace:
    """The request on a fresh engine: its tokens, text, entries, and each generated token's
    offset in the generated text (the characters the events before it released)."""
    engine = Engine.load(
        model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024
    )
    try:
        events = list(engine.stream(ids, sp, **options))
    finally:
        engine.close()
    tokens = [e for e in events if e.token_id is not None]
    texts = [e.text for e in events]
    return SimpleNamespace(
        token_ids=[e.token_id for e in tokens],
        logprobs=[e.token_logprob() for e in tokens],
        text="".join(texts),
        finish_reason=events[-1].finish_reason,
        prompt_logprobs=events[0].prompt_logprobs,
        offsets=[sum(len(t) for t in texts[:i]) for i in range(len(tokens))],
    )


def _stream(client, body: dict, read_sse) -> list[dict]:
    """The stream's choices, in order (its finish chunk included)."""
    with client.stream("POST", URL, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = read_sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    return [e["choices"][0] for e in events[:-1] if e["choices"]]


def _ids_and_text(tokenizer, prompt: str | list[int], generates: bool) -> tuple[list[int], str]:
    """What the prompt is submitted as, and its echoed text (a string as sent, ids decoded
    with their special tokens; a character the ids cut left to the reply, if there is one)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True), prompt
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    if generates and unfinished_tail(tokenizer, prompt)[0]:
        assert text.endswith("\ufffd")  # (a byte-level decode shows it as one U+FFFD)
        text = text[:-1]
    return prompt, text


@pytest.mark.parametrize("kind", ["words", "ids", "random ids"])
@pytest.mark.parametrize("logprobs", [None, "k"])
def test_echo_puts_the_prompt_first_whole_and_streamed(
    client, model_dir, read_sse, rng_seed, logprobs, kind
):
    """The choice's text is the prompt's then the generated text; its logprobs (asked) the
    prompt's tokens then the generated ones: the first null, the others the engine's prompt
    entries, offsets where each token's text starts in the echoed text; a stream's first chunk
    carries the prompt's text and entries, the rest the completion (the reference's)."""
    rng = random.Random(rng_seed)
    tokenizer = client.app.state.server.service.tokenizer
    vocab = client.app.state.server.service.spec.vocab_size
    prompt = _prompt(rng, kind, tokenizer, vocab)
    k = None if logprobs is None else rng.randint(0, 5)
    max_tokens = rng.randint(0, 6)
    ids, echoed = _ids_and_text(tokenizer, prompt, max_tokens > 0)
    body = {"prompt": rng.choice([prompt, [prompt]]), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "echo": True,
            **({} if k is None else {"logprobs": k})}  # fmt: skip
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    asks_prompt = k is not None or max_tokens == 0  # what the server asks the engine for
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=k,
                        prompt_logprobs=(k or 0) if asks_prompt else None)  # fmt: skip
    ref = _reference(model_dir, ids, sp, prompt_echoed=True)
    assert choice["text"] == echoed + ref.text, rng_seed
    assert choice["finish_reason"] == ref.finish_reason == "length", rng_seed
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), max_tokens)
    assert "prompt_logprobs" not in choice  # vLLM's field: not asked
    whole = choice["logprobs"]
    if k is None:
        assert whole is None, rng_seed
    else:
        _check_block(whole, ids, echoed, ref, k, tokenizer, rng_seed)

    chunks = _stream(client, body, read_sse)
    assert chunks[0]["text"] == echoed or not echoed, rng_seed  # the prompt, first
    assert "".join(c["text"] for c in chunks) == choice["text"], rng_seed
    assert chunks[-1]["finish_reason"] == choice["finish_reason"], rng_seed
    if k is None:
        assert all(c["logprobs"] is None for c in chunks), rng_seed
        return
    first = chunks[0]["logprobs"]
    assert first["tokens"] == whole["tokens"][: len(ids)], rng_seed  # the prompt's, first
    assert first["text_offset"] == whole["text_offset"][: len(ids)], rng_seed
    streamed = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    for key in ("tokens", "text_offset", "token_logprobs"):
        values = [v for block in streamed for v in block[key]]
        if key == "token_logprobs":
            assert values[0] is None and all(
                abs(a - b) <= TOL for a, b in zip(values[1:], whole[key][1:], strict=True)
            ), rng_seed
        else:
            assert values == whole[key], (rng_seed, key)


def _check_block(lp: dict, ids, echoed: str, ref, k: int, tokenizer, seed: int) -> None:
    """An echo's logprobs: the prompt's tokens then the generated ones, values the reference's,
    offsets counted from the start of the echoed text."""
    n = len(ids)
    all_ids = ids + ref.token_ids
    assert lp["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in all_ids]
    values = lp["token_logprobs"]
    assert values[0] is None and lp["top_logprobs"][0] is None, seed  # nothing precedes it
    want = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.logprobs]
    assert len(values) == len(all_ids) and all(
        abs(a - b) <= TOL for a, b in zip(values[1:], want, strict=True)
    ), seed
    for token, value, top in zip(lp["tokens"][1:], values[1:], lp["top_logprobs"][1:],
                                 strict=True):  # fmt: skip
        if k == 0:
            assert top is None, seed
        else:  # the k most likely and the token itself (OpenAI's "up to logprobs + 1")
            assert 1 <= len(top) <= k + 1 and top[token] >= value - TOL, seed
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets), seed
    assert all(o <= len(echoed) for o in offsets[:n]), seed
    # The generated tokens' offsets start where the echoed prompt ends.
    assert offsets[n:] == [len(echoed) + o for o in ref.offsets], seed
    pieces = lp["tokens"][:n]
    if not any("\ufffd" in p for p in pieces) and "".join(pieces) == echoed:
        # Each prompt token is its own text: its offset is the length of those before it.
        assert offsets[:n] == [sum(map(len, pieces[:i])) for i in range(n)], seed


def test_max_tokens_0_needs_echo(client, read_sse, rng_seed, api_error):
    """Without echo, max_tokens 0 asks for nothing: a 400 naming the field sent. With echo it
    is the prompt alone, whole or streamed: its text, finish_reason "length", no tokens."""
    rng = random.Random(rng_seed)
    prompt = _words(rng, rng.randint(1, 8))
    for key in ("max_tokens", "max_completion_tokens"):
        error = api_error(client.post(URL, json={"prompt": prompt, key: 0}), 400)
        assert error["param"] == key and "echo" in error["message"], error
    body = {"prompt": prompt, "max_tokens": 0, "echo": True}
    answer = client.post(URL, json=body).json()
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (prompt, "length", None)
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] > 0
    chunks = _stream(client, body, read_sse)
    assert [c["text"] for c in chunks] == [prompt, ""], chunks
    assert [c["finish_reason"] for c in chunks] == [None, "length"], chunks


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_echoes_its_prompt(client, read_sse, rng_seed, stream):
    """n choices with echo and logprobs: each choice's text and entries start with the
    prompt's, then its own generation (choices seeded apart)."""
    rng = random.Random(rng_seed)
    prompt, n = _words(rng, rng.randint(2, 8)), rng.randint(2, 3)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "n": n, "max_tokens": 4,
            "temperature": 1.0, "seed": rng.randrange(1 << 30), "stream": stream}  # fmt: skip
    reply = client.post(URL, json=body)
    assert reply.status_code == 200, reply.text
    texts, tokens = {i: "" for i in range(n)}, {i: [] for i in range(n)}
    nulls = {i: [] for i in range(n)}
    chunks = read_sse(reply.text.splitlines()) if stream else [reply.json()]
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        for choice in chunk.get("choices", []):
            i = choice["index"]
            texts[i] += choice["text"]
            if choice["logprobs"] is not None:
                tokens[i] += choice["logprobs"]["tokens"]
                nulls[i] += [v is None for v in choice["logprobs"]["token_logprobs"]]
    n_prompt = len(client.app.state.server.service.tokenizer.encode(prompt))
    for i in range(n):
        assert texts[i].startswith(prompt), (i, texts[i])
        assert len(tokens[i]) > n_prompt and nulls[i][:1] == [True] and not any(nulls[i][1:])


@pytest.mark.parametrize("reply", ["completes", "breaks", "none"])
def test_an_echoed_prompt_that_cuts_a_character_reads_as_the_whole_text(
    client, read_sse, rng_seed, reply
):
    """Token ids ending one byte short of a character, echoed: echo and reply read as the
    decode of prompt and reply together, streamed or not. The echo showed the character as
    U+FFFD and a reply completing it showed it again; the echo now leaves it to the reply,
    which shows it whole, or as U+FFFD where it breaks it; with max_tokens 0, the echo. A
    stream's first chunk still carries every prompt token's entry (the cut one's offset is
    the echo's end, where the reply shows its character)."""
    rng = random.Random(rng_seed)
    tokenizer = client.app.state.server.service.tokenizer
    char = rng.choice(["🙂", "你", "é", "🚀"])
    words = _words(rng, rng.randint(1, 4))
    by_byte = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    pieces = [by_byte[bytes([b])] for b in char.encode()]  # one byte token a byte
    prompt = tokenizer.encode(words) + pieces[:-1]
    forced = pieces[-1] if reply == "completes" else tokenizer.encode(" " + _words(rng, 1))[0]
    body = {"prompt": prompt, "max_tokens": 0 if reply == "none" else 1, "temperature": 0,
            "echo": True, "logit_bias": {str(forced): 100},
            "logprobs": rng.randint(0, 3)}  # fmt: skip
    choice = client.post(URL, json=body).json()["choices"][0]
    whole = choice["text"]
    chunks = _stream(client, body, read_sse)
    streamed = "".join(c["text"] for c in chunks)
    generated = [] if reply == "none" else [forced]
    assert whole == streamed == tokenizer.decode(prompt + generated), (whole, streamed)
    first, n = chunks[0]["logprobs"], len(prompt)
    assert first["tokens"] == choice["logprobs"]["tokens"][:n], first
    assert first["text_offset"] == choice["logprobs"]["text_offset"][:n], first
    if reply == "completes":
        assert whole == words + char


def test_the_cut_character_the_reply_shows_meets_the_stop_strings(client, read_sse, rng_seed):
    """Echoed ids cutting a character, the reply ending at once (its end-of-text token
    forced): the reply shows the cut character as U+FFFD at its end, and a stop string
    matching it cuts it there, as any of the reply's text (it was never searched: no token
    had been pushed)."""
    rng = random.Random(rng_seed)
    tokenizer = client.app.state.server.service.tokenizer
    words = _words(rng, rng.randint(1, 4))
    by_byte = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    lead = by_byte[rng.choice(["é", "你", "🙂", "🚀"]).encode()[:1]]  # a character's first byte
    prompt = tokenizer.encode(words) + [lead]
    ends = {str(t): 100 for t in sorted(tokenizer.special_token_ids)}
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
            "logit_bias": ends}  # fmt: skip
    shown = client.post(URL, json=body).json()["choices"][0]["text"]
    assert shown == words + "\ufffd", shown
    body["stop"] = ["\ufffd"]
    choice = client.post(URL, json=body).json()["choices"][0]
    streamed = "".join(c["text"] for c in _stream(client, body, read_sse))
    assert choice["text"] == streamed == words and choice["finish_reason"] == "stop", choice


@pytest.mark.parametrize("bad", [-1, 2**40, None])
def test_an_echoed_id_outside_the_vocabulary_is_refused(client, api_error, rng_seed, bad):
    rng = random.Random(rng_seed)
    vocab = client.app.state.server.service.spec.vocab_size
    bad = vocab + rng.randint(0, 9) if bad is None else bad
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    ids.insert(rng.randint(0, len(ids)), bad)
    body = {"prompt": ids, "echo": True, "max_tokens": rng.choice([0, 2]), "logprobs": 1}
    error = api_error(client.post(URL, json=body), 400)
    assert error["param"] == "prompt" and str(bad) in error["message"]
