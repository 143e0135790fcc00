"""Stop strings and stop ids do not cut a JSON-schema output: the grammar decides where it ends
(a stop met inside the JSON ended the request "stop" with text that did not parse)."""

from __future__ import annotations

import json
import random

import pytest
from random_schemas import random_name, random_scalar

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model

# The test extra's; the device image has neither, and its GPU run collects this module.
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")


def test_stops_inside_the_json_do_not_cut_it(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=4096, max_model_len=1024)  # fmt: skip
    names = list(dict.fromkeys(random_name(rng) for _ in range(rng.randint(2, 4))))
    while len(names) < 2:
        names.append(random_name(rng, names))
    schema = {
        "type": "object",
        "properties": {n: random_scalar(rng) for n in names},
        "required": names,  # at least two keys: the JSON holds ", " and ": "
        "additionalProperties": False,
    }
    quote = engine.tokenizer.encode('"')
    for _ in range(3):
        sp = SamplingParams(
            max_tokens=400, temperature=rng.choice([0, 1.0]), seed=rng.getrandbits(31),
            stop=rng.sample([", ", ": ", '"', "{"], 2), stop_token_ids=quote, json_schema=schema,
        )  # fmt: skip
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(3, 20))]
        out = engine.generate(prompt, sp)
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
