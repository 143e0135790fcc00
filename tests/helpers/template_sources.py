"""A tokenizer seen with other chat templates: what `engine_tool_format` reads to tell a model's
tool-call format, swapped without building another tokenizer."""

from __future__ import annotations

from typing import Any


class TemplateSources:
    """`tokenizer` in every respect but its `chat_template_sources`."""

    def __init__(self, tokenizer: Any, sources: dict[str, str]) -> None:
        self._tokenizer = tokenizer
        self.chat_template_sources = sources

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
