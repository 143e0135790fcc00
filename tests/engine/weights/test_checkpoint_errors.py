"""Damaged or unsupported checkpoints are refused with an error naming the file and what is
wrong, never a traceback from deep in safetensors, a crash, or weights written in the wrong
place: a safetensors file cut short (an interrupted download), an index that is no index, a
config.json that is no object, a quantized checkpoint, a router asked for more experts than a
layer has, an expert numbered past config.json's count. And convert keeps the named chat
templates (additional_chat_templates/), which tool prompts are rendered with."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.engine.config import ConfigError, read_config
from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.engine.weights import ftw
from freetoken_agent.engine.weights.loader import CheckpointError


def _load(folder) -> Engine:
    return Engine.load(folder, device="cpu", progress=False, kv_tokens=256, max_model_len=128)


def test_a_cut_short_safetensors_file_names_itself(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    (path,) = (tmp_path / "m").glob("*.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: rng.randint(8, len(data) // 2)])  # the header or the data cut
    folder, out = tmp_path / "m", tmp_path / "out"
    for attempt in (lambda: _load(folder), lambda: ftw.convert(folder, out, progress=False)):
        with pytest.raises(CheckpointError, match="not a readable safetensors file") as e:
            attempt()
        assert str(path) in str(e.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("index", ['{"metadata": {}}', "{not json", '{"weight_map": [1, 2]}'])
def test_an_index_that_is_no_index_names_itself(tmp_path, rng_seed, index):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a safetensors"):
        _load(tmp_path)


@pytest.mark.parametrize("content", ["[1, 2]", '"qwen3_moe"', "7"])
def test_a_config_that_is_no_object_is_a_config_error(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        read_config(tmp_path)


def test_quantized_checkpoints_and_impossible_routing_are_refused(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    config = json.loads((tmp_path / "config.json").read_text())
    method = rng.choice(["fp8", "awq", "gptq"])
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": method}}))  # fmt: skip
    for attempt in (lambda: _load(tmp_path), lambda: ftw.convert(tmp_path, tmp_path / "o", False)):
        with pytest.raises(ConfigError, match=f"quantized checkpoint \\({method}\\)"):
            attempt()
    too_many = config["num_local_experts"] + rng.randint(1, 9)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": too_many}))
    with pytest.raises(ConfigError, match=f"routes each token to {too_many} experts"):
        spec_from_config(read_config(tmp_path))


def test_an_expert_past_the_configs_count_is_refused_by_convert(tmp_path, rng_seed):
    """Its rows would have filled the next layer's (or run past the bank)."""
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    fewer = config["num_local_experts"] - 1
    config = {**config, "num_local_experts": fewer,
              "num_experts_per_tok": min(config["num_experts_per_tok"], fewer)}  # fmt: skip
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    # (the router's gate is refused first where it holds a row per expert, as the load does)
    gate = rf"expert {fewer}, but config.json gives {fewer}|the model expects \({fewer}, "
    with pytest.raises(CheckpointError, match=gate):
        ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_convert_keeps_the_named_chat_templates(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    named = tmp_path / "m" / "additional_chat_templates"
    named.mkdir()
    text = f"{{{{ messages }}}} tools {random.Random(rng_seed).randrange(1 << 30)}"
    (named / "tool_use.jinja").write_text(text)
    out = ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == text


def _fuse_experts(folder, n_experts: int) -> None:
    """Rewrite a tiny qwen3_moe checkpoint's experts in the fused 3-D layout (transformers 5,
    the Qwen3.5 releases: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) with
    `n_experts` experts a layer (the first ones, or the last repeated)."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    out, per = {}, {}
    for name, tensor in state.items():
        m = re.fullmatch(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            out[name] = tensor
        else:
            per.setdefault(m[1], {})[(int(m[2]), m[3])] = tensor
    for prefix, parts in per.items():
        have = max(e for e, _ in parts) + 1
        order = [min(e, have - 1) for e in range(n_experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in order])
    save_file(out, folder / "model.safetensors")


def test_fused_experts_of_another_count_than_the_configs_are_refused_by_convert(tmp_path, rng_seed):
    """More were dropped silently (and verify then passed); fewer ran past the tensor."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    n = json.loads((tmp_path / "m" / "config.json").read_text())["num_local_experts"]
    shutil.copytree(tmp_path / "m", tmp_path / "right")
    _fuse_experts(tmp_path / "right", n)
    ftw.convert(tmp_path / "right", tmp_path / "same", progress=False)  # the right count
    wrong = n + rng.choice([-1, 1, 2])
    _fuse_experts(tmp_path / "m", wrong)
    with pytest.raises(CheckpointError, match=f"holds {wrong} experts, but config.json gives {n}"):
        ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_experts_under_another_familys_names_are_refused_by_convert_naming_them(tmp_path, rng_seed):
    """A folder whose config.json names another family than its weights' (or a layout the
    table lacks): convert found no expert and failed after the pass with "N expert rows
    missing: w13[0] ..."; it now says which names it read and which tensors look like experts,
    before writing anything."""

    make_tiny("mixtral", tmp_path / "m", rng_seed)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    wrong = "qwen3_moe"
    config.update(model_type=wrong, moe_intermediate_size=config["intermediate_size"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no routed expert tensors") as raised:
        ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)
    says = str(raised.value)
    assert f"model_type '{wrong}'" in says and "mlp.experts.{E}.gate_proj.weight" in says, says
    assert "block_sparse_moe.experts.0.w1.weight" in says, says
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_integer_experts_are_refused_by_convert(tmp_path, rng_seed):
    """Cast into the bank, an int8 expert loaded from the FTW folder the HF load refuses."""
    import torch
    from safetensors.torch import load_file, save_file

    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    state = load_file(tmp_path / "m" / "model.safetensors")
    name = rng.choice([k for k in state if ".experts." in k])
    state[name] = state[name].to(torch.int8)
    save_file(state, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name} has dtype I8; expected a float tensor"):
        ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)


def test_a_stray_safetensors_file_beside_model_safetensors_is_not_read(tmp_path, rng_seed):
    """As transformers reads a folder: model.safetensors alone (a stray copy sorting after it
    replaced the weights); without it, a name two files hold is refused, not guessed."""
    import torch
    from safetensors.torch import load_file, save_file

    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    ids = [rng.randrange(3, 200) for _ in range(12)]
    clean = _load(tmp_path / "m").score(ids)
    state = load_file(tmp_path / "m" / "model.safetensors")
    stray = {k: v + 1 for k, v in state.items()}  # an old copy, other weights
    save_file(stray, tmp_path / "m" / f"zz-{rng.randrange(99)}-copy.safetensors")
    assert torch.equal(_load(tmp_path / "m").score(ids), clean)
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "model-a.safetensors")
    with pytest.raises(CheckpointError, match="is in two files of"):
        _load(tmp_path / "m")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_checkpoint_holding_experts_in_two_layouts_is_refused(tmp_path, rng_seed, family):
    """Per-expert tensors and transformers 5's fused ones for the same layer (two saves mixed
    up): whichever was read last filled the weights, silently. The load and convert refuse
    it, naming the tensors."""
    from safetensors.torch import load_file, save_file

    rng = random.Random(rng_seed)
    first = make_tiny(family, tmp_path / "m", rng_seed)
    first.save_pretrained(tmp_path / "own", save_original_format=False)
    layer = rng.randrange(first.config.num_hidden_layers)
    if family == "qwen3_moe":  # (its dense layers have no experts)
        layer = rng.choice([i for i in range(first.config.num_hidden_layers)
                            if i not in first.config.mlp_only_layers])  # fmt: skip
    fused = {n: t for n, t in load_file(tmp_path / "own" / "model.safetensors").items()
             if n.startswith(f"model.layers.{layer}.mlp.experts.")}  # fmt: skip
    assert fused, "no fused experts in transformers' own layout"
    state = load_file(tmp_path / "m" / "model.safetensors")
    state.update({n: t + 1 for n, t in fused.items()})  # other values than the per-expert
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="hold the same weights: keep one layout"):
        Engine.load(tmp_path / "m", device="cpu", progress=False, kv_tokens=256)
    with pytest.raises(CheckpointError, match="which another tensor of .* wrote"):
        ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)


@pytest.mark.parametrize("fault", ["unexpected", "missing", "shape", "integer"])
def test_convert_refuses_dense_tensors_the_load_refuses_before_writing(
    tmp_path, rng_seed, fault, monkeypatch
):
    """convert copied the dense tensors byte for byte, unchecked: a folder with a stray, a
    missing, a misshaped or an integer dense tensor converted "successfully" into an FTW folder
    the load then refused. Now convert refuses it with the load's own message, before it
    writes anything (its first write, the banks' space, must not be reached)."""
    from safetensors.torch import load_file, save_file
    from tiny_models import FAMILIES, HYBRID_FAMILIES

    rng = random.Random(rng_seed)
    family = rng.choice([*FAMILIES, *HYBRID_FAMILIES])
    make_tiny(family, tmp_path / "m", rng_seed)
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(path)
    dense = sorted(n for n in state if ".experts." not in n and state[n].dim() == 2)
    name = rng.choice(dense)
    if fault == "unexpected":
        state[f"model.layers.0.{rng.choice(['bogus', 'extra_proj'])}.weight"] = torch.zeros(3)
    elif fault == "missing":
        del state[name]
    elif fault == "shape":
        rows, cols = state[name].shape
        state[name] = torch.zeros(rows + rng.randint(1, 3), cols)
    else:
        state[name] = torch.zeros(state[name].shape, dtype=torch.int32)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as loaded:
        _load(tmp_path / "m")

    def no_write(*args, **kwargs):
        raise AssertionError("convert began to write")

    monkeypatch.setattr(ftw, "allocate", no_write)
    with pytest.raises(CheckpointError) as converted:
        ftw.convert(tmp_path / "m", tmp_path / "out", progress=False)
    assert str(converted.value) == str(loaded.value), (family, fault)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
