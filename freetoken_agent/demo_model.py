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

# A few KB of English and code to train the demo tokenizer on. Any text works; this mixes
# prose, Python, JSON and shell so common words and code idioms get their own tokens.
CORPUS = """\
FreeToken serves mixture-of-experts language models on the machines people already own.
The experts live in host memory and the GPU keeps a cache of the ones used most often.
When a request arrives, the scheduler decides which tokens run in the next step, the runner
executes the layers, and the engine streams the new tokens back to the caller.
A prompt is split into turns: the system message, the user question, the assistant answer,
its reasoning, the tool calls it makes and the results those tools return.
Each boundary is an anchor, so an edited history only needs to be computed again from the
deepest anchor that did not change. This saves time on long agent sessions.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
It was the best of times, it was the worst of times; it was the age of wisdom.
Please summarize the following document in three sentences, then list the open questions.
What is the weather like in Paris today? It is sunny, with a high of 21 degrees.
Thank you! Could you also check the train times from London to Edinburgh tomorrow morning?
I will search the web for that and report back with the results in a short table.
The answer is 42, because six times seven is forty-two and the numbers add up.
Memory bandwidth limits decoding: every token reads the weights of the active experts once.
Prefill is different, since a long chunk touches nearly every expert of every layer.
def route(hidden, gate, top_k=2):
    logits = hidden @ gate.T
    weights, experts = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class ExpertCache:
    \"\"\"Keeps the most recently used experts on the device.\"\"\"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: dict[int, int] = {}

    def lookup(self, layer: int, expert: int) -> int | None:
        return self.slots.get(layer * 128 + expert)


for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

import json
import os
from pathlib import Path

data = json.loads(Path("config.json").read_text())
print(data["hidden_size"], data.get("num_experts", 0), os.getcwd())
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "train times London Edinburgh", "limit": 5}}
{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
 "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
 "required": ["path"]}}}
$ pip install freetoken-agent && freetoken demo --max-tokens 64
$ git status && git diff --stat && python -m pytest tests -q
# Notes
- Use `torch.no_grad()` when running inference.
- Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718 1e-6 0x1f 255.
- Punctuation: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? : ; , . ' " ` @ # $ _ \\\\
Hello, world! Bonjour le monde. Hola mundo. Hallo Welt. Ciao mondo.
The model thinks step by step before it answers, then calls a tool if it needs more facts.
Errors must name the problem clearly: a missing file, a bad argument, an unknown tool.
Tests draw fresh random inputs on every run and print the seed, so failures can be replayed.
The server binds to localhost by default and speaks the OpenAI chat completions protocol.
Streaming sends each text delta as soon as it is complete, never half of a character.
"""

# A Qwen3-style ChatML template: tools listed as JSON inside <tools></tools> in the system
# turn, assistant tool calls as <tool_call>{json}</tool_call>, tool results as user turns of
# <tool_response> blocks, reasoning inside <think></think> for turns after the last user query,
# and `enable_thinking=false` closing an empty think block in the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and message.content is string
    and not (message.content.startswith('<tool_response>')
             and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
{{- content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif not (message.role == 'system' and loop.first) %}
{{- raise_exception('unknown message role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


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
