"""Tokenizer: loading a checkpoint folder, encode/decode parity with transformers, errors."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers

from freetoken_agent import Engine
from freetoken_agent.engine.config import ConfigError
from freetoken_agent.engine.loading import end_token_ids
from freetoken_agent.engine.text.chat_template import ChatTemplateError
from freetoken_agent.engine.text.tokenizer import Tokenizer, TokenizerConfigError

transformers = pytest.importorskip("transformers")

# Pieces that exercise byte-level BPE: multi-byte characters, NFC (e + combining acute),
# whitespace runs, digits, code, and the added-token strings themselves.
PIECES = [
    "Hello",
    " world",
    "def route(hidden, gate):",
    "\n",
    "\n\n",
    "  ",
    "\t",
    "42",
    " 3.14",
    "你好",
    "世界",
    "🙂",
    "🚀👍🏽",
    "café",
    "cafe\u0301",
    "Ω≈ç√",
    "'s",
    " don't",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    '{"a": [1, 2]}',
    "\u00a0",
    "\r\n",
]


def rand_text(rng: random.Random) -> str:
    parts = [rng.choice(PIECES) for _ in range(rng.randint(0, 12))]
    if rng.random() < 0.3:  # arbitrary code points, surrogates excluded
        parts.append(
            "".join(
                chr(rng.choice([rng.randint(32, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                for _ in range(4)
            )
        )
    return "".join(parts)


def copy_demo(demo: Path, dest: Path) -> Path:
    shutil.copytree(demo, dest)
    return dest


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_properties_match_transformers(ours: Tokenizer, hf_tok) -> None:
    assert ours.vocab_size == len(hf_tok) == 1024
    assert ours.bos_token_id is None and hf_tok.bos_token_id is None
    assert ours.pad_token_id == hf_tok.pad_token_id == ours.token_to_id("<|endoftext|>")
    # Its own eos_token only: the configs' end ids are the loader's (loading.end_token_ids).
    assert ours.eos_token_ids == {hf_tok.eos_token_id} == {ours.token_to_id("<|im_end|>")}
    hf_special = {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert ours.special_token_ids == hf_special
    assert ours.token_to_id("<think>") not in ours.special_token_ids  # parsers must see it
    for token_id in range(ours.vocab_size):
        token = ours.id_to_token(token_id)
        assert token == hf_tok.convert_ids_to_tokens(token_id)
        assert ours.token_to_id(token) == token_id
    assert ours.token_to_id("no such token") is None


def test_encode_decode_match_transformers(ours: Tokenizer, hf_tok, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(300):
        text = rand_text(rng)
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf_tok.encode(text, add_special_tokens=special), text
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


def test_broken_tokenizer_json_names_the_file(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    (folder / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(TokenizerConfigError, match="tokenizer.json cannot be loaded"):
        Tokenizer.from_dir(folder)


def test_malformed_tokenizer_config_names_the_file(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",')
    with pytest.raises(TokenizerConfigError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_dir(folder)
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerConfigError, match="must hold a JSON object"):
        Tokenizer.from_dir(folder)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"eos_token": 7}, "eos_token: expected a string"),
        ({"add_bos_token": "yes"}, "add_bos_token must be true or false"),
        ({"chat_template": 3}, "chat_template must be a string or a list"),
        ({"chat_template": [{"name": "x"}]}, "need 'name' and 'template'"),
        ({"added_tokens_decoder": {"abc": {"content": "x"}}}, "entry 'abc'"),
        ({"added_tokens_decoder": {"5": {"content": "<|im_end|>"}}}, "is id 5 here but"),
        ({"added_tokens_decoder": {"2000": {"content": "<new>"}}}, "should be id 2000"),
    ],
)
def test_bad_config_fields_name_the_problem(
    demo: Path, tmp_path: Path, changes: dict, problem: str
) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    edit_json(folder / "tokenizer_config.json", **changes)
    with pytest.raises(TokenizerConfigError, match=problem):
        Tokenizer.from_dir(folder)


def test_eos_ids_are_the_union_of_all_configs(demo: Path, tmp_path: Path) -> None:
    """The tokenizer knows its eos_token; generation_config.json's and config.json's ids are
    read in one place, by the loader, tokenizer.json or not. The engine ends on all of them."""
    folder = copy_demo(demo, tmp_path / "m")
    edit_json(folder / "generation_config.json", eos_token_id=[3, 5])
    edit_json(folder / "config.json", eos_token_id=9)
    edit_json(folder / "tokenizer_config.json", eos_token={"content": "<think>", "special": True})
    tok = Tokenizer.from_dir(folder)
    think = tok.token_to_id("<think>")
    assert tok.eos_token_ids == frozenset({think})
    assert end_token_ids(folder) == {3, 5, 9}
    engine = Engine.load(folder, device="cpu", progress=False, kv_tokens=256)
    assert engine.eos_token_ids == frozenset({3, 5, 9, think})
    edit_json(folder / "generation_config.json", eos_token_id="x")
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        end_token_ids(folder)
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        Engine.load(folder, device="cpu", progress=False, kv_tokens=256)


def test_tokenizer_only_folder_works(demo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(demo / "tokenizer.json", folder)
    tok = Tokenizer.from_dir(folder)
    assert tok.decode(tok.encode("hi there")) == "hi there"
    assert tok.eos_token_ids == frozenset()
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_bos_added_once_when_the_model_wants_it(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    edit_json(folder / "tokenizer_config.json", bos_token="<|endoftext|>", add_bos_token=True)
    tok = Tokenizer.from_dir(folder)
    bos = tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=True) == [bos, *tok.encode("hi")]
    # A Llama-style post-processor that adds bos itself must not get a second one.
    raw = json.loads((folder / "tokenizer.json").read_text())
    processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    raw["post_processor"] = json.loads(processor.__getstate__())
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    tok = Tokenizer.from_dir(folder)
    assert tok.encode("hi", add_special_tokens=True) == [bos, *tok.encode("hi")]


def test_missing_declared_tokens_are_added_with_their_ids(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    decl = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    decl["1024"] = {"content": "<|extra|>", "special": True}
    edit_json(folder / "tokenizer_config.json", added_tokens_decoder=decl, image_token="<|img|>")
    tok = Tokenizer.from_dir(folder)
    assert tok.token_to_id("<|extra|>") == 1024 and 1024 in tok.special_token_ids
    # Model-specific tokens become template variables and real tokens, as in transformers.
    assert tok.special_tokens["image_token"] == "<|img|>"
    assert tok.encode("a<|img|>b")[1] == tok.token_to_id("<|img|>")
    assert tok.vocab_size == 1026


def test_chat_template_jinja_wins(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    tok = Tokenizer.from_dir(folder)
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected == "<user><assistant>"


def test_named_templates(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    templates = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    edit_json(folder / "tokenizer_config.json", chat_template=templates)
    tok = Tokenizer.from_dir(folder)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "D"
    assert tok.apply_chat_template(messages, tools=[]) == "T"
    assert tok.apply_chat_template(messages, template_name="default", tools=[]) == "D"
    with pytest.raises(ValueError, match="no chat template named 'rag'"):
        tok.apply_chat_template(messages, template_name="rag")


def test_bad_template_fails_when_used_not_at_load(demo: Path, tmp_path: Path) -> None:
    folder = copy_demo(demo, tmp_path / "m")
    edit_json(folder / "tokenizer_config.json", chat_template="{% if %}")
    tok = Tokenizer.from_dir(folder)  # still usable for plain text and token ids
    assert tok.decode(tok.encode("fine")) == "fine"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
