"""The Responses API's kept responses, read by OpenAI's own SDK against a real server (the demo
model): a response read back (GET /v1/responses/{id}) is the one served; its input items list
(GET .../input_items) gives the request's items in order, page by page, as the SDK's cursor
pages them; a deleted response, or one asked with store false, is not found (404), and
previous_response_id no longer continues it. Inputs and page sizes are drawn fresh each run."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from freetoken_agent.integrations.server.responses_store import ResponseStore, StoredResponse

MODEL = "freetoken-demo"
KEY = "sk-local-test"
WORDS = ["alpha", "beta", "café", "ka", "lo", "mi", "ru", "x,", "日本"]


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server(model_dir, model_id=MODEL, api_key=KEY)


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))


def _conversation(rng: random.Random) -> tuple[list[dict], list[str]]:
    """Messages alternating user and assistant (ending with the user's), content a string or
    input/output text parts, and each one's text."""
    items, texts = [], []
    for i in range(2 * rng.randint(0, 12) + 1):
        role = "assistant" if i % 2 else "user"
        text = _text(rng)
        part = "output_text" if role == "assistant" else "input_text"
        content = text if rng.random() < 0.5 else [{"type": part, "text": text}]
        typed = {"type": "message"} if rng.random() < 0.5 else {}
        items.append({"role": role, "content": content, **typed})
        texts.append(text)
    return items, texts


def test_a_kept_response_reads_back_and_lists_its_input(server, rng_seed):
    rng = random.Random(rng_seed)
    client = _sdk(server)
    items, texts = _conversation(rng)
    request = {"model": MODEL, "input": items, "max_output_tokens": rng.randint(2, 8),
               "temperature": 0.0, "instructions": _text(rng)}  # fmt: skip
    if rng.random() < 0.5:
        with client.responses.stream(**request) as stream:
            served = list(stream)[-1].response
    else:
        served = client.responses.create(**request)
    read = client.responses.retrieve(served.id)
    assert read.model_dump() == served.model_dump()
    limit = rng.randint(1, 7)
    order = rng.choice(["asc", "desc"])
    listed = list(client.responses.input_items.list(served.id, limit=limit, order=order))
    expected = texts if order == "asc" else texts[::-1]
    assert [item.content[0].text for item in listed] == expected
    roles = ["assistant" if i % 2 else "user" for i in range(len(texts))]
    assert [item.role for item in listed] == (roles if order == "asc" else roles[::-1])
    assert len({item.id for item in listed}) == len(listed)  # distinct ids: the cursor's keys
    first = client.responses.input_items.list(served.id, limit=limit, order=order)
    assert first.has_more == (len(texts) > limit) and len(first.data) == min(limit, len(texts))


def test_deleted_and_unstored_responses_are_not_found(server, rng_seed):
    rng = random.Random(rng_seed)
    client = _sdk(server)
    request = {"model": MODEL, "input": _text(rng), "max_output_tokens": rng.randint(2, 6)}
    kept = client.responses.create(**request)
    unkept = client.responses.create(**request, store=False)
    assert unkept.store is False
    client.responses.delete(kept.id)
    for gone in (kept.id, unkept.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(gone)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**request, previous_response_id=gone)
        assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)  # once only


def test_bad_list_queries_are_refused_naming_the_field(server, rng_seed):
    rng = random.Random(rng_seed)
    client = _sdk(server)
    served = client.responses.create(model=MODEL, input=_text(rng), max_output_tokens=2)
    url = f"{server.base}/v1/responses/{served.id}/input_items"
    headers = {"Authorization": f"Bearer {KEY}"}
    bad = rng.choice([("limit", rng.choice(["0", "101", "x"])), ("order", "up"),
                      ("after", f"msg_{rng.randrange(1 << 30)}")])  # fmt: skip
    r = httpx.get(url, params=dict([bad]), headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == bad[0], r.text


def test_the_store_keeps_the_newest_within_its_count_and_bytes(rng_seed):
    """Responses of random sizes, put and deleted at random: after each put the store keeps
    the newest ones whose own parts fit its bytes and count (the newest always), dropping the
    oldest first; a deleted one gives its bytes back."""
    rng = random.Random(rng_seed)

    max_kept, max_bytes = rng.randint(4, 8), rng.randint(1000, 4000)

    forced = rng.randrange(17)  # three large ones in a row from here: the bytes must bind
    # (with sizes at random alone they never bound for some seeds, 1 run in ~400)

    def stored(i: int) -> StoredResponse:
        large = rng.randint(max_bytes // 2 + 1, max_bytes)
        size = large if forced <= i < forced + 3 else rng.choice([0, rng.randint(1, 400), large])
        text = "x" * size
        own = [{"type": "message", "role": "user", "content": text}]
        return StoredResponse({"id": f"resp_{i}", "output": []}, own, own)

    bytes_bound = False  # whether the bytes, not the count, dropped one (the test's point)
    store = ResponseStore(max_kept, max_bytes)
    kept: list[StoredResponse] = []  # the expected store, oldest first
    for i in range(rng.randint(20, 40)):
        response = stored(i)
        store.put(response)
        kept.append(response)
        while len(kept) > 1 and (len(kept) > max_kept or sum(r.size for r in kept) > max_bytes):
            bytes_bound |= len(kept) <= max_kept
            kept.pop(0)
        if rng.random() < 0.25:
            gone = f"resp_{rng.randint(0, i)}"
            assert store.delete(gone) == any(r.response["id"] == gone for r in kept)
            kept = [r for r in kept if r.response["id"] != gone]
        held = [f"resp_{j}" for j in range(i + 1) if store.get(f"resp_{j}") is not None]
        assert held == [r.response["id"] for r in kept], (rng_seed, i)
        assert len(store) == len(kept)
    assert bytes_bound, rng_seed
