"""Which special tokens stay in the decoded text: those the output parsers read as markers.

Output text is decoded with special tokens skipped, so that eos, `[INST]`, `<|im_end|>` and
the like never show up in an answer. But some tokenizers make a tool-call or reasoning tag a
special (control) token too: in Mistral v3 tokenizers (Mixtral-8x22B-Instruct) `[TOOL_CALLS]`
is one, in v11 also `[ARGS]` and `[CALL_ID]`. Skipped, the tag is gone and the call that
follows reads as plain content. So a special token whose text is exactly one of the parsers'
tags is kept; every other special token is still skipped.

Why the union of every format's tags, and not the tags of this model's format: the format is
decided by the agent layer (freetoken_agent/parsers/registry.py, from the chat template or the
model type), and the engine does not import the agent layer (DESIGN.md section 2: dependencies
point one way; tests/test_project.py enforces it). The union is as precise in practice: a
special token that *is* a tag's text exists only to be that tag, and keeping it gives the text
a non-special added token gives anyway (Qwen's `<tool_call>` and `<think>` are not special,
so nothing changes for them). A model whose parser does not know the tag sees it as literal
text, not a lost call. Deciding it here, where every request's OutputState is built, gives it
to every entry point (Session, OpenAI server, LangChain, MCP) without plumbing.
tests/freetoken_agent/test_output_markers.py checks that every parser tag is listed here.
"""

from __future__ import annotations

from typing import Protocol

# The tags of freetoken_agent/parsers: reasoning.py, hermes.py, qwen3_coder.py, mistral.py.
OUTPUT_MARKERS = frozenset(
    {
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
    }
)


class _Vocab(Protocol):
    special_token_ids: frozenset[int]

    def token_to_id(self, token: str) -> int | None: ...


def marker_ids(tokenizer: _Vocab | None) -> frozenset[int]:
    """The special token ids that decoding keeps: those whose text is a parser tag."""
    if tokenizer is None:
        return frozenset()
    ids = (tokenizer.token_to_id(m) for m in OUTPUT_MARKERS)
    return frozenset(i for i in ids if i is not None and i in tokenizer.special_token_ids)
