"""model_type -> the module that defines that family. A new architecture is a new file plus
one row here."""

from __future__ import annotations

from types import ModuleType

from freetoken_agent.engine.config import ConfigError, ModelSpec
from freetoken_agent.engine.models import (
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)

ARCHITECTURES: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
    "olmoe": olmoe,
    "qwen3_next": qwen3_next,
    "qwen3_5_moe": qwen3_5_moe,  # multimodal repos: the text model of text_config
    "qwen3_5_moe_text": qwen3_5_moe,
}


def family(model_type: str) -> ModuleType:
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"unknown architecture {model_type!r} (config.json model_type); "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def spec_from_config(cfg: dict) -> ModelSpec:
    return family(str(cfg.get("model_type"))).spec_from_config(cfg)
