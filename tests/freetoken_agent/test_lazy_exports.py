"""`freetoken_agent.ChatFreeToken` is imported lazily; without the integrations extra it says
which install is missing instead of a bare ModuleNotFoundError from deep in the import."""

from __future__ import annotations

import sys

import pytest

import freetoken_agent


def test_a_missing_integration_package_names_the_install(monkeypatch):
    # Every import of it fails, as if not installed (submodules imported before by other tests
    # would be found in sys.modules without their package).
    for name in ["langchain_core", *[m for m in sys.modules if m.startswith("langchain_core.")]]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("freetoken_agent.integrations")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError, match=r"ChatFreeToken needs .*\[integrations\]"):
        freetoken_agent.ChatFreeToken  # noqa: B018


def test_chat_free_token_loads_when_installed():
    from freetoken_agent.integrations.langchain import ChatFreeToken

    assert freetoken_agent.ChatFreeToken is ChatFreeToken


def test_the_events_a_turn_yields_are_exported():
    """Session.send's events, named in the README, import from the package itself."""
    import freetoken_agent
    from freetoken_agent.parsers import events

    for name in ("ReasoningDelta", "ContentDelta", "ToolCallStart", "ToolCallArgsDelta",
                 "ToolCallEnd", "ParseWarning"):  # fmt: skip
        assert name in freetoken_agent.__all__
        assert getattr(freetoken_agent, name) is getattr(events, name)
