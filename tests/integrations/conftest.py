"""Fixtures shared by the integration tests (tests/integrations/server has its own too)."""

from __future__ import annotations

import pytest
from scripted_engine import ScriptedEngine

from freetoken_agent.service import EngineService


@pytest.fixture
def scripted(engine):
    """A ScriptedEngine over the module's own `engine` fixture, behind an EngineService: the
    replies a test sets (`fake.replies`) come back token by token as the engine's would."""
    fake = ScriptedEngine(engine)
    service = EngineService(fake)
    yield fake, service
    service.close()
