"""A tiny Qwen3-MoE checkpoint with random weights, built locally for demos and tests.

Nothing may be downloaded, yet `freetoken demo` and the tests need a real checkpoint folder in
the exact form transformers' `save_pretrained` writes for `model_type: qwen3_moe` (config.json
with `num_local_experts` and `rope_parameters`, per-expert tensor names, a Qwen2-style
byte-level BPE tokenizer, a Qwen3-style chat template). This module writes one, without
importing transformers, from fixed seeds: the folder is the same bit for bit on every machine.

The folder is built once per `DEMO_VERSION` under `$FREETOKEN_CACHE` (default
`~/.cache/freetoken`), written to a temporary folder first and renamed into place, so a crash
never leaves half a model behind. Bump `DEMO_VERSION` whenever the recipe changes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    processors,
    trainers,
)
from tokenizers import pre_tokenizers as pre

from freetoken_agent.demo_text import CHAT_TEMPLATE, CORPUS

DEMO_VERSION = "2"  # 1: an early recipe with flat 0.02 weights
DEMO_NOTICE = (
    "The demo model has random weights (nothing is downloaded), so its text is gibberish; "
    "point FreeToken at a real checkpoint folder for real answers."
)
SEED = 20240601
# Standard deviations by tensor role. The usual 0.02 everywhere leaves the logits flat (std
# 0.16): greedy decoding repeats one token and top-2 gaps fall to 1e-4, close enough to ties
# that summation order could flip a token. These give logits of std ~1.6 and varied output.
WEIGHT_STD = {"embed": 1.0, "proj": 0.2, "router": 0.2, "head": 0.2}
NORM_JITTER = 0.1  # norm scales are 1 +- this, so they are not all equal

# (content, special): Qwen3 marks the chat-turn tokens special (skipped when decoding) and
# keeps the reasoning and tool markers as ordinary added tokens (visible to parsers).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
VOCAB_SIZE = 1024  # byte-level BPE vocabulary plus the added tokens
# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines, spaces. transformers rebuilds Qwen2Tokenizer with exactly this pipeline, so the
# tokenizer.json must use it too for both to tokenize alike.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
}
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)


def default_cache_root() -> Path:
    env = os.environ.get("FREETOKEN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "freetoken"


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The demo checkpoint folder `<cache>/demo-<version>`, built on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"demo-{DEMO_VERSION}"
    if all((target / name).is_file() for name in FILES):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{DEMO_VERSION}-", dir=root))
    try:
        build_demo_model(tmp)
        if all((target / name).is_file() for name in FILES):
            return target  # another process finished while we built
        if target.exists():
            # An incomplete folder (files deleted by hand): a build never leaves one, since
            # it appears by rename only.
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not all((target / name).is_file() for name in FILES):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_demo_model(out: Path) -> None:
    """Write every file of the checkpoint into the existing folder `out`."""
    tokenizer = build_tokenizer()
    ids = {content: tokenizer.token_to_id(content) for content, _ in ADDED_TOKENS}
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab != VOCAB_SIZE:  # the corpus ran out of merges: give it more text
        raise RuntimeError(f"demo tokenizer has {vocab} tokens, expected {VOCAB_SIZE}")
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    config = model_config(vocab, bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"])
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "transformers_version": "5.24.0",
        },
    )
    save_file(model_tensors(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(_readme(config), encoding="utf-8")


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on `CORPUS`; the same merges on every run."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=0,
        show_progress=False,
        # All 256 byte symbols, so any text (emoji, CJK) encodes without an unknown token.
        initial_alphabet=pre.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_tokens(
        [
            AddedToken(content, special=special, normalized=False)
            for content, special in ADDED_TOKENS
        ]
    )
    return tok


def tokenizer_config(ids: dict[str, int]) -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": SHAPE["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(vocab_size: int, bos: int, eos: int) -> dict:
    """config.json with the keys and order transformers 5 writes for qwen3_moe."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "decoder_sparse_step": 1,
        "dtype": "float32",
        "eos_token_id": eos,
        "head_dim": SHAPE["head_dim"],
        "hidden_act": "silu",
        "hidden_size": SHAPE["hidden_size"],
        "initializer_range": WEIGHT_STD["proj"],
        "intermediate_size": SHAPE["intermediate_size"],
        "max_position_embeddings": SHAPE["max_position_embeddings"],
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": SHAPE["moe_intermediate_size"],
        "norm_topk_prob": True,
        "num_attention_heads": SHAPE["num_attention_heads"],
        "num_experts_per_tok": SHAPE["num_experts_per_tok"],
        "num_hidden_layers": SHAPE["num_hidden_layers"],
        "num_key_value_heads": SHAPE["num_key_value_heads"],
        "num_local_experts": SHAPE["num_local_experts"],
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes, as Qwen3MoeForCausalLM.save_pretrained names them."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    f, v = config["moe_intermediate_size"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (config["num_local_experts"], h),
        }
        for e in range(config["num_local_experts"]):
            shapes |= {
                f"{p}.mlp.experts.{e}.gate_proj.weight": (f, h),
                f"{p}.mlp.experts.{e}.up_proj.weight": (f, h),
                f"{p}.mlp.experts.{e}.down_proj.weight": (h, f),
            }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return shapes


def model_tensors(config: dict) -> dict[str, torch.Tensor]:
    """fp32 weights, each drawn from its own generator seeded by its name, so adding a tensor
    never changes the others."""
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        gen = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + NORM_JITTER * noise
        else:
            tensors[name] = WEIGHT_STD[_role(name)] * noise
    return tensors


def _role(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed"
    if name == "lm_head.weight":
        return "head"
    return "router" if name.endswith(".mlp.gate.weight") else "proj"


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _readme(config: dict) -> str:
    return (
        "# FreeToken demo model (random weights)\n\n"
        "These weights are RANDOM. This model has never been trained: whatever it writes is "
        "gibberish. It exists so that `freetoken demo` and the tests can run the whole engine "
        "without downloading anything.\n\n"
        f"Architecture: Qwen3-MoE (`model_type: qwen3_moe`), {config['num_hidden_layers']} "
        f"layers, hidden {config['hidden_size']}, {config['num_local_experts']} experts "
        f"(top-{config['num_experts_per_tok']}), vocabulary {config['vocab_size']} "
        "(a byte-level BPE trained on a few KB of text).\n\n"
        f"Built by `freetoken_agent.demo_model`, version {DEMO_VERSION}; delete this folder to "
        "rebuild it.\n"
    )
