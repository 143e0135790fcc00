"""The demo checkpoint and its tokenizer, ours and transformers', shared by the text tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_tok(demo: Path):
    return transformers.AutoTokenizer.from_pretrained(demo)


@pytest.fixture(scope="module")
def ours(demo: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo)
