"""Damaged or unsupported checkpoints are refused with an error naming the file and what is
wrong, never a traceback from deep in safetensors, a crash, or weights written in the wrong
place: a safetensors file cut short (an interrupted download), an index that is no index, a
config.json that is no object, a quantized checkpoint, a router asked for more experts than a
layer has, an expert numbered past config.json's count. And convert keeps the named chat
templates (additional_chat_templates/), which tool prompts are rendered with."""

from __future__ import annotations

import json
import random

import pytest
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
    with pytest.raises(CheckpointError, match=f"expert {fewer}, but config.json gives {fewer}"):
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
