"""A JSON answer after the model's reasoning: the grammar of a think block, then the JSON.

A JSON-schema answer (response_format, ChatFreeToken's structured output) used to be held to
its schema from the first generated token, so a reasoning model could not think first: the
think block its template opened was closed in the prompt. Reasoning models answer better after
thinking, and vLLM and SGLang apply structured output only after the reasoning ends. So where
the answer begins with reasoning (below), the turn's constraint is this Lark grammar
(llguidance's syntax), not the bare schema:

    start: free <[</think>]> WS? %json {schema}
    free: TEXT? (<[other added tokens]> TEXT?)*
    TEXT: /(?s:.+)/ & ~/(?s:.*)<\\/think>(?s:.*)/
    WS: /[ \\t\\r\\n]{1,2}/

- reasoning is free text up to `</think>` (named by id, as strict_tools.py names a call's
  opener; TEXT can never spell it out of plain tokens), and may hold the model's other added
  tokens, but not its end-of-sequence ones (an end inside the reasoning would end the request
  with no answer at all) nor `<think>` (a block does not nest; the output parsers would read
  a second opener as reasoning text);
- stop strings and stop ids do not apply (`SamplingParams.grammar_holds_answer`), as under a
  bare schema: a stop met inside the JSON would cut it;
- the JSON follows the block's end and at most the two newlines the templates write there
  (more would let a weak model ramble in it, and the next turn's prompt, rendered with two,
  would part from the KV there), with the separators json.dumps
  writes (constrained.JSON_OPTIONS, as every schema here), and the request ends with it;
- the thinking budget (engine/thinking_budget.py) forces `\\n</think>\\n\\n`, which the grammar
  takes: a budget caps the reasoning before the answer (in the middle of a multi-byte
  character the grammar takes no newline: the close waits for the character to end).

Where the answer begins with reasoning (`ChatFormat.reasons_first`): the prompt opens the block,
or a hybrid template is in thinking mode and its model opens the block itself (Qwen3's hybrid
template writes no `<think>` in the prompt, and the model starts with `<think>\n`). There the
turn's prompt is given the `<think>\n` the model would have written (the server's
parser_factory, ChatFreeToken's OpenedReasoning), so the grammar always starts inside the
block. A grammar with the block optional would leave the choice to a model trained to think
first, and a model whose template has thinking off, or no thinking mode, answers JSON from the
first token as before. A tokenizer without `<think>` / `</think>` as added tokens gets None:
the bare schema.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from freetoken_agent.engine.constrained import JSON_OPTIONS
from freetoken_agent.integrations.strict_tools import call_marks, regex_literal
from freetoken_agent.parsers import engine_tool_format
from freetoken_agent.parsers.reasoning import CLOSE, added_think_ids


def answer_grammar(
    chat_format: Any,
    tools: Sequence[Mapping[str, Any]] | None,
    service: Any,
    schema: dict,
    call_block: bool = False,
) -> str | None:
    """The grammar for a JSON answer to `schema` where an answer under `chat_format`
    (rendering `tools`) begins with reasoning (ChatFormat.reasons_first), for the model behind
    `service` (an EngineService); None where it does not (the schema then holds from the first
    token). `call_block`: the JSON is a forced call's body, which a Hermes-format model writes
    inside its `<tool_call>\\n ... \\n</tool_call>` block (the grammar writes the block too,
    so the model's own parser reads the call). The server and ChatFreeToken both ask here."""
    if not chat_format.reasons_first(tools):
        return None
    ends = getattr(service.engine, "eos_token_ids", ())
    frame = ("", "")
    if call_block:
        opener, closer = call_marks(service.tokenizer)
        frame = (f'{opener} "\\n"', f'"\\n" {closer}')
    return reasoned_json_grammar(service.tokenizer, schema, ends, frame)


def writes_call_block(forced: bool, engine: Any) -> bool:
    """Whether a forced call after the reasoning is written inside the model's call block
    (`answer_grammar`'s `call_block`): for Hermes-format models, whose own parser then reads
    it; others write the JSON alone. One rule for the grammar and the parser that reads its
    output (JsonOrCallParser's `in_block`), the server's and ChatFreeToken's. `engine`: what
    engine_tool_format reads (an EngineService, the server's bridge)."""
    return forced and engine_tool_format(engine) == "hermes"


def bounded_reasoning(budget: int | None, service: Any) -> bool:
    """Whether a thinking budget bounds a request's reasoning: its own (`budget`) or the
    engine's default (EngineConfig.thinking_budget) for the model behind `service`. A forced
    call follows the reasoning only then: the caller forces a call because it needs one, and
    reasoning that runs to max_tokens would end the turn without it (a JSON answer takes that
    risk, as under vLLM's reasoning parsers: there the schema is what is asked for, not a call
    that must come)."""
    if budget is not None:
        return True
    config = getattr(getattr(service, "engine", None), "config", None)
    return getattr(config, "thinking_budget", None) is not None


def reasoned_json_grammar(
    tokenizer: Any,
    schema: dict[str, Any],
    end_ids: Collection[int] = (),
    frame: tuple[str, str] = ("", ""),
) -> str | None:
    """The grammar of reasoning, then JSON valid against `schema` (see the module docstring);
    `end_ids`: the model's end-of-sequence ids, left out of the reasoning; `frame`: Lark
    written right before and after the JSON (a call block's opener and closer). None when the
    tokenizer (the engine's: engine/text/tokenizer.py) has no think tokens of its own."""
    think = added_think_ids(tokenizer)
    if think is None:
        return None
    open_id, close_id = think
    added = sorted(tokenizer.backend.get_added_tokens_decoder())  # ids of the added tokens
    others = [i for i in added if i not in (open_id, close_id) and i not in end_ids]
    free = f"TEXT? (<[{','.join(map(str, others))}]> TEXT?)*" if others else "TEXT?"
    # The schema whole, its $defs with it: llguidance resolves its $refs (recursive ones too,
    # which inlining them would cut) and refuses one that points nowhere, as for a bare schema.
    answer = {**schema, "x-guidance": JSON_OPTIONS}
    start = [f"start: free <[{close_id}]> WS?", frame[0], "%json", json.dumps(answer), frame[1]]
    return "\n".join(
        [
            " ".join(part for part in start if part),
            f"free: {free}",
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){regex_literal(CLOSE)}(?s:.*)/",
            "WS: /[ \\t\\r\\n]{1,2}/",
        ]
    )
