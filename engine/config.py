"""ModelSpec (what the checkpoint is) and EngineConfig (how we run it).

`ModelSpec` is parsed from an HF `config.json` by the architecture's own module (see
`engine/models/registry.py`); the fields shared by every family are read here once, so a model
file only states what is particular to it. Everything downstream (loader, KV pool, runner) reads
the spec, never the raw config dict.

EngineConfig lives in engine_config.py, with POLICIES, POPULAR_PINS and pins_fraction; they are
re-exported here, where callers import them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.engine.engine_config import (  # noqa: F401 - re-exported (see above)
    POLICIES,
    POPULAR_PINS,
    EngineConfig,
    pins_fraction,
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    # float64 runs only through the plain-torch kernels (CPU); tests use it where float noise
    # could flip a near-tied router choice between two runs of our own engine.
    "float64": torch.float64,
}


class ConfigError(ValueError):
    """The model's config.json is missing a field, holds a bad value, or asks for an
    unsupported feature. The message names the field."""


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(f"unsupported dtype {value!r}; use float32, float16 or bfloat16")
    return _DTYPES[key]


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """Rotary embedding settings, normalised from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (older configs)."""

    theta: float
    rope_type: str = "default"  # default | linear | yarn | llama3
    rotary_dim: int = 0  # dims that rotate (partial_rotary_factor * head_dim)
    params: tuple[tuple[str, Any], ...] = ()  # the scaling parameters, as given

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)


@dataclass(slots=True, frozen=True)
class LinearAttentionSpec:
    """The gated-DeltaNet layers of a hybrid model (qwen3_next, qwen3_5_moe): Hk key heads of
    Dk dims, Hv value heads of Dv dims (Hv a multiple of Hk), a depthwise causal conv of width
    `conv_kernel` over the concatenated q, k, v channels."""

    n_key_heads: int
    n_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_key_heads * self.key_head_dim + self.n_value_heads * self.value_head_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """Per sequence: the last K - 1 conv inputs of every channel."""
        return (self.conv_channels, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """Per sequence: the delta rule's matrix state of every value head (fp32)."""
        return (self.n_value_heads, self.key_head_dim, self.value_head_dim)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """The architecture, read from config.json. Layer indices are decoder-layer indices."""

    arch: str  # HF model_type, e.g. "qwen3_moe"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    n_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]  # decoder layers with a routed MoE block (others: dense MLP)
    intermediate_size: int = 0  # dense MLP width (layers outside moe_layers)
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    attention_bias: bool = False
    sliding_windows: tuple[int, ...] = ()  # per layer; 0 = full attention
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # family-specific settings (e.g. clip_qkv)
    # Hybrid models: per layer "full_attention" | "linear_attention"; empty = all full attention.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionSpec | None = None  # the recurrent layers' shapes (hybrids only)

    def __post_init__(self) -> None:
        # What every family reads the same way, checked once: a config with more experts a
        # token than a layer has loaded and then failed every request inside the router.
        if self.moe_layers and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(
                f"config.json routes each token to {self.top_k} experts of {self.n_experts} "
                "a layer: num_experts_per_tok must be from 1 to the number of experts"
            )

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.extra).get(name, default)

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def moe_index(self, layer: int) -> int:
        """Ordinal of a decoder layer among the MoE layers: the `layer` of `lid`."""
        return self.moe_layers.index(layer)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Decoder layers with (paged, KV-cached) attention; the KV pool holds one slice each,
        in this order."""
        if not self.layer_types:
            return tuple(range(self.n_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Decoder layers with a recurrent (linear-attention) mixer; the state pools hold one
        slice each, in this order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up, down) in the checkpoint dtype."""
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        return 3 * self.hidden_size * self.moe_intermediate_size * itemsize


def require(cfg: dict, *names: str) -> Any:
    """The first of `names` present in the config, or a ConfigError naming them."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise ConfigError(f"config.json lacks {' / '.join(repr(n) for n in names)}")


@dataclass(slots=True, frozen=True)
class ConfigDefaults:
    """What a family's transformers config class assumes for a field config.json leaves out.
    They differ by family (MixtralConfig.default_theta is 1e6, OlmoeConfig's rms_norm_eps 1e-5,
    Qwen3NextConfig's partial_rotary_factor 0.25), so each family module states all of them."""

    rope_theta: float
    rms_norm_eps: float
    # None: the family rotates the whole head (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE), and a
    # partial_rotary_factor other than 1 in config.json is refused: transformers' attention
    # for these families has no partial rotation (it fails on a shape, or reads the field in
    # one table and not the other), so no reading of it is the checkpoint's
    partial_rotary_factor: float | None
    head_dim: int | None = None  # None: hidden_size // num_attention_heads


# Per supported rope_type, the parameters its table reads (layers/rope.py): (required, optional).
# All are numbers: a missing one failed there as a bare TypeError, and a string could pass.
_ROPE_NUMBERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "yarn": (
        ("original_max_position_embeddings",),
        ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
}


def _check_number(value: Any, field: str, required: bool) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = "is missing" if value is None else f"must be a number, got {value!r}"
        raise ConfigError(f"config.json {field} {what}")


def rope_from_config(cfg: dict, head_dim: int, defaults: ConfigDefaults) -> RopeSpec:
    # transformers takes rope_scaling over rope_parameters when a config has both
    # (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict).
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    given = cfg.get(where) or {}
    if not isinstance(given, dict):
        raise ConfigError(f"config.json {where} must be an object, got {given!r}")
    params = dict(given)
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported for this family")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in _ROPE_NUMBERS:
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported (supported: default, linear, yarn, llama3)"
        )
    required, optional = _ROPE_NUMBERS[rope_type]
    for name in (*required, *optional, "rope_theta", "partial_rotary_factor"):
        # original_max_position_embeddings may come from outside the dict (below).
        needed = name in required and name != "original_max_position_embeddings"
        _check_number(params.get(name), f"{where}.{name}", needed)
    for name in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        _check_number(cfg.get(name), name, required=False)
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or defaults.rope_theta
    partial = (
        params.pop("partial_rotary_factor", None)
        or cfg.get("partial_rotary_factor")
        or defaults.partial_rotary_factor
    )
    if defaults.partial_rotary_factor is None:
        if partial is not None and float(partial) != 1.0:
            raise ConfigError(
                f"config.json partial_rotary_factor {partial}: {cfg.get('model_type')} models "
                "rotate the whole head (transformers has no partial rotation for them); remove "
                "the field or set it to 1.0"
            )
        partial = 1.0
    if rope_type in ("yarn", "llama3"):
        # transformers standardises the rope parameters again as it builds the table
        # (standardize_rope_params, called by _compute_yarn_parameters and
        # _compute_llama3_parameters): a top-level original_max_position_embeddings (Phi-3's
        # layout) replaces the one inside; without either, the model length stands in.
        orig = "original_max_position_embeddings"
        if cfg.get(orig) is not None:
            params[orig] = cfg[orig]
        else:
            params.setdefault(orig, cfg.get("max_position_embeddings"))
        _check_number(params[orig], f"{where}.{orig}", required=True)
    rotary_dim = int(head_dim * float(partial))
    return RopeSpec(float(theta), rope_type, rotary_dim, tuple(sorted(params.items())))


# Activations the MLPs and experts run (layers/mlp.py, the expert kernels): SwiGLU only.
SUPPORTED_ACTS = ("silu", "swish")


def eos_ids(value: object, where: str) -> tuple[int, ...]:
    """`eos_token_id` as configs write it: absent, an int or a list of ints (the one parser
    of config.json's and generation_config.json's, loading.end_token_ids)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise ConfigError(f"{where} must be an int or a list of ints, got {value!r}")
    return tuple(items)


def eos_ids_from_config(cfg: dict) -> tuple[int, ...]:
    return eos_ids(cfg.get("eos_token_id"), "config.json eos_token_id")


def base_spec_fields(cfg: dict, defaults: ConfigDefaults) -> dict[str, Any]:
    """Fields every family reads the same way (`defaults`: the family's for absent fields). A
    family module adds the rest."""
    # Every family's MLPs and experts apply hidden_act (transformers' ACT2FN); we run SiLU only,
    # so another activation is refused rather than computed wrongly.
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTS:
        raise ConfigError(
            f"config.json hidden_act {act!r} is not supported (supported: silu, swish)"
        )
    hidden = int(require(cfg, "hidden_size"))
    n_heads = int(require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or defaults.head_dim or hidden // n_heads)
    n_layers = int(require(cfg, "num_hidden_layers"))
    return dict(
        arch=str(require(cfg, "model_type")),
        vocab_size=int(require(cfg, "vocab_size")),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or defaults.rms_norm_eps),
        max_position_embeddings=int(require(cfg, "max_position_embeddings")),
        rope=rope_from_config(cfg, head_dim, defaults),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        eos_token_ids=eos_ids_from_config(cfg),
        bos_token_id=cfg.get("bos_token_id"),
    )


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a model folder")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    quant = cfg.get("quantization_config")
    if quant is not None:  # its weights need scales this engine does not apply
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ConfigError(
            f"{path}: a quantized checkpoint ({method}) is not supported; use the model's "
            "bf16 or fp16 weights"
        )
    _resolve_auto_dtype(cfg, Path(model_dir))
    return cfg


def _resolve_auto_dtype(cfg: dict, model_dir: Path) -> None:
    """A config.json that names no dtype, or "auto", loads as transformers' dtype="auto" does:
    in the dtype the weights are stored in (the float dtype holding most of their bytes). It
    ran in float32 here: a bf16 checkpoint took twice its memory. A multimodal config's
    text_config counts as naming one."""
    parts = [cfg] + ([cfg["text_config"]] if isinstance(cfg.get("text_config"), dict) else [])
    named = [c.get("dtype") or c.get("torch_dtype") for c in parts]
    declared = next((d for d in named if d not in (None, "auto")), None)
    if declared is not None and "auto" not in named:
        return
    resolved = declared or _stored_dtype(model_dir)
    if resolved is None:
        return  # no weights to read (a config alone): float32, as before
    for c in parts:
        for key in ("dtype", "torch_dtype"):
            if c.get(key) == "auto":
                c[key] = resolved
    if declared is None:
        cfg["dtype"] = resolved


def _stored_dtype(model_dir: Path) -> str | None:
    """The float dtype holding most bytes of the folder's safetensors files (headers only)."""
    from freetoken_agent.engine.weights import safetensors_stream
    from freetoken_agent.engine.weights.loader import CheckpointError, safetensors_files

    try:
        files = safetensors_files(model_dir)
    except CheckpointError:
        return None
    # (float64 left out: it runs only through the plain-torch kernels, so a float64 checkpoint
    # naming no dtype runs in float32, as before)
    stored = {k: v for k, v in safetensors_stream.FLOAT_DTYPES.items() if k != "F64"}
    sizes: dict[str, int] = {}
    for path in files:
        header, _ = safetensors_stream.read_header(path)
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in stored:
                begin, end = entry["data_offsets"]
                sizes[entry["dtype"]] = sizes.get(entry["dtype"], 0) + end - begin
    return stored[max(sizes, key=sizes.get)] if sizes else None
