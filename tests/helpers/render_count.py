"""A spy on chat template renders: a list that grows by one at each ChatTemplate.render."""

from __future__ import annotations

from freetoken_agent.engine.text.chat_template import ChatTemplate


def count_renders(monkeypatch) -> list[int]:
    """Counts the chat template renders from now on (undone with the monkeypatch)."""
    calls: list[int] = []
    real = ChatTemplate.render

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", counting)
    return calls
