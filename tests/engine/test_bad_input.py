"""Bad input gets a clear error that names the problem, and never disturbs other requests."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import FAMILIES, HYBRID_FAMILIES, make_tiny, tiny_config

from freetoken_agent import ContextLengthError, Engine, InvalidRequestError, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.config import ConfigError
from freetoken_agent.engine.experts.placement import BudgetError
from freetoken_agent.engine.loading import dense_nbytes
from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.engine.weights.loader import CheckpointError


@pytest.fixture
def model_dir(tmp_path, rng_seed):
    make_tiny("qwen2_moe", tmp_path, rng_seed)
    return tmp_path


@pytest.fixture
def engine(model_dir):
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=2048, max_model_len=256)


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([], SamplingParams(max_tokens=4))


def test_token_outside_vocabulary(engine):
    with pytest.raises(
        InvalidRequestError, match=r"token id 320 is outside the vocabulary \[0, 320\)"
    ):
        engine.generate([5, 6, 320], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="token id -1"):
        engine.submit([-1, 4])


def test_prompt_over_context_limit(engine):
    with pytest.raises(ContextLengthError, match="300 tokens.*256"):
        engine.generate(list(range(3, 303)), SamplingParams(max_tokens=4))


def test_output_stops_at_context_limit(engine):
    out = engine.generate(list(range(3, 253)), SamplingParams(max_tokens=50, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.prompt_ids) + len(out.token_ids) == 256


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_bad_request_does_not_disturb_others(engine, rng_seed):
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(30)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = engine.generate(prompt, sp).token_ids
    rid = engine.submit(prompt, sp)
    with pytest.raises(InvalidRequestError):
        engine.submit([999999])
    while engine.has_unfinished():
        engine.step()
    assert engine._collect(rid).token_ids == alone
    engine.check_integrity()


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 2**70), ("top_p", 0.0), ("min_p", 2.0), ("repetition_penalty", 0.0),
     ("max_tokens", "5"), ("max_tokens", 0), ("temperature", -1.0), ("top_k", -3),
     ("logit_bias", {5: float("nan")})],
)  # fmt: skip
def test_a_field_set_after_construction_is_checked_at_submit(engine, rng_seed, field, value):
    """SamplingParams checks its values when built; one set afterwards (sp.seed = 2**70) is
    checked again at submit and refused naming it, never met inside the step, where it failed
    every request batched beside it (or, top_p 0, drew token 0 forever). A field changed
    after submit leaves the request as submitted (it runs on its own copy)."""
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(5, 30))]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = engine.generate(prompt, sp).token_ids
    other = engine.submit(prompt, sp)
    bad = SamplingParams(max_tokens=6, seed=rng.randrange(100))
    setattr(bad, field, value)
    with pytest.raises(InvalidRequestError, match=field) as refused:
        engine.submit(prompt, bad)
    assert refused.value.param == field
    running = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    late = engine.submit(prompt, running)
    running.max_tokens, running.temperature = 1, 5.0  # after submit: no effect
    while engine.has_unfinished():
        engine.step()
    assert engine._collect(other).token_ids == alone
    assert engine._collect(late).token_ids == alone
    engine.check_integrity()


def test_missing_tensor_is_named(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.experts\.5\.up_proj"
    ):
        Engine.load(model_dir, device="cpu", progress=False)


def test_unexpected_and_misshaped_tensors_are_named(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mlp.mystery.weight"] = torch.randn(3, 3)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.mlp\.mystery"):
        Engine.load(model_dir, device="cpu", progress=False)
    del tensors["model.layers.0.mlp.mystery.weight"]
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.randn(8, 64)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*\(8, 64\).*\(32, 64\)"):
        Engine.load(model_dir, device="cpu", progress=False)


def test_unknown_architecture(model_dir):
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "deepseek_v9"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown architecture 'deepseek_v9'.*qwen3_moe"):
        Engine.load(model_dir, device="cpu", progress=False)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine.load(tmp_path, device="cpu")


def test_bad_policy_and_slot_count_are_explained(model_dir):
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        Engine.load(model_dir, device="cpu", policy="fastest", progress=False)
    with pytest.raises(ValueError, match="expert_slots must be at least 1, got 0"):
        Engine.load(model_dir, device="cpu", policy="transfer", expert_slots=0, progress=False)


OFFLOADING = ("transfer", "cpu", "static", "adaptive", "direct", "gpu-fill")


def test_offload_settings_without_effect_are_named(tmp_path, model_dir, rng_seed, caplog):
    """A policy on a model with no MoE layer, expert_slots under 'resident' or past the
    model's experts: each loaded as it could (resident, or every expert in a slot) without a
    word. One warning names the setting and why."""
    import logging

    rng = random.Random(rng_seed)
    policy = rng.choice(OFFLOADING)
    layers = list(range(tiny_config("qwen3_moe").num_hidden_layers))  # every MLP dense
    make_tiny("qwen3_moe", tmp_path / "dense", rng_seed, mlp_only_layers=layers)
    spec = spec_from_config(json.loads((model_dir / "config.json").read_text()))
    rows = spec.n_moe_layers * spec.n_experts
    asked = rows + rng.randint(1, 1000)
    cases = [
        (tmp_path / "dense", {"policy": policy}, f"policy '{policy}': the model has no MoE layer"),
        (model_dir, {"policy": "resident", "expert_slots": rng.randint(1, rows)},
         "no effect under policy 'resident'"),
        (model_dir, {"policy": policy, "expert_slots": asked},
         f"expert_slots {asked}: the model has {rows} routed experts in all"),
    ]  # fmt: skip
    for folder, options, says in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
            engine = Engine.load(folder, device="cpu", progress=False, kv_tokens=256, **options)
        named = [r for r in caplog.records if says in r.getMessage()]
        assert len(named) == 1, (options, caplog.text)
        experts = engine.stats()["experts"]
        assert experts.get("slots", rows) == rows, experts  # (clamped: every expert fits)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
        Engine.load(model_dir, device="cpu", progress=False, kv_tokens=256, policy=policy,
                    expert_slots=rng.randint(1, rows))  # fmt: skip
    ours = [r for r in caplog.records if r.name == "freetoken.experts"]
    assert not ours, caplog.text  # a setting that counts: no word


MIB = r"\d+\.\d\d MiB"  # sizes under a GiB: a tiny model's would read 0.00 GiB


def test_a_budget_short_of_the_dense_weights_says_so(model_dir, rng_seed):
    """It used to say the budget held the dense weights (0.00 GiB) but not one slot."""
    rng = random.Random(rng_seed)
    resident = Engine.load(model_dir, device="cpu", progress=False, policy="resident")
    dense = dense_nbytes(resident.loaded.model)
    for policy in OFFLOADING:
        budget = rng.choice([1, dense // 2, rng.randrange(1, dense)])
        with pytest.raises(BudgetError, match=rf"budget of {MIB} does not even hold the dense "
                           rf"weights \({MIB}\).*at least {MIB} in all"):  # fmt: skip
            Engine.load(model_dir, device="cpu", progress=False, policy=policy,
                        gpu_budget=budget, kv_tokens=256)  # fmt: skip
        budget = dense + rng.randrange(1, 64 << 20)  # the dense weights, not the workspace
        with pytest.raises(BudgetError, match=rf"budget of {MIB} holds the dense weights "
                           rf"\({MIB}\) but not a 256-token KV pool"):  # fmt: skip
            Engine.load(model_dir, device="cpu", progress=False, policy=policy,
                        gpu_budget=budget, kv_tokens=256)  # fmt: skip


def test_a_budget_short_of_the_slots_asked_for_is_refused(model_dir, rng_seed):
    """expert_slots used to skip the budget: a budget short of the dense weights loaded."""
    rng = random.Random(rng_seed)
    resident = Engine.load(model_dir, device="cpu", progress=False, policy="resident")
    spec, dense = resident.spec, dense_nbytes(resident.loaded.model)
    slots = rng.randint(1, spec.n_moe_layers * spec.n_experts - 1)
    need = dense + slots * spec.expert_bytes
    for policy in OFFLOADING:
        budget = rng.randrange(1, need)
        with pytest.raises(BudgetError, match=rf"budget of {MIB} cannot hold the dense weights "
                           rf"\({MIB}\) and the {slots} expert slots asked for"):  # fmt: skip
            Engine.load(model_dir, device="cpu", progress=False, policy=policy,
                        gpu_budget=budget, expert_slots=slots, kv_tokens=256)  # fmt: skip
    engine = Engine.load(model_dir, device="cpu", progress=False, policy=rng.choice(OFFLOADING),
                         gpu_budget=need, expert_slots=slots, kv_tokens=256)  # fmt: skip
    assert engine.stats()["experts"]["slots"] == slots


def test_a_resident_bank_past_the_budget_is_refused(model_dir, rng_seed):
    """policy resident keeps every expert on the GPU: a budget short of them and the dense
    weights is refused, on a simulated GPU (a CPU device) too, where it was ignored."""
    rng = random.Random(rng_seed)
    resident = Engine.load(model_dir, device="cpu", progress=False, policy="resident")
    spec, dense = resident.spec, dense_nbytes(resident.loaded.model)
    need = dense + spec.n_moe_layers * spec.n_experts * spec.expert_bytes
    says = rf"budget of {MIB} cannot hold the dense weights \({MIB}\) and every expert"
    with pytest.raises(BudgetError, match=says + rf" \({MIB}\), which policy 'resident'"):
        Engine.load(model_dir, device="cpu", progress=False, policy="resident",
                    gpu_budget=rng.randrange(1, need))  # fmt: skip
    engine = Engine.load(model_dir, device="cpu", progress=False, policy="resident",
                         gpu_budget=need + rng.randrange(1 << 20))  # fmt: skip
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, 100) for _ in range(5)]
    assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),  # past what torch's generator takes: it failed inside the step
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("stop_token_ids", "x"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["x"]),
        ("stop_token_ids", [True]),
        ("max_tokens", True),  # bool is an int to Python: it meant 1
        ("top_k", True),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("temperature", "0.5"),
        ("top_p", "0.9"),
        ("ignore_eos", "yes"),
        ("stop", 5),
    ],
)
def test_bad_sampling_values_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bare_stop_values_and_wide_seeds_are_taken(rng_seed):
    rng = random.Random(rng_seed)
    token = rng.randrange(3, 320)
    assert SamplingParams(stop_token_ids=token).stop_token_ids == [token]
    assert SamplingParams(stop_token_ids=np.int64(token)).stop_token_ids == [token]
    for seed in (-(2**63), -1, 2**64 - 1, np.int32(rng.randrange(2**31))):
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(top_k=np.int64(3), temperature=np.float32(0.5)).top_k == 3


@pytest.mark.parametrize(
    "prompt",
    [[5.9, 6.7, 7.2], [True, 7], [5, None], torch.tensor([5.0, 6.0]), 7, torch.ones(2, 3).long()],
)
def test_token_ids_that_are_not_integers_are_refused(engine, prompt):
    """int() would have turned 5.9 into 5 and True into 1: a silent change of the prompt."""
    with pytest.raises(InvalidRequestError, match="integers|token ids|one prompt"):
        engine.submit(prompt)
    assert not engine.has_unfinished()


def test_integer_token_ids_of_any_kind_are_the_same_prompt(engine, rng_seed):
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(12)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = engine.generate(ids, sp).token_ids
    forms = (np.array(ids), torch.tensor(ids, dtype=torch.int32), [np.int64(t) for t in ids],
             [torch.tensor(t) for t in ids])  # fmt: skip
    for form in forms:  # each one prompt (a 1-D tensor was taken for a list of 1-id prompts)
        assert engine.generate(form, sp).token_ids == want
    with pytest.raises(InvalidRequestError, match="anchors"):
        engine.submit(ids, anchors=[2.5])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_failing_at_its_token_fails_alone(model_dir, rng_seed, overlap):
    """An error while one request takes its token (here its text state breaking) fails that
    request only: the one beside it gets its tokens alone, and the engine serves on. It used
    to raise out of `step`: in the plain loop at every step, the request never ending; under
    overlap it failed the healthy request too."""
    engine = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=2048,
                         max_model_len=256, overlap_schedule=overlap)  # fmt: skip
    rng = random.Random(rng_seed)
    good_prompt, bad_prompt = ([rng.randrange(3, 320) for _ in range(20)] for _ in range(2))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = engine.generate(good_prompt, sp).token_ids
    good, bad = engine.submit(good_prompt, sp), engine.submit(bad_prompt, sp)
    breaks_at = rng.randrange(1, 4)
    state = engine._outputs[bad]
    push = state.push

    def broken_push(token):
        if len(engine._requests[bad].output_ids) > breaks_at:
            raise RuntimeError("the text state broke")
        return push(token)

    state.push = broken_push
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    failed = engine._collect(bad)
    assert failed.finish_reason == "error" and "the text state broke" in failed.error
    assert engine._collect(good).token_ids == alone
    assert engine.generate(good_prompt, sp).token_ids == alone
    engine.check_integrity()


def test_a_refused_request_leaves_no_grammar_behind(tmp_path, rng_seed):
    """Bad anchor_tokens are refused before the request's grammar is compiled and kept (it
    stayed registered under the refused id), on any model (an attention-only one ignored
    them unchecked). The demo model: grammars need a tokenizer."""
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False)
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(10)]
    sp = SamplingParams(max_tokens=8, json_schema={"type": "object"})
    bad = rng.choice([[2.5], [True], ["x"], [None]])
    with pytest.raises(InvalidRequestError, match="anchor_tokens"):
        engine.submit(prompt, sp, request_id="r", anchor_tokens=bad)
    assert len(engine.grammars) == 0 and not engine.has_unfinished()
    engine.submit(prompt, sp, request_id="r")  # the id was never taken
    assert len(engine.grammars) == 1


@pytest.mark.parametrize("family", (*FAMILIES, *HYBRID_FAMILIES, "qwen3_5_moe_vl"))
def test_an_activation_other_than_silu_is_refused(tmp_path, rng_seed, family):
    """Every family's MLPs and experts apply hidden_act; the engine ran SiLU whatever it said,
    so a GELU or ReLU model gave wrong logits silently. (The vl variant: in text_config.)"""
    act = random.Random(rng_seed).choice(["gelu", "relu", "gelu_pytorch_tanh", "silu_x"])
    tiny_config(family, hidden_act=act).save_pretrained(tmp_path)  # refused before any weights
    with pytest.raises(ConfigError, match=rf"hidden_act '{act}' is not supported"):
        Engine.load(tmp_path, device="cpu", progress=False)
    assert spec_from_config(tiny_config(family, hidden_act="swish").to_dict())  # SiLU by name


@pytest.mark.parametrize(
    "rope, top, field",
    [
        ({"rope_type": "linear"}, {}, "rope_scaling.factor is missing"),
        ({"rope_type": "llama3", "factor": 8.0}, {}, "rope_scaling.low_freq_factor is missing"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": "4"},
            {},
            "rope_scaling.high_freq_factor must be a number",
        ),
        ({"rope_type": "yarn", "factor": "4.0"}, {}, "rope_scaling.factor must be a number"),
        ({"rope_type": "yarn", "factor": True}, {}, "rope_scaling.factor must be a number"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": None},
            {},
            "rope_scaling.original_max_position_embeddings is missing",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0},
            {"original_max_position_embeddings": "128"},
            "config.json original_max_position_embeddings must be a number",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "rope_theta": "1e4"},
            {},
            "rope_scaling.rope_theta must be a number",
        ),
        ({}, {"rope_theta": [1e4]}, "config.json rope_theta must be a number"),
    ],
)
def test_malformed_rope_parameters_are_named(tmp_path, rng_seed, rope, top, field):
    """They used to fail as a bare TypeError while the rope table was built (or a string
    factor passed through float())."""
    family = random.Random(rng_seed).choice(FAMILIES)
    cfg = tiny_config(family).to_dict()
    cfg.pop("rope_parameters", None)
    cfg.update({"rope_theta": 10000.0, "rope_scaling": rope, **top})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(field)):
        Engine.load(tmp_path, device="cpu", progress=False)


def test_float64_with_offloaded_experts_is_refused_at_load(tmp_path, rng_seed):
    """The CPU expert kernel reads fp32/bf16/fp16: a float64 run that offloads would fail at
    its first miss on the CPU (after filling slots), so the load refuses it by name."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    policy = rng.choice(["transfer", "cpu", "static", "adaptive"])
    with pytest.raises(ConfigError, match="float64 runs only with every expert resident"):
        Engine.load(tmp_path, device="cpu", dtype="float64", policy=policy, expert_slots=1,
                    progress=False)  # fmt: skip
    engine = Engine.load(tmp_path, device="cpu", dtype="float64", policy="resident",
                         progress=False)  # fmt: skip
    out = engine.generate([rng.randrange(3, 320) for _ in range(6)], SamplingParams(max_tokens=3))
    assert out.finish_reason in ("length", "stop")


def test_a_device_that_is_not_there_is_named(model_dir, rng_seed):
    """`cuda:N` past the devices torch sees, or a backend name torch does not know: refused
    naming the device as given (the index was dropped from the message)."""
    rng = random.Random(rng_seed)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = f"cuda:{count + rng.randint(0, 7)}"
    with pytest.raises(ValueError, match=re.escape(repr(missing))):
        Engine.load(model_dir, device=missing, progress=False)
    unknown = rng.choice(["gpu", "tpu", "cuda0", "nvidia"])
    with pytest.raises(ValueError, match=f"unknown device '{unknown}'"):
        Engine.load(model_dir, device=unknown, progress=False)


def test_engine_options_of_the_wrong_name_or_type_are_named(model_dir, rng_seed):
    """A misspelt option names itself and its closest field (it was a bare TypeError from the
    dataclass); a byte count given as text or a bool names the field (it failed deep in the
    load on arithmetic); an integral float is taken (8e9 bytes)."""
    rng = random.Random(rng_seed)
    field = rng.choice(["kv_tokens", "max_model_len", "memory_reserve", "page_size"])
    typo = field[:-1] + rng.choice("xyz")
    with pytest.raises(TypeError, match=f"'{typo}' \\(did you mean '{field}'\\?\\)"):
        Engine.load(model_dir, device="cpu", progress=False, **{typo: 1})
    bad = rng.choice([f"{rng.randint(1, 64)}GB", True, 1.5, [1]])
    with pytest.raises(ValueError, match=re.escape(f"must be an integer or None, got {bad!r}")):
        Engine.load(model_dir, device="cpu", progress=False, gpu_budget=bad)
    tokens = float(rng.randint(64, 512) * 16)
    engine = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=tokens)
    try:
        assert isinstance(engine.config.kv_tokens, int) and engine.config.kv_tokens == tokens
    finally:
        engine.close()


def test_switches_fractions_and_counts_out_of_range_are_named(model_dir, rng_seed):
    """A switch given as text ("false" read as on), a fraction as text (a bare TypeError), a
    negative count (a tensor of negative size deep in the load), max_model_len 0 (read as
    the model's), a seed past torch's range: each refused naming its field."""
    rng = random.Random(rng_seed)
    switch = rng.choice(["overlap_schedule", "double_buffer", "cuda_graphs", "elastic"])
    cases = [
        ({switch: rng.choice(["false", "no", 0, 1, None])}, f"{switch} must be True or False"),
        ({"popular_pins": rng.choice(["0.5", True, [0.5]])}, "popular_pins must be a number"),
        ({"expert_slots": rng.randint(-9, 0)}, "expert_slots must be at least 1"),
        ({"kv_pages": rng.randint(-3, 1)}, "kv_pages must be at least 2"),
        ({"max_model_len": rng.randint(-9, 0)}, "max_model_len must be at least 1"),
        ({"elastic_group_bytes": rng.randint(-9, 0)}, "elastic_group_bytes must be at least 1"),
        ({"seed": rng.choice([2**64 + rng.randrange(99), -(2**63) - 1])}, "seed must be in"),
        ({"memory_poll_s": rng.choice([0, -1.0, float("nan"), float("inf")])}, "memory_poll_s"),
    ]
    for options, says in cases:
        with pytest.raises(ValueError, match=re.escape(says)):
            Engine.load(model_dir, device="cpu", progress=False, **options)


def test_set_gpu_budget_takes_a_count_of_bytes(model_dir, rng_seed):
    """None, inf, text or a bool as the live budget are refused by name (a bare TypeError or
    OverflowError); an integral float is taken as the load's budget is."""
    rng = random.Random(rng_seed)
    engine = Engine.load(model_dir, device="cpu", progress=False, gpu_budget=1 << 30,
                         policy="transfer", kv_tokens=256)  # fmt: skip
    try:
        for bad in (None, float("inf"), float("nan"), "8GB", True, 1.5):
            with pytest.raises(InvalidRequestError, match="a count of bytes"):
                engine.set_gpu_budget(bad)
        budget = float(rng.randint(engine.memory.floor, engine.memory.budget))
        engine.set_gpu_budget(budget)
        assert engine.stats()["elastic"]["budget"] == int(budget)
    finally:
        engine.close()


def test_a_dict_where_sampling_params_go_is_refused_by_name(engine, rng_seed):
    """A dict of fields was read as a list of per-prompt params and failed on its keys
    ("'str' object has no attribute 'stop'")."""
    rng = random.Random(rng_seed)
    fields = {"max_tokens": rng.randint(1, 9)}
    prompt = [rng.randrange(1, 200) for _ in range(rng.randint(1, 9))]
    for call in (engine.generate, engine.submit, engine.stream):
        with pytest.raises(InvalidRequestError, match="must be a SamplingParams, got dict"):
            out = call(prompt, fields)
            if call == engine.stream:  # a generator: submits when first read
                next(out)
    assert engine.generate(prompt, SamplingParams(**fields)).token_ids  # the engine is fine
