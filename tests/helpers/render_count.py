"""A spy on chat template renders: a list that grows by one at each ChatTemplate.render_plain
(which ChatTemplate.render calls, and ChatFormat directly)."""

from __future__ import annotations

from freetoken_agent.engine.text.chat_template import ChatTemplate


def count_renders(monkeypatch) -> list[int]:
    """Counts the chat template renders from now on (undone with the monkeypatch)."""
    calls: list[int] = []
    real = ChatTemplate.render_plain

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render_plain", counting)
    return calls
