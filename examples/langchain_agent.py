"""A LangChain agent (`langchain.agents.create_agent`) on a local FreeToken engine.

    pip install -e ".[examples]"                             # once: langchain and the rest
    python examples/langchain_agent.py                       # the demo model (random weights)
    python examples/langchain_agent.py --model PATH --max-tokens 256 --question "..."

Two tools, a calculator and a word counter. A middleware forces the agent's first model call
to call one of them (`tool_choice="any"`: the call's JSON is constrained to the tools' schemas
by the grammar), so the loop model -> tool -> model runs even on the demo model, whose text is
gibberish; later calls are free ("auto") and may call tools or answer. A real checkpoint
(`--model`) picks its tools and answers on its own. The transcript is printed at the end, with
the tokens each model call reused from the engine's cache.
"""

from __future__ import annotations

import argparse
import ast
import operator
from collections.abc import Callable
from typing import Annotated

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import Field

from freetoken_agent.demo_model import DEMO_NOTICE
from freetoken_agent.integrations.langchain import ChatFreeToken

QUESTION = "How many words are in 'the quick brown fox', and what is 12 * (3 + 4)?"
SYSTEM = "You are a careful assistant. Use the tools for arithmetic and for counting words."
_OPS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    """Arithmetic only: numbers and + - * / **; anything else is refused (never eval())."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


# Bounded arguments keep a forced call short: its JSON then always closes within max_tokens,
# even when a weak model would ramble inside a string.
@tool
def calculator(expression: Annotated[str, Field(max_length=40)]) -> str:
    """Evaluate an arithmetic expression such as '12 * (3 + 4)'."""
    try:
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


@tool
def count_words(text: Annotated[str, Field(max_length=200)]) -> int:
    """Count the whitespace-separated words of a text."""
    return len(text.split())


@wrap_model_call
def force_first_tool_call(
    request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
) -> ModelResponse:
    """The first model call must call a tool; later ones choose freely."""
    if not any(isinstance(m, ToolMessage) for m in request.messages):
        request = request.override(tool_choice="any")
    return handler(request)


def format_transcript(messages: list[BaseMessage]) -> str:
    lines = []
    for msg in messages:
        if isinstance(msg, AIMessage):
            reasoning = msg.additional_kwargs.get("reasoning_content")
            if reasoning:
                lines.append(f"[assistant thinking] {reasoning!r}")
            if msg.content:
                lines.append(f"[assistant] {msg.content!r}")
            lines += [f"[tool call] {c['name']}({c['args']}) id={c['id']}" for c in msg.tool_calls]
            lines += [f"[invalid tool call] {c['error']}" for c in msg.invalid_tool_calls]
            usage = msg.usage_metadata or {}
            cached = usage.get("input_token_details", {}).get("cache_read", 0)
            lines.append(
                f"    (prompt {usage.get('input_tokens')} tokens, {cached} reused; "
                f"output {usage.get('output_tokens')})"
            )
        elif isinstance(msg, ToolMessage):
            lines.append(f"[tool result {msg.name}] {msg.content!r}")
        else:
            lines.append(f"[{msg.type}] {msg.content!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[BaseMessage]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=3, help="model calls at most")
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args(argv)
    if args.model is None:
        print(DEMO_NOTICE)
    llm = ChatFreeToken(
        model=args.model, device=args.device, temperature=0, max_tokens=args.max_tokens
    )
    agent = create_agent(
        llm, [calculator, count_words], system_prompt=SYSTEM, middleware=[force_first_tool_call]
    )
    # Each agent step is a model node and a tool node; the limit stops a model that keeps
    # calling tools (the demo model might) without an error.
    config = {"recursion_limit": 2 * args.max_steps}
    messages: list[BaseMessage] = []
    try:
        for update in agent.stream(
            {"messages": [("user", args.question)]}, config, stream_mode="values"
        ):
            messages = update["messages"]
    except Exception as e:  # GraphRecursionError: the step budget ran out
        if type(e).__name__ != "GraphRecursionError":
            raise
        print(f"(stopped after {args.max_steps} model calls)")
    print(format_transcript(messages))
    return messages


if __name__ == "__main__":
    main()
