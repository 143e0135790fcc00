"""The demo checkpoint: built once, atomically, bit-for-bit deterministic, and in exactly the
form transformers writes and reads for qwen3_moe."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import freetoken_agent.demo_model as demo_model
from freetoken_agent.demo_model import DEMO_NOTICE, DEMO_VERSION, FILES, ensure_demo_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def tensor_table(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open has no __iter__
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in names}


def test_builds_every_file_quickly(tmp_path: Path) -> None:
    start = time.perf_counter()
    path = ensure_demo_model(tmp_path)
    assert time.perf_counter() - start < 5.0
    assert path == tmp_path / f"demo-{DEMO_VERSION}"
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp folder left over
    readme = (path / "README.md").read_text()
    assert "RANDOM" in readme and "gibberish" in readme
    assert "random" in DEMO_NOTICE and "gibberish" in DEMO_NOTICE


def test_second_call_reuses_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_demo_model(tmp_path)
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def fail(out: Path) -> None:
        raise AssertionError("rebuilt a cached demo model")

    monkeypatch.setattr(demo_model, "build_demo_model", fail)
    assert ensure_demo_model(tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes


def test_env_var_picks_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "env-cache"))
    assert ensure_demo_model() == tmp_path / "env-cache" / f"demo-{DEMO_VERSION}"


def test_crash_leaves_no_half_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_tensors = demo_model.model_tensors

    def crash(config: dict) -> dict:
        real_tensors(config)
        raise OSError("disk full")

    monkeypatch.setattr(demo_model, "model_tensors", crash)
    with pytest.raises(OSError, match="disk full"):
        ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(demo_model, "model_tensors", real_tensors)
    assert ensure_demo_model(tmp_path).is_dir()


def test_incomplete_folder_is_rebuilt(tmp_path: Path) -> None:
    path = ensure_demo_model(tmp_path)
    (path / "model.safetensors").unlink()
    assert ensure_demo_model(tmp_path) == path
    assert (path / "model.safetensors").is_file()


def test_two_builds_are_bitwise_identical(demo: Path, tmp_path: Path) -> None:
    other = ensure_demo_model(tmp_path)
    for name in FILES:
        assert (demo / name).read_bytes() == (other / name).read_bytes(), name


def test_loads_in_transformers_without_missing_or_unexpected_keys(demo: Path) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(demo, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    config = json.loads((demo / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(demo)
    assert config["vocab_size"] == len(tok) == 1024
    # Every weight in the file reached the model unchanged.
    with safe_open(str(demo / "model.safetensors"), "pt") as f:
        state = model.state_dict()
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if name in state:
                assert torch.equal(state[name], f.get_tensor(name)), name


def test_same_form_as_save_pretrained(demo: Path, tmp_path: Path) -> None:
    """config.json keys and tensor names/shapes/dtypes equal transformers' own output. The
    `transformers_version` stamp says which release the form was taken from; each release
    writes its own, so only its presence is compared."""
    ours = json.loads((demo / "config.json").read_text())
    config = transformers.AutoConfig.from_pretrained(demo)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hf")
    theirs = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert list(ours) == list(theirs)
    ours.pop("transformers_version"), theirs.pop("transformers_version")
    assert ours == theirs
    assert tensor_table(demo / "model.safetensors") == tensor_table(
        tmp_path / "hf" / "model.safetensors"
    )
    names = tensor_table(demo / "model.safetensors")
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in names
    assert ours["num_local_experts"] == 8 and "rope_parameters" in ours


def test_greedy_decoding_is_not_on_ties(demo: Path) -> None:
    """Parity tests compare greedy tokens across implementations; near-ties would make them
    flaky, and a collapsed model (one repeated token) would make them weak."""
    model = transformers.AutoModelForCausalLM.from_pretrained(demo).eval()
    tok = transformers.AutoTokenizer.from_pretrained(demo)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a function."}], tokenize=False
    )
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        logits = model(out).logits[0, ids.shape[1] - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
    assert len(set(out[0, ids.shape[1] :].tolist())) > 8


def test_engine_side_imports_no_transformers() -> None:
    code = (
        "import sys\n"
        "import freetoken_agent.demo_model, freetoken_agent.engine.text.tokenizer\n"
        "import freetoken_agent.engine.text.detokenizer\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
