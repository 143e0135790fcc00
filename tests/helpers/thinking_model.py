"""The demo model with a chat template whose generation prompt opens `<think>\\n` (Qwen3's
thinking-mode form; `enable_thinking=False` still closes the block), for the tests of what a
turn does when the template opens a think block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CLOSED = "{%- if enable_thinking is defined and enable_thinking is false %}\n{{- '<think>\\n\\n</think>\\n\\n' }}\n{%- endif %}"  # noqa: E501
OPENS = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"  # noqa: E501


def thinking_demo(demo: Path, folder: Path) -> Path:
    """A copy of the demo model folder `demo` at `folder`, its template opening the block."""
    shutil.copytree(demo, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert CLOSED in config["chat_template"], "the demo template changed: update this helper"
    config["chat_template"] = config["chat_template"].replace(CLOSED, OPENS)
    config_path.write_text(json.dumps(config))
    return folder


def check_close(tokens: list[str], budget: int, max_wait: int) -> int:
    """The index of the block's `</think>` in a reasoned answer's token strings, checked: the
    model's own close within its budget, or the forced one (`\\n</think>`) at the budget, or up
    to `max_wait` steps later (a multi-byte character the grammar would not break)."""
    assert "</think>" in tokens, tokens
    close = tokens.index("</think>")
    if close < budget:  # the model closed the block itself
        return close
    assert tokens[close - 1] == "\n" and budget <= close - 1 <= budget + max_wait, (budget, tokens)
    return close


def forced_close_at(tokens: list[int], forced: tuple[int, ...], budget: int, max_wait: int,
                    decode) -> int:  # fmt: skip
    """Where the forced close begins in a budgeted request's output `tokens`: at the budget,
    or later while the text ended inside a character (never past `max_wait` steps), checked
    with `decode` (ids -> text) on the output alone."""
    for start in range(budget, budget + max_wait + 1):
        if tuple(tokens[start : start + len(forced)]) == forced:
            break
    else:
        raise AssertionError(f"no forced close within {max_wait} steps of {budget}: {tokens}")
    if start > budget:  # it waited: the text at the budget ended inside a character
        assert decode(tokens[:budget]).endswith("\ufffd"), (budget, start, tokens)
    if start < budget + max_wait:  # and it stopped waiting when the character was whole
        assert not decode(tokens[:start]).endswith("\ufffd"), (budget, start, tokens)
    return start
