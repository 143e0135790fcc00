"""Constrained requests (json_schema, grammars) under overlap scheduling: step N's masks are
built when N samples, after N-1's tokens were accepted and advanced the grammars, so the
overlapped loop gives the plain loop's events exactly, and its steps do lag (overlap is not
just switched off for them, as it was)."""

from __future__ import annotations

import json
import random

import pytest
from overlap_runs import both_loops
from random_schemas import random_object_schema

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")  # (the GPU image has none)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def _load(path, overlap: bool) -> Engine:
    # float64: a batch's make-up cannot flip a near-tied argmax by float noise.
    return Engine.load(path, device="cpu", dtype="float64", progress=False, kv_tokens=4096,
                       overlap_schedule=overlap)  # fmt: skip


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(0, 1000) for _ in range(rng.randint(3, 20))]


def test_constrained_requests_overlap_with_the_plain_loop_s_events(demo, rng_seed):
    """Greedy and seeded sampled schema-constrained requests beside free ones, one arriving
    mid-decode; every constrained output parses and validates."""
    rng = random.Random(rng_seed)
    schemas = [random_object_schema(rng) for _ in range(3)]

    def constrained(schema: dict, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=rng.randint(40, 80), json_schema=schema, **kw)

    first = [
        (_prompt(rng), constrained(schemas[0], temperature=0), {}),
        (_prompt(rng), constrained(schemas[1], temperature=0.8, seed=rng.randrange(1 << 30)), {}),
        (_prompt(rng), SamplingParams(max_tokens=rng.randint(10, 30), temperature=0,
                                      ignore_eos=True), {}),
    ]  # fmt: skip
    later = [(_prompt(rng), constrained(schemas[2], temperature=0), {})]
    plan = {0: first, rng.randint(3, 8): later}
    events, engine = both_loops(lambda overlap: _load(demo, overlap), plan)
    assert engine.overlap.lagged_steps >= 10, engine.overlap.lagged_steps
    tokenizer = engine.tokenizer
    by_request = list(events.values())
    validated = 0
    for schema, i in zip([schemas[0], schemas[1], schemas[2]], [0, 1, 3], strict=True):
        stream = by_request[i]
        if stream[-1][4] != "stop":
            continue  # cut by max_tokens inside a string: not the grammar's doing
        text = tokenizer.decode([e[1] for e in stream if e[1] is not None])
        jsonschema.validate(json.loads(text), schema)
        validated += 1
    assert validated >= 2, (validated, rng_seed)


def test_constrained_requests_alone_lag(demo, rng_seed):
    """A batch of constrained requests only: before, any constraint kept the whole batch on
    the plain loop (no lagged step at all)."""
    rng = random.Random(rng_seed)
    sp = [
        SamplingParams(max_tokens=rng.randint(30, 60), temperature=0,
                       json_schema=random_object_schema(rng))
        for _ in range(2)
    ]  # fmt: skip
    engine = _load(demo, True)
    outs = engine.generate([_prompt(rng), _prompt(rng)], sp)
    assert engine.overlap.lagged_steps >= 5, engine.overlap.lagged_steps
    plain = _load(demo, False).generate([o.prompt_ids for o in outs], sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain], rng_seed
