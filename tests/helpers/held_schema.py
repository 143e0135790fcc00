"""The JSON schema a request's sampling holds its output to: its json_schema, or, after the
reasoning, the `%json` schema of its grammar (integrations/reasoned_json.py)."""

from __future__ import annotations

import json
from typing import Any

PREFIX = "%json "


def held_schema(sampling: Any) -> dict | None:
    """`sampling.json_schema`, else the schema inside a reasoned grammar (its `x-guidance`
    formatting options left out), else None."""
    if sampling.json_schema is not None:
        return sampling.json_schema
    if sampling.grammar is None or not sampling.grammar_holds_answer:
        return None
    start = sampling.grammar.splitlines()[0]
    schema = json.loads(start[start.index(PREFIX) + len(PREFIX) :])
    schema.pop("x-guidance", None)
    return schema
