"""Reading an Anthropic Messages stream as its SDKs do, checking its order on the way.

`named_events` splits an SSE body into (event name, data); `reassemble` folds the events into
the message they describe (message_start's message, each block filled by its deltas, the tool
input from its JSON pieces, message_delta's stop reason and usage) and asserts the order a
client relies on: one message_start first, blocks numbered 0, 1, 2... as they open, deltas
only to the open block, each block stopped before the next starts, the data's `type` equal to
the event's name, message_stop last.
"""

from __future__ import annotations

import copy
import json
from typing import Any

_DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking"}


def named_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for chunk in body.split("\n\n"):
        if not chunk.strip():
            continue
        lines = chunk.split("\n")
        assert len(lines) == 2, f"not an event and its data: {chunk!r}"
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        events.append((lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])))
    return events


def reassemble(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    assert events and events[0][0] == "message_start", events[:1]
    for name, data in events:
        assert data["type"] == name, (name, data)
    message = copy.deepcopy(events[0][1]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    open_index: int | None = None
    partial: dict[int, str] = {}
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None, f"block {open_index} still open at {data}"
            assert data["index"] == len(message["content"]), data
            message["content"].append(copy.deepcopy(data["content_block"]))
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index, (open_index, data)
            block, delta = message["content"][open_index], data["delta"]
            if delta["type"] == "input_json_delta":
                assert block["type"] == "tool_use", block
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
            else:
                field = _DELTA_FIELDS[delta["type"]]
                assert field == block["type"], (block, delta)
                block[field] += delta[field]
        elif name == "content_block_stop":
            assert data["index"] == open_index, (open_index, data)
            if open_index in partial:
                message["content"][open_index]["input"] = json.loads(partial[open_index])
            open_index = None
        else:
            raise AssertionError(f"unexpected event {name}: {data}")
    assert open_index is None, f"block {open_index} never stopped"
    (delta_name, delta), (stop_name, _) = events[-2], events[-1]
    assert (delta_name, stop_name) == ("message_delta", "message_stop"), events[-2:]
    message.update(delta["delta"])
    message["usage"].update(delta["usage"])
    return message
