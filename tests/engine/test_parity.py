"""Parity with transformers on tiny random checkpoints of every family (CPU, fp32)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import FAMILIES, HYBRID_FAMILIES, hf_greedy, make_tiny, max_rel_err, tiny_config

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.config import ConfigError, read_config
from freetoken_agent.engine.layers.rope import inv_freq_and_scale
from freetoken_agent.engine.models.registry import spec_from_config


@pytest.fixture(params=(*FAMILIES, *HYBRID_FAMILIES))
def tiny(request, tmp_path, rng_seed):
    hf = make_tiny(request.param, tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=4096)
    return request.param, hf, engine, random.Random(rng_seed)


def test_score_matches_transformers(tiny):
    family, hf, engine, rng = tiny
    ids = [rng.randrange(3, 320) for _ in range(70)]
    ours = engine.score(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape == (70, 320)
    err = max_rel_err(ours, ref)
    print(family, "max relative error", err)
    assert err <= 1e-4
    engine.check_integrity()


@pytest.mark.parametrize("family", (*FAMILIES, *HYBRID_FAMILIES))
def test_transformers_own_layout_loads_directly_and_through_ftw(tmp_path, rng_seed, family):
    """A checkpoint saved in transformers 5's own layout (`save_original_format=False`: fused
    experts, and Mixtral's `block_sparse_moe` renamed `mlp`) scores as transformers does,
    from the folder and from its FTW form. Mixtral's was refused ("unexpected tensors")."""
    from freetoken_agent.engine.weights import ftw

    hf = make_tiny(family, tmp_path / "orig", rng_seed)
    hf.save_pretrained(tmp_path / "own", save_original_format=False)
    names = {n for f in (tmp_path / "own").glob("*.safetensors") for n in load_file(str(f))}
    assert any(n.endswith("experts.gate_up_proj") for n in names), sorted(names)[:8]
    ftw.convert(tmp_path / "own", tmp_path / "ftw", progress=False)
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for folder in ("own", "ftw"):
        engine = Engine.load(tmp_path / folder, device="cpu", progress=False, kv_tokens=256)
        err = max_rel_err(engine.score(ids), ref)
        assert err <= 1e-4, (family, folder, err)


@pytest.mark.parametrize("family", (*FAMILIES, *HYBRID_FAMILIES))
def test_head_dim_and_partial_rotary_fields_read_as_in_transformers(tmp_path, rng_seed, family):
    """Whole-head families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): transformers has no
    partial rotation for them (a top-level partial_rotary_factor fails on a shape, one in
    rope_parameters is read by one table only); it was applied here, silently: now refused,
    naming the field (1.0 loads). The hybrid families: without head_dim, transformers' 256
    (not hidden / heads, which refused the weights)."""
    rng = random.Random(rng_seed)
    folder = tmp_path / "m"
    if family in FAMILIES:
        hf = make_tiny(family, folder, rng_seed)
        cfg = json.loads((folder / "config.json").read_text())
        for factor in (rng.choice([0.25, 0.5, 0.75]), 1.0):
            where = cfg if rng.random() < 0.5 else cfg.setdefault("rope_parameters", {})
            where["partial_rotary_factor"] = factor
            (folder / "config.json").write_text(json.dumps(cfg))
            if factor != 1.0:
                with pytest.raises(ConfigError, match=f"partial_rotary_factor {factor}: {family}"):
                    Engine.load(folder, device="cpu", progress=False, kv_tokens=256)
                where.pop("partial_rotary_factor")
    else:
        hf = make_tiny(family, folder, rng_seed, head_dim=256)
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["head_dim"]
    (folder / "config.json").write_text(json.dumps(cfg))
    ids = [rng.randrange(3, 320) for _ in range(40)]
    with torch.no_grad():
        ref = _reload(folder)(torch.tensor([ids])).logits[0]
        assert max_rel_err(ref, hf(torch.tensor([ids])).logits[0]) <= 1e-5  # the same model
    engine = Engine.load(folder, device="cpu", progress=False, kv_tokens=256)
    err = max_rel_err(engine.score(ids), ref)
    assert err <= 1e-4, (family, err)


@pytest.mark.parametrize("saved", ["bfloat16", "float16"])
def test_a_config_naming_no_dtype_runs_in_the_stored_one(tmp_path, rng_seed, saved):
    """transformers' dtype="auto": a config.json without a dtype, or with "auto", loads in the
    dtype the weights are stored in; here it ran in float32 (twice a bf16 model's memory), and
    "auto" was refused. A dtype config.json names still wins."""
    rng = random.Random(rng_seed)
    family = rng.choice((*FAMILIES, *HYBRID_FAMILIES))
    make_tiny(family, tmp_path, rng_seed, dtype=getattr(torch, saved))
    cfg = json.loads((tmp_path / "config.json").read_text())
    ids = [rng.randrange(3, 320) for _ in range(24)]
    given = Engine.load(tmp_path, device="cpu", dtype=saved, progress=False, kv_tokens=256)
    for declared in (None, "auto", "float32"):
        cfg.pop("torch_dtype", None)
        cfg["dtype"] = declared
        if declared is None:
            del cfg["dtype"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=256)
        want = declared if declared == "float32" else saved
        assert engine.stats()["dtype"] == want, (family, declared)
        if want == saved:
            assert torch.equal(engine.score(ids), given.score(ids)), (family, declared)


def test_greedy_matches_transformers(tiny):
    family, hf, engine, rng = tiny
    prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(5, 40))]
    ref = hf_greedy(hf, prompt, 32)
    out = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out.token_ids == ref, f"{family}: diverged at {_first_diff(out.token_ids, ref)}"
    assert out.finish_reason == "length"


def test_batch_equals_alone(tiny):
    family, hf, engine, rng = tiny
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 17, 41, 66)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [engine.generate(p, sp).token_ids for p in prompts]
    engine.radix.reset()  # no prefix reuse between the two runs
    batched = [o.token_ids for o in engine.generate(prompts, sp)]
    assert batched == alone
    engine.check_integrity()


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), -1)


def _reload(folder) -> torch.nn.Module:
    """transformers' own load of a folder, fp32, eager attention."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


def _edit_json(path, **changes) -> None:
    """Set keys of a JSON file (None: remove the key)."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("head", ["distinct", "copy"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_tied_config_with_a_checkpoint_head_loads_as_in_transformers(
    tmp_path, rng_seed, family, head
):
    """tie_word_embeddings true, and the checkpoint carries lm_head.weight: transformers keeps
    a head that differs from the embeddings, untied (the engine dropped it and tied), and ties
    an equal copy."""
    make_tiny(family, tmp_path, rng_seed)  # untied: a head of its own
    if head == "copy":
        f = tmp_path / "model.safetensors"
        tensors = load_file(f)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, f, metadata={"format": "pt"})
    _edit_json(tmp_path / "config.json", tie_word_embeddings=True)
    hf = _reload(tmp_path)
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied == (head == "copy")
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=4096)
    model = engine.loaded.model
    assert engine.spec.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert max_rel_err(engine.score(ids), ref) <= 1e-4


def test_generation_config_eos_ends_generation_as_in_transformers(tmp_path, rng_seed):
    """generation_config.json's eos_token_id (an int or a list) ends transformers' generate;
    the engine read that file only beside a tokenizer.json, so a folder without one (as
    make_tiny's) generated on past it."""
    rng = random.Random(rng_seed)
    family = rng.choice(FAMILIES)
    hf = make_tiny(family, tmp_path, rng_seed)
    assert not (tmp_path / "tokenizer.json").exists()
    prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(5, 30))]
    free = hf_greedy(hf, prompt, 16)
    stop = free[rng.randrange(1, 12)]  # greedy reaches it within 12 tokens
    eos = rng.choice([stop, [rng.randrange(3, 320), stop]])
    _edit_json(tmp_path / "generation_config.json", eos_token_id=eos)
    _edit_json(tmp_path / "config.json", eos_token_id=None)  # generation_config.json's alone
    ids = torch.tensor([prompt])
    out = _reload(tmp_path).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
        pad_token_id=0,
    )  # fmt: skip
    ref = out[0, len(prompt) :].tolist()
    assert len(ref) < 16 and ref[-1] in (eos if isinstance(eos, list) else [eos])
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=4096)
    assert stop in engine.eos_token_ids
    got = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0))
    assert got.token_ids == ref and got.finish_reason == "stop"


# Config fields that the family's transformers config class defaults when config.json lacks
# them (its RoPE, norm eps and sliding-window settings).
_DEFAULTED = ("rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
              "partial_rotary_factor", "sliding_window", "max_window_layers")  # fmt: skip


def _hf_windows(cfg) -> list[int]:
    """Each layer's attention window as transformers' modeling runs it (0: full attention)."""
    window = getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None) or []
    if "sliding_attention" in types:  # Qwen2-MoE: per layer type
        return [window if t == "sliding_attention" else 0 for t in types]
    return [0 if types else window] * cfg.num_hidden_layers


@pytest.mark.parametrize("rope", ["absent", "yarn", "llama3"])
@pytest.mark.parametrize("family", (*FAMILIES, *HYBRID_FAMILIES, "qwen3_5_moe_vl"))
def test_absent_config_fields_resolve_as_in_transformers(tmp_path, rng_seed, family, rope):
    """Absent fields take the family's transformers defaults, not one global value: Mixtral's
    rope_theta 1e6, Mixtral's and OLMoE's rms_norm_eps 1e-5, the Qwen3-Next family's
    partial_rotary_factor 0.25, Qwen2/3-MoE's sliding_window 4096 and max_window_layers 28.
    A top-level original_max_position_embeddings replaces the rope dict's, as transformers'
    standardize_rope_params does when it builds the table. Compared on what the model runs:
    the RoPE table, the norm eps, the windows."""
    import transformers as tf

    rng = random.Random(rng_seed)
    cfg = tiny_config(family).to_dict()
    text = cfg.get("text_config") or cfg  # the vl variant's text model
    for key in (*_DEFAULTED, *(("layer_types",) if family == "qwen2_moe" else ())):
        text.pop(key, None)
    text["use_sliding_window"] = True  # read by Qwen2/3-MoE only
    # transformers' yarn and llama3 tables read config.head_dim, None in Mixtral's.
    text["head_dim"] = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if rope != "absent":
        text["rope_scaling"] = {
            "rope_type": rope,
            "factor": rng.choice([2.0, 4.0, 8.0]),
            "original_max_position_embeddings": rng.choice([64, 128, 256]),
        }
        if rope == "llama3":
            text["rope_scaling"].update(low_freq_factor=1.0, high_freq_factor=4.0)
        text["original_max_position_embeddings"] = rng.choice([16, 32, 48])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_cfg = tf.AutoConfig.from_pretrained(tmp_path)
    if family == "qwen3_5_moe_vl":
        hf = tf.Qwen3_5MoeForConditionalGeneration._from_config(hf_cfg)
    else:
        hf = tf.AutoModelForCausalLM.from_config(hf_cfg)
    rotary = next(
        m for n, m in hf.named_modules() if n.endswith("rotary_emb") and "visual" not in n
    )
    spec = spec_from_config(read_config(tmp_path))
    inv_freq, scale = inv_freq_and_scale(spec.rope, spec.max_position_embeddings)
    torch.testing.assert_close(inv_freq, rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-6)
    text_cfg = hf_cfg.get_text_config()
    assert spec.rms_norm_eps == text_cfg.rms_norm_eps
    assert [spec.window(i) for i in range(spec.n_layers)] == _hf_windows(text_cfg)


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_absent_theta_and_eps_give_transformers_logits(tmp_path, rng_seed, family):
    """The logits of a checkpoint whose config.json gives no rope_theta and no rms_norm_eps
    (the engine used 1e4 and 1e-6 for every family)."""
    make_tiny(family, tmp_path, rng_seed)
    _edit_json(tmp_path / "config.json", rope_parameters=None, rope_theta=None, rms_norm_eps=None)
    hf = _reload(tmp_path)
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=4096)
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, 320) for _ in range(200)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert max_rel_err(engine.score(ids), ref) <= 1e-4
