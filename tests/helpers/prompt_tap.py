"""The prompts an EngineService is sent: every way in (the server's routes, ChatFreeToken)
submits through `EngineService.submit`, so comparing what each way sent is comparing the
prompts the engine ran."""

from __future__ import annotations

from typing import Any

import pytest


def tap_prompts(service: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """A list that gets each prompt `service` is submitted from now on, in order."""
    prompts: list[list[int]] = []
    submit = service.submit

    def tapped(prompt, sampling, sink, **options):
        prompts.append(list(prompt))
        return submit(prompt, sampling, sink, **options)

    monkeypatch.setattr(service, "submit", tapped)
    return prompts
