"""What a hybrid engine (recurrent layers beside attention) needs with a rendered chat to
checkpoint its recurrent state where the next turn will resume: the prompt's anchors and the
generated marker tokens. The Session passes them with every turn, and so must every caller
that renders a chat and submits it itself (the CLI's chat)."""

from __future__ import annotations

from typing import Any

from freetoken_agent.chat_format import Prompt

# Generated tokens before which a hybrid model's decoding checkpoints its recurrent state: the
# boundaries the next turn's rendering also marks (tool call, end of reasoning, end of turn).
DECODE_ANCHOR_MARKERS = ("<tool_call>", "</think>", "<|im_end|>")


def is_hybrid(engine: Any) -> bool:
    return bool(getattr(getattr(engine, "spec", None), "is_hybrid", False))


def decode_marker_ids(tokenizer: Any) -> list[int]:
    """The ids of DECODE_ANCHOR_MARKERS that the tokenizer has."""
    vocab = tokenizer.backend.get_vocab()
    return [vocab[m] for m in DECODE_ANCHOR_MARKERS if m in vocab]


def page_size(engine: Any) -> int | None:
    """The KV page size behind an Engine, an EngineService or a view of one."""
    while engine is not None:
        size = getattr(getattr(engine, "config", None), "page_size", None)
        if isinstance(size, int):
            return size
        engine = getattr(engine, "engine", None) or getattr(engine, "service", None)
    return None


def shared_prompt_anchors(length: int, page: int) -> list[int]:
    """Where a hybrid model's request checkpoints for the others sending the same prompt
    beside it (the choices of `n`): one token before the end, and at the last full page before
    that. A request computes its prompt's last token itself, so a checkpoint at the prompt's end
    never serves the others; and the prompt's full pages are cached as its prefill ends, its
    last partial page only when it finishes, so choices started beside it resume from the page
    boundary. (A checkpoint holds a whole recurrent state: a lone request takes none.)"""
    return sorted({b for b in ((length - 1) // page * page, length - 1) if b > 0})


class AnchorOptions:
    """The engine options of a rendered chat's turns, for one engine and tokenizer.

    For models with recurrent layers: the prompt's anchors (where the engine checkpoints the
    recurrent state while prefilling) and the marker tokens before which it checkpoints while
    decoding (a tool call, the end of reasoning, the end of the turn), so the next turn resumes
    close to where it diverges (a template that re-renders the last reply differently, as
    Qwen3.5's drops the generation prompt's `<think>`, diverges before the last prompt's end,
    where the only other checkpoint is). Other models reuse any cached prefix without them, so
    nothing is passed (duck-typed engines need not know the options). The marker ids are
    looked up once (the whole vocabulary is read for them)."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._marker_ids: list[int] | None = None

    def __call__(self, prompt: Prompt, shares_prompt: bool = False) -> dict[str, Any]:
        """`shares_prompt`: other requests send this prompt beside it (`n` choices): the
        template's anchors end in the prompt's partial last page, which those cannot use until
        this request ends, so it also checkpoints where they can (`shared_prompt_anchors`)."""
        if not is_hybrid(self.engine):
            return {}
        if self._marker_ids is None:
            self._marker_ids = decode_marker_ids(self.tokenizer)
        anchors = {a.offset for a in prompt.anchors}
        page = page_size(self.engine)
        if shares_prompt and page is not None:
            anchors.update(shared_prompt_anchors(len(prompt.token_ids), page))
        return {"anchors": sorted(anchors), "anchor_tokens": self._marker_ids}
