"""Talk to `freetoken serve` with the official `openai` client: a streamed answer, then a
streamed tool call, its result sent back, and the model's streamed reply to it.

    pip install -e ".[examples]"             # once: the server's packages and `openai`
    freetoken serve                          # another terminal; --model DIR for a real model
    python examples/openai_client.py         # --base-url URL --api-key KEY --model NAME

The base URL and key also come from FREETOKEN_BASE_URL and FREETOKEN_API_KEY. With the demo
model (random weights) the text is gibberish, but the tool call is still a valid call: it is
forced with `tool_choice`, which the server enforces by constrained decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from openai import APIConnectionError, OpenAI

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def get_weather(city: str, unit: str) -> dict[str, Any]:
    """Stands in for a real tool."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit}


def stream_answer(client: OpenAI, model: str, messages: list[dict], **options: Any) -> str:
    """Print a streamed reply (reasoning in brackets) and return its content."""
    content = []
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **options,
    )
    for chunk in stream:
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
            print(
                f"\n[usage: {chunk.usage.prompt_tokens} prompt tokens ({cached} cached), "
                f"{chunk.usage.completion_tokens} generated]"
            )
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning = getattr(delta, "reasoning_content", None)
        if reasoning:
            print(f"[{reasoning}]", end="", flush=True)
        if delta.content:
            content.append(delta.content)
            print(delta.content, end="", flush=True)
    return "".join(content)


def stream_tool_call(client: OpenAI, model: str, messages: list[dict]) -> dict[str, Any]:
    """Force a get_weather call and rebuild it from its streamed deltas (by `index`)."""
    calls: dict[int, dict[str, Any]] = {}
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        stream=True,
    )
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    if finish != "tool_calls" or not calls:
        raise RuntimeError(f"expected a tool call, got finish_reason={finish!r}")
    call = calls[min(calls)]
    print(f"tool call {call['id']}: {call['name']}({call['arguments']})")
    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("FREETOKEN_BASE_URL", "http://127.0.0.1:8000/v1")
    )
    parser.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY", "none"))
    parser.add_argument("--model", default=None, help="default: the one the server lists")
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    try:
        model = args.model or client.models.list().data[0].id
    except APIConnectionError:
        print(f"no server answers at {args.base_url}: start one with `freetoken serve` (or "
              "give its address with --base-url)", file=sys.stderr)  # fmt: skip
        return 1
    print(f"model: {model}")

    question = [{"role": "user", "content": "Say hello in five words."}]
    stream_answer(client, model, question, max_tokens=32, temperature=0.7)

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Lisbon?"}]
    call = stream_tool_call(client, model, messages)
    result = get_weather(**json.loads(call["arguments"]))
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
    ]
    stream_answer(client, model, messages, tools=[WEATHER_TOOL], max_tokens=32)
    return 0


if __name__ == "__main__":
    sys.exit(main())
