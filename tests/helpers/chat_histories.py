"""Chat histories for the ChatFormat tests: a Qwen3-thinking-style template, tools, random
agent histories of unique texts, and the check that an anchor's token prefix decodes to the
text before it."""

from __future__ import annotations

import itertools
import random

from freetoken_agent.chat_format import Prompt
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
)

# A Qwen3-thinking-style template (the Qwen3 family's published structure, as in the
# Thinking-2507 / 3.5 checkpoints): reasoning of assistant turns before the last user query is
# dropped, turns after it always carry a think block, the generation prompt opens `<think>` when
# thinking is on, tool calls use the XML form, tool results are grouped in one user turn, and a
# history without a user query is refused. Model data used as a fixture.
QWEN3_THINKING = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content|trim + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool|tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function reply in this format:\n<tool_call>\n<function=name>\n' }}
    {{- '<parameter=key>\nvalue\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content|trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string %}
        {%- if not (message.content.startswith('<tool_response>')
                    and message.content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content|trim + '\n</think>\n\n' }}
            {{- content|trim }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content|trim }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {%- if loop.first and content|trim %}
                {{- '\n\n' }}
            {%- elif not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' + call.name + '>\n' }}
            {%- if call.arguments is mapping %}
                {%- for name, value in call.arguments|items %}
                    {{- '<parameter=' + name + '>\n' }}
                    {%- if value is string %}{{- value }}{%- else %}{{- value|tojson }}{%- endif %}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
    {"name": "calc", "description": "Evaluate.", "parameters": {"type": "object"}},  # bare form
]
# Words with multi-byte text, punctuation runs and JSON-looking bits. Texts begin and end with a
# letter so the templates' trim/strip leave them unchanged (the oracles compare them verbatim).
WORDS = ["alpha", "beta", "gamma", "delta", "café", "naïve", "你好", "🙂", "x,", "{a:", "1}", "!?"]


_serial = itertools.count()


def rand_text(rng: random.Random, max_words: int = 8) -> str:
    """Random words, unique per call (a serial number), so a text occurs once in a prompt."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, max_words))]
    return " ".join([f"start{next(_serial)}", *words, "end"])


def rand_history(rng: random.Random, reasoning: bool = True, end_with_user: bool = True) -> list:
    """A random agent history: optional system, user turns, tool rounds, reasoning."""
    history: list = [SystemMessage(rand_text(rng))] if rng.random() < 0.5 else []
    n_call = 0
    for _ in range(rng.randint(1, 4)):
        history.append(UserMessage(rand_text(rng)))
        for _ in range(rng.randint(0, 2)):
            calls = []
            for _ in range(rng.randint(1, 3)):
                args = {
                    f"p{i}": rng.choice([rand_text(rng, 2), rng.randint(-99, 999)])
                    for i in range(rng.randint(0, 2))
                }
                calls.append(ToolCall(f"call_{n_call}", rng.choice(["search", "calc"]), args))
                n_call += 1
            think = rand_text(rng) if reasoning and rng.random() < 0.7 else None
            content = rand_text(rng) if rng.random() < 0.6 else ""
            history.append(AssistantMessage(content, think, calls))
            history += [ToolResult(c.id, rand_text(rng), name=c.name) for c in calls]
        think = rand_text(rng) if reasoning and rng.random() < 0.7 else None
        history.append(AssistantMessage(rand_text(rng), think))
    if end_with_user:
        history.append(UserMessage(rand_text(rng)))
    return history


def check_token_prefix(tok: Tokenizer, prompt: Prompt) -> None:
    for a in prompt.anchors:
        head = tok.decode(prompt.token_ids[: a.offset], skip_special_tokens=False)
        if a.exact:
            assert head == prompt.text[: a.char_offset], a
        else:  # the straddling token begins before the boundary and ends after it
            assert prompt.text[: a.char_offset].startswith(head) and len(head) < a.char_offset
            more = tok.decode(prompt.token_ids[: a.offset + 1], skip_special_tokens=False)
            assert len(more) > a.char_offset, a
