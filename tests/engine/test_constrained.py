"""Constrained decoding: random JSON schemas, a random-weight model, valid JSON every time.

The demo checkpoint (random weights, a real byte-level BPE tokenizer) writes gibberish when
free; under a schema it must write one JSON value that parses and validates, then stop. Schemas
are drawn per run. Their strings, numbers and arrays are bounded (maxLength, minimum/maximum
with multipleOf, maxItems) because a random model decoding greedily can otherwise loop inside an
unbounded string until max_tokens: that is a "length" finish, not a grammar failure.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.constrained import (
    GrammarBackendMissing,
    GrammarCompiler,
    GrammarMatcher,
    Grammars,
    allowed_tokens,
    load_backend,
    tool_call_schema,
)
from freetoken_agent.engine.layers.sampler import sample
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.sampling_params import Constraint

pytest.importorskip("llguidance")
# Tiny shapes: torch's intra-op threads only add contention on the 2-core CI machine.
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NAME_CHARS = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789_- é"\\'
SCALARS = ("string", "integer", "number", "boolean", "enum")


# --- fixtures and helpers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def engine(demo: Path) -> Engine:
    # float64: batch composition then cannot flip a near-tied argmax by float noise.
    return Engine.load(demo, device="cpu", dtype="float64", progress=False, kv_tokens=4096)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(0, 1000) for _ in range(rng.randint(3, 20))]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(NAME_CHARS) for _ in range(rng.randint(1, 8)))


def _scalar(rng: random.Random, kind: str) -> Any:
    if kind == "string":
        hi = rng.randint(0, 6)
        return {"type": "string", "minLength": rng.randint(0, hi), "maxLength": hi}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        step = rng.choice([0.5, 0.25, 0.125])
        lo = rng.randint(-400, 400) * step
        return {"type": "number", "minimum": lo, "maximum": lo + 50.0, "multipleOf": step}
    if kind == "boolean":
        return {"type": "boolean"}
    pool = [_name(rng) for _ in range(3)] + [rng.randint(-99, 99), True, None]
    return {"enum": list({json.dumps(v): v for v in rng.sample(pool, rng.randint(1, 4))}.values())}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema: random property names, scalar / array / nested object values,
    a random `required` subset, no extra properties."""
    names = list(dict.fromkeys(_name(rng) for _ in range(rng.randint(1, 4 if depth == 0 else 2))))
    props = {}
    for name in names:
        kind = rng.choice([*SCALARS, "array", "object"] if depth == 0 else SCALARS)
        if kind == "array":
            hi = rng.randint(0, 3)
            items = _scalar(rng, rng.choice(SCALARS))
            props[name] = {"type": "array", "items": items, "minItems": rng.randint(0, hi)}
            props[name]["maxItems"] = hi
        elif kind == "object":
            props[name] = random_schema(rng, depth + 1)
        else:
            props[name] = _scalar(rng, kind)
    required = rng.sample(names, rng.randint(0, len(names)))
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # True == 1 in Python, not in JSON


def validate(value: Any, schema: dict, path: str = "$") -> None:
    """The subset of JSON Schema that `random_schema` and `tool_call_schema` use."""
    if "enum" in schema:
        assert any(_same(value, e) for e in schema["enum"]), f"{path}: {value!r} not in enum"
        return
    if "const" in schema:
        assert _same(value, schema["const"]), f"{path}: {value!r} != {schema['const']!r}"
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        assert set(value) <= set(schema["properties"]), f"{path}: extra keys {value.keys()}"
        assert set(schema.get("required", [])) <= set(value), f"{path}: missing required"
        for key, item in value.items():
            validate(item, schema["properties"][key], f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: not an array"
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), path
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), f"{path}: not a string"
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30), path
    elif kind in ("integer", "number"):
        ok = (int,) if kind == "integer" else (int, float)
        assert isinstance(value, ok) and not isinstance(value, bool), f"{path}: {value!r}"
        assert schema["minimum"] <= value <= schema["maximum"], f"{path}: {value} out of range"
        if "multipleOf" in schema:
            q = value / schema["multipleOf"]
            assert abs(q - round(q)) < 1e-9, f"{path}: {value} not a multiple"
    elif kind == "boolean":
        assert isinstance(value, bool), f"{path}: not a boolean"
    else:
        raise AssertionError(f"validator does not know {kind!r}")


def parse(text: str) -> Any:
    """json.loads, refusing duplicate keys (json.loads would keep the last silently)."""

    def pairs(items: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), f"duplicate keys in {text!r}"
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs)


def _sampling(rng: random.Random, greedy: bool, **kw: Any) -> SamplingParams:
    """Greedy, or temperature / top-p sampling with a random seed."""
    if greedy:
        return SamplingParams(temperature=0, **kw)
    temp, top_p = rng.uniform(0.5, 1.5), rng.choice([1.0, 0.9])
    return SamplingParams(temperature=temp, top_p=top_p, seed=rng.randrange(2**31), **kw)


# --- generation under a schema -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_random_schemas_give_valid_json_that_ends_the_request(engine, rng_seed, mode):
    rng = random.Random(rng_seed)
    free_valid = 0
    for _ in range(4):
        schema = random_schema(rng)
        prompt = _prompt(rng)
        greedy = mode == "greedy"
        out = engine.generate(prompt, _sampling(rng, greedy, max_tokens=400, json_schema=schema))
        assert out.finish_reason == "stop", (schema, out.text, out.error)
        validate(parse(out.text), schema)
        # It stops at the closing brace: no EOS, no whitespace, nothing after the JSON.
        assert out.text.endswith("}") and not set(out.token_ids) & engine.eos_token_ids
        assert engine.tokenizer.decode(out.token_ids) == out.text
        # The same request unconstrained: the model alone does not write this JSON.
        free = engine.generate(prompt, _sampling(rng, greedy, max_tokens=len(out.token_ids)))
        try:
            validate(parse(free.text), schema)
            free_valid += 1
        except (AssertionError, ValueError, KeyError, TypeError):
            pass
    assert free_valid < 4
    assert len(engine.grammars) == 0  # finished requests leave no matcher behind


def test_top_level_scalar_may_end_with_eos(engine, rng_seed):
    """A number can always take one more digit: the grammar is accepting but not stopped, so
    the mask offers EOS and the model ends it (or it reaches the schema's longest number)."""
    rng = random.Random(rng_seed)
    for greedy in (True, False, False):
        top = rng.randint(10, 10**6)
        schema = {"type": "integer", "minimum": 0, "maximum": top}
        out = engine.generate(_prompt(rng), _sampling(rng, greedy, json_schema=schema))
        assert out.finish_reason == "stop", out
        text = out.text
        validate(parse(text), schema)
        if out.token_ids[-1] not in engine.eos_token_ids:  # stopped: no digit can follow
            assert text == "0" or all(int(text + d) > top for d in "0123456789"), text


def test_forced_tool_call(engine, rng_seed):
    rng = random.Random(rng_seed)
    name = "tool_" + "".join(rng.choice("abcxyz") for _ in range(6))
    tool = {"type": "function", "function": {"name": name, "parameters": random_schema(rng)}}
    schema = tool_call_schema(tool)
    for greedy in (True, False):
        sp = _sampling(rng, greedy, max_tokens=400, json_schema=schema)
        call = parse(engine.generate(_prompt(rng), sp).text)
        assert list(call) == ["name", "arguments"] and call["name"] == name
        validate(call["arguments"], tool["function"]["parameters"])
    no_params = tool_call_schema({"name": "ping"})
    out = engine.generate(_prompt(rng), SamplingParams(temperature=0, json_schema=no_params))
    assert parse(out.text) == {"name": "ping", "arguments": {}}


def test_grammars_are_compiled_once_per_schema_and_keep_property_order(
    engine, rng_seed, monkeypatch
):
    rng = random.Random(rng_seed)
    schema = random_schema(rng)
    while len(schema["properties"]) < 2:
        schema = random_schema(rng)
    schema["required"] = list(schema["properties"])  # every property, in the listed order
    flipped = dict(schema, properties=dict(reversed(schema["properties"].items())))
    engine.generate(_prompt(rng), SamplingParams(temperature=0, json_schema=schema))
    compiled = []
    compile_schema = GrammarCompiler._compile
    monkeypatch.setattr(
        GrammarCompiler, "_compile", lambda self, s: compiled.append(s) or compile_schema(self, s)
    )
    for js in (schema, flipped, schema, flipped):
        out = engine.generate(_prompt(rng), _sampling(rng, False, json_schema=js))
        assert list(parse(out.text)) == list(js["properties"])
    # `schema` was compiled by the first request, before the spy
    assert compiled == [Constraint("json_schema", flipped)]


def test_batch_with_a_constrained_request_leaves_the_others_alone(engine, rng_seed):
    rng = random.Random(rng_seed)
    free_prompt, json_prompt = _prompt(rng), _prompt(rng)
    schema = random_schema(rng)
    for greedy in (True, False):
        free = _sampling(rng, greedy, max_tokens=24, ignore_eos=True)
        constrained = _sampling(rng, greedy, max_tokens=400, json_schema=schema)
        alone = engine.generate(free_prompt, free).token_ids
        json_alone = engine.generate(json_prompt, constrained).token_ids
        outs = engine.generate([json_prompt, free_prompt], [constrained, free])
        assert outs[1].token_ids == alone
        assert outs[0].token_ids == json_alone
        validate(parse(outs[0].text), schema)


def test_padded_vocab_rows_are_never_sampled(demo, tmp_path, rng_seed):
    """lm_head with more rows than the tokenizer has ids; the padded rows get the largest
    logits, so an unconstrained request picks them and a constrained one must not."""
    rng = random.Random(rng_seed)
    folder = tmp_path / "padded"
    folder.mkdir()
    for f in demo.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    pad = 64
    tensors = load_file(str(demo / "model.safetensors"))
    gen = torch.Generator().manual_seed(rng_seed)
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        w = tensors[key]
        tensors[key] = torch.cat([w, torch.randn(pad, w.shape[1], generator=gen, dtype=w.dtype)])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((demo / "config.json").read_text())
    n_ids = config["vocab_size"]
    config["vocab_size"] = n_ids + pad
    (folder / "config.json").write_text(json.dumps(config))
    engine = Engine.load(folder, device="cpu", progress=False, kv_tokens=2048)
    model = engine.loaded.model
    logits_of = model.compute_logits

    def padded_rows_win(hidden: torch.Tensor) -> torch.Tensor:
        logits = logits_of(hidden)  # [N, V]
        logits[:, n_ids:] += 1e4
        return logits

    model.compute_logits = padded_rows_win
    prompt = _prompt(rng)
    free = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert all(t >= n_ids for t in free.token_ids)  # the trap works
    schema = random_schema(rng)
    for greedy in (True, False):
        out = engine.generate(prompt, _sampling(rng, greedy, max_tokens=400, json_schema=schema))
        assert max(out.token_ids) < n_ids and out.finish_reason == "stop"
        validate(parse(out.text), schema)


# --- failures ------------------------------------------------------------------------------
def test_a_failing_grammar_ends_only_its_request(engine, rng_seed):
    rng = random.Random(rng_seed)
    free_prompt = _prompt(rng)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate(free_prompt, free).token_ids
    schema = random_schema(rng)
    rid = engine.submit(_prompt(rng), SamplingParams(temperature=0, json_schema=schema))
    other = engine.submit(free_prompt, free)
    # Drive the request's matcher into llguidance's error state: an object cannot start with 7.
    matcher = engine.grammars._matchers[rid]._m
    assert not matcher.consume_token(engine.tokenizer.encode("7")[0])
    while engine.has_unfinished():
        engine.step()
    req = engine._requests[rid]
    assert req.finish_reason == "error" and "constrained output failed" in req.error
    assert req.output_ids == []
    assert engine._requests[other].output_ids == alone
    engine._pop(rid), engine._pop(other)
    ok = engine.generate(_prompt(rng), SamplingParams(temperature=0, json_schema=schema))
    validate(parse(ok.text), schema)
    engine.check_integrity()


def test_matcher_with_no_allowed_token_reports_it():
    class NothingAllowed:
        def compute_bitmask(self) -> bytes:
            return bytes(4 * 4)

        def is_error(self) -> bool:
            return False

        def stop_reason(self) -> str:
            return "NoExtension"

    m = GrammarMatcher(NothingAllowed(), np.full(4, -1, dtype=np.int32))
    row = np.full(4, 12345, dtype=np.int32)
    assert not m.fill(row) and not row.any()
    assert "no token of the vocabulary can continue" in m.problem


def test_ids_the_tokenizer_lacks_are_banned_even_if_the_matcher_allows_them(rng_seed):
    rng = random.Random(rng_seed)
    n_ids, model_vocab = rng.randint(1, 200), rng.randint(201, 400)

    class AllAllowed:
        def compute_bitmask(self) -> bytes:
            return b"\xff" * 4 * (-(-model_vocab // 32))

        def is_error(self) -> bool:
            return False

    class FakeTokenizer:
        vocab_size = n_ids

    grammars = Grammars(FakeTokenizer(), model_vocab, eos_ids=[0])
    row = np.empty(grammars.words, dtype=np.int32)
    assert GrammarMatcher(AllAllowed(), grammars._valid).fill(row)
    allowed = allowed_tokens(["r"], {"r": row}, model_vocab, torch.device("cpu"))[0]
    assert allowed[:n_ids].all() and not allowed[n_ids:].any()


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "int"}, ["'type'", "'int'"]),
        ({"type": "object", "properties": {"a b": 5}}, ["/properties/a b"]),
        ({"type": "object", "required": "a"}, ["'required'"]),
        ({"type": "array", "items": {"type": "string", "maxLength": -1}}, ["/items", "maxLength"]),
        ({"enum": []}, ["'enum'"]),
        ({"anyOf": {}}, ["'anyOf'"]),
        ({"type": "string", "default": {1, 2}}, ["not plain JSON"]),
        ("{}", ["must be a dict"]),
        # pydantic's Decimal: a look-ahead, which llguidance refused naming no property
        (
            {
                "type": "object",
                "properties": {
                    "total": {
                        "anyOf": [
                            {"type": "number"},
                            {"type": "string", "pattern": "^(?!^[-+.]*$)[+-]?0*\\d*\\.?\\d*$"},
                        ]
                    }
                },
            },
            ["/properties/total/anyOf/1", "look-around"],
        ),  # fmt: skip
        ({"type": "string", "pattern": "^(a|b)\\1$"}, ["'pattern'", "backreference"]),
    ],
)
def test_invalid_schema_is_refused_by_sampling_params(schema, words):
    with pytest.raises(ValueError, match="json_schema") as info:
        SamplingParams(json_schema=schema)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("schema", "word"),
    [
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ({"type": "string", "pattern": "(("}, "regex"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}, "nowhere"),
    ],
)
def test_schema_the_grammar_cannot_use_is_refused_at_submit(engine, rng_seed, schema, word):
    rng = random.Random(rng_seed)
    with pytest.raises(InvalidRequestError, match="json_schema cannot be used") as info:
        engine.submit(_prompt(rng), SamplingParams(json_schema=schema))
    assert word in str(info.value)
    assert not engine.has_unfinished() and len(engine.grammars) == 0


def test_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert SamplingParams(response_format=fmt).json_schema == schema
    assert SamplingParams(response_format={"type": "json_object"}).json_schema == {"type": "object"}
    assert SamplingParams(response_format={"type": "text"}).json_schema is None
    with pytest.raises(ValueError, match="'xml'"):
        SamplingParams(response_format={"type": "xml"})
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(response_format=fmt, json_schema={"type": "string"})
    with pytest.raises(ValueError, match="'type'"):
        SamplingParams(
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": 1}}}
        )


def test_missing_library_is_named_when_a_constrained_request_comes(demo, monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import now fails as if absent
    engine = Engine.load(demo, device="cpu", progress=False, kv_tokens=1024)
    prompt = _prompt(rng)
    out = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4
    with pytest.raises(GrammarBackendMissing, match="'llguidance'.*pip install"):
        engine.submit(prompt, SamplingParams(json_schema={"type": "object"}))
    assert not engine.has_unfinished()


def test_too_old_library_is_named(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.7.6")
    with pytest.raises(GrammarBackendMissing, match="1.8 or later, found 1.7.6"):
        load_backend()


def test_engine_does_not_import_the_library_until_asked(demo):
    code = (
        "import sys\n"
        "from freetoken_agent import Engine, SamplingParams\n"
        "import freetoken_agent.engine.constrained, freetoken_agent.engine.runner\n"
        "SamplingParams(json_schema={'type': 'object'})\n"
        f"e = Engine.load({str(demo)!r}, device='cpu', progress=False, kv_tokens=512)\n"
        "e.generate([5, 6, 7], SamplingParams(max_tokens=2))\n"
        "assert 'llguidance' not in sys.modules, 'imported too early'\n"
        "e.generate([5, 6, 7], SamplingParams(max_tokens=2, json_schema={'type': 'object'}))\n"
        "assert 'llguidance' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# --- the mask itself -----------------------------------------------------------------------
def test_allowed_tokens_unpacks_bits_and_leaves_free_rows_open(rng_seed):
    rng = np.random.default_rng(rng_seed)
    vocab = int(rng.integers(33, 300))
    words = -(-vocab // 32)
    rows = {"a": rng.integers(-(2**31), 2**31, size=words, dtype=np.int64).astype(np.int32)}
    allowed = allowed_tokens(["free", "a", "other"], rows, vocab, torch.device("cpu"))
    assert allowed.shape == (3, vocab) and allowed.dtype == torch.bool
    expect = np.unpackbits(rows["a"].view(np.uint8), bitorder="little")[:vocab].astype(bool)
    assert np.array_equal(allowed[1].numpy(), expect)
    assert allowed[0].all() and allowed[2].all()
    assert allowed_tokens(["free"], rows, vocab, torch.device("cpu")) is None


def test_sampler_picks_only_allowed_ids_and_keeps_free_rows_bitwise(rng_seed):
    torch.manual_seed(rng_seed)
    n, vocab = 400, 64
    logits = torch.randn(n, vocab) * 2
    allowed = torch.rand(n, vocab) < 0.2
    allowed[torch.arange(n), torch.randint(0, vocab, (n,))] = True  # at least one per row
    allowed[::2] = True  # even rows unconstrained
    for temp in (0.0, 0.8):
        params = [SamplingParams(temperature=temp, top_k=rng_seed % 3 * 5)] * n
        gens = [torch.Generator().manual_seed(rng_seed + i) for i in range(n)]
        got = sample(logits, params, gens, allowed).tokens
        assert allowed[torch.arange(n), got].all()
        gens = [torch.Generator().manual_seed(rng_seed + i) for i in range(n)]
        free = sample(logits, params, gens).tokens
        assert torch.equal(got[::2], free[::2])
    greedy = sample(logits, [SamplingParams(temperature=0)] * n, [None] * n, allowed).tokens
    assert torch.equal(greedy, logits.masked_fill(~allowed, float("-inf")).argmax(-1))


# --- on the device -------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_cuda_with_decode_graphs(demo, rng_seed):
    """The mask is applied after the captured decode graphs, on the device; prints the cost."""
    rng = random.Random(rng_seed)
    engine = Engine.load(demo, device="cuda", progress=False, max_model_len=1024)
    assert engine.runner.graphs is not None
    for greedy in (True, False):
        for _ in range(3):
            schema = random_schema(rng)
            sp = _sampling(rng, greedy, max_tokens=400, json_schema=schema)
            out = engine.generate(_prompt(rng), sp)
            assert out.finish_reason == "stop", (out.text, out.error)
            validate(parse(out.text), schema)
    free = _sampling(rng, False, max_tokens=30, ignore_eos=True)
    schema = random_schema(rng)
    both = engine.generate(
        [_prompt(rng), _prompt(rng)], [free, _sampling(rng, True, json_schema=schema)]
    )
    assert len(both[0].token_ids) == 30
    validate(parse(both[1].text), schema)
    # Decode cost per token, one request, with and without a grammar.
    prompt = _prompt(rng)
    long_string = {"type": "string", "maxLength": 10_000}
    for label, js in (("free", None), ("json", long_string), ("free", None), ("json", long_string)):
        sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, json_schema=js)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompt, sp)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / len(out.token_ids) * 1e3
        print(f"{label}: {len(out.token_ids)} tokens, {ms:.3f} ms/token")


def test_a_tools_arguments_are_an_object_even_untyped(rng_seed):
    """Parameters that list properties without `"type": "object"` still take an object: the
    call's schema says so (else `"arguments": true` would pass)."""
    import jsonschema  # here: the device image has none, and its GPU tests live in this file

    rng = random.Random(rng_seed)
    props = {f"p{i}": {"type": "integer"} for i in range(rng.randint(1, 3))}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": props}}}
    schema = tool_call_schema(tool)
    arguments = {k: rng.randint(0, 9) for k in props}
    jsonschema.validate({"name": "f", "arguments": arguments}, schema)
    for wrong in (True, rng.randint(0, 9), "x", [arguments]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "f", "arguments": wrong}, schema)
