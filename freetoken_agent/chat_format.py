"""ChatFormat: a structured history rendered into token ids, with semantic anchors.

    # C characters of the rendered text, T its tokens
    prompt = ChatFormat(tokenizer).render(messages, tools)    # Prompt(token_ids [T], text [C],
                                                              #        anchors sorted by offset)

An anchor is a token index where a semantic unit begins or ends: `turn_start` (each message),
`reasoning_start` / `reasoning_end` (the reasoning text of an assistant turn, markers such as
`<think>` outside it), `tool_call` (where each call's block starts, separator included),
`tool_output` (where a tool result's text starts) and `generation_prefix` (the end of the
history, just before what the template appends with add_generation_prompt, e.g.
`<|im_start|>assistant\\n<think>\\n`). The engine checkpoints recurrent state at anchors and a
Session resumes from the deepest anchor before the point where a new history diverges.

Anchors are found by rendering variants of the history, never by searching marker strings, so
they hold for any template; anchor_locator.py says how, and what it costs. A template that does
not render the tools, tool calls or tool results given is refused (InvalidRequestError) rather
than silently showing the model a history without them.

Control-token text inside messages and tool definitions (a tool result quoting "<|im_end|>") is
encoded as text, not as the control token: only the template makes them (literal_specials.py).

Tokens: the text is tokenized once, as a whole (what the model sees); character positions map to
tokens by the tokenizer's offsets. A position inside a token moves back to the start of that token
(`ids[:offset]` then lies entirely before the boundary: resuming there recomputes a little, never
skips a token that belongs to the unit). Boundaries of chat templates sit next to special tokens or
newlines in practice, where BPE splits anyway, so the prefix tokenizes the same alone or in the
whole; `Anchor.exact` says whether the token prefix ends exactly at the boundary.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.anchor_locator import AnchorLocator, common_prefix, key_bytes, unrendered
from freetoken_agent.continuation import continuation_end, continuation_probe
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.prompt_input import context_length_error
from freetoken_agent.engine.text.chat_template import ChatTemplate, ChatTemplateError, plain_data
from freetoken_agent.engine.text.tokenizer import Tokenizer, encode_text
from freetoken_agent.literal_specials import LiteralSpecials
from freetoken_agent.messages import Message, coerce_messages, to_template_messages
from freetoken_agent.parsers.reasoning import CLOSE, prompt_opens_reasoning
from freetoken_agent.template_call_ids import wants_mistral_ids, with_mistral_ids

ANCHOR_KINDS = (
    "turn_start",
    "reasoning_start",
    "reasoning_end",
    "tool_call",
    "tool_output",
    "generation_prefix",
)
_KIND_ORDER = {kind: i for i, kind in enumerate(ANCHOR_KINDS)}
# common_prefix lives with the locator; sessions and benches compare token lists with it.
__all__ = ["ANCHOR_KINDS", "Anchor", "ChatFormat", "Prompt", "common_prefix", "normalize_tools"]


@dataclass(slots=True, frozen=True)
class Anchor:
    """A semantic boundary of a Prompt: text position `char_offset`, token index `offset`.

    `token_ids[:offset]` holds the tokens lying wholly before the boundary. When `exact`, they
    decode to `text[:char_offset]`; otherwise token `offset` straddles the boundary (BPE merged
    across it) and the prefix stops short of it, at that token's start."""

    offset: int
    kind: str
    message_index: int  # into Prompt.messages; len(messages) for generation_prefix
    char_offset: int
    exact: bool = True


@dataclass(slots=True)
class Prompt:
    """A rendered history. Owned by whoever rendered it; a Session keeps the last one it sent,
    with the generated tokens appended. Invariant: anchors sorted by (offset, kind order), every
    offset in [0, len(token_ids)]."""

    token_ids: list[int]
    text: str
    anchors: list[Anchor] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    generation_prefix: str = ""  # what add_generation_prompt appended ("" when it was off)

    def __len__(self) -> int:
        return len(self.token_ids)

    def find(self, kind: str, message_index: int) -> Anchor | None:
        """The first anchor of this kind for that message (None if the template left it out)."""
        return next(
            (a for a in self.anchors if a.kind == kind and a.message_index == message_index), None
        )

    def anchors_of(self, message_index: int) -> list[Anchor]:
        return [a for a in self.anchors if a.message_index == message_index]

    def deepest_anchor(self, offset: int) -> Anchor | None:
        """The last anchor at or before token `offset` (ties: the later kind)."""
        best = None
        for anchor in self.anchors:
            if anchor.offset > offset:
                break
            best = anchor
        return best


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict] | None:
    """Tools as OpenAI JSON-schema dicts; a bare {"name", "parameters", ...} gets wrapped.
    Each must be a function with a non-empty name and, if given, an object of parameters:
    a template renders whatever it gets, so a malformed tool would reach the model as a
    prompt it was never meant to read rather than as an error."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of tools, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(
                f"tool {i} must be a dict (an OpenAI function tool), got {type(tool).__name__}"
                + ("; a LangChain tool converts with langchain_core.utils.function_calling."
                   "convert_to_openai_tool (ChatFreeToken.bind_tools takes it as it is)"
                   if hasattr(tool, "args_schema") else "")
            )  # fmt: skip
        if "type" not in tool and "name" in tool:
            tool = {"type": "function", "function": dict(tool)}
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise InvalidRequestError(
                f"tool {i} must be {{'type': 'function', 'function': {{'name': ...}}}} or "
                f"{{'name': ..., 'parameters': ...}}, got {tool!r:.80}"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tool {i}: its function needs a non-empty string name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise InvalidRequestError(
                f"tool {i} ({fn['name']}): parameters must be a JSON schema object, got "
                f"{fn['parameters']!r:.40}"
            )
        out.append(dict(tool))
    return out


class ChatFormat:
    """A tokenizer, a chat template and fixed template variables (`enable_thinking=False`...).

    The template is the tokenizer's (`template_name` picks a named one; by default "tool_use"
    when tools are given and the model has it) unless `chat_template` gives Jinja source, as
    transformers' `apply_chat_template(chat_template=...)` does."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        template_name: str | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> None:
        if tokenizer is None:
            raise InvalidRequestError(
                "this model folder has no tokenizer.json: a chat history cannot be rendered"
            )
        self.tokenizer = tokenizer
        self.template_name = template_name
        self.template_kwargs = template_kwargs
        self._override = (
            ChatTemplate(chat_template, tokenizer.special_tokens) if chat_template else None
        )
        self._literal = LiteralSpecials(tokenizer.backend)
        # What renders found, by message-prefix digest (least recently used evicted first).
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._probes: dict[tuple[bool, bool], str] = {}  # _generation_probe's renders

    def template(self, tools: list[dict] | None) -> ChatTemplate:
        if self._override is not None:
            return self._override
        if not self.tokenizer.chat_template_sources:  # a base model: a request's problem
            raise InvalidRequestError(
                "this model has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja), so a chat history cannot be rendered for it; "
                "send plain text instead (POST /v1/completions, `freetoken generate` without "
                "--chat)"
            )
        return self.tokenizer.get_chat_template(self.template_name, tools)

    def opens_reasoning(self, tools: Sequence[Mapping[str, Any]] | None = None) -> bool:
        """Whether this format's generation prompt leaves a think block open (Qwen3's thinking
        mode ends it with `<think>\n`): the output then starts inside reasoning. Read once
        from a probe history of one user message (the generation prompt does not depend on
        the history in the templates seen); a template that refuses the probe: False."""
        return prompt_opens_reasoning(self._generation_probe(tools))

    def reasons_first(self, tools: Sequence[Mapping[str, Any]] | None = None) -> bool:
        """Whether an answer under this format begins with reasoning: its generation prompt
        opens a think block (`opens_reasoning`), or the template is a hybrid one left in
        thinking mode, whose model opens the block itself. Qwen3's hybrid template is the
        known case: with `enable_thinking=False` its generation prompt closes an empty block
        (`<think>\n\n</think>\n\n`), otherwise it writes nothing and the model starts with
        `<think>\n`. So: this format's prompt neither opens nor closes a block, and the same
        template's with thinking off closes one. A template that never names a block (a
        model that does not think) reads False either way."""
        text = self._generation_probe(tools)
        if prompt_opens_reasoning(text):
            return True
        if _closes_reasoning(text):
            return False
        return _closes_reasoning(self._generation_probe(tools, thinking_off=True))

    def _generation_probe(
        self, tools: Sequence[Mapping[str, Any]] | None, thinking_off: bool = False
    ) -> str:
        """The rendered prompt of one user message, generation prompt included (cached by
        whether tools are shown and `thinking_off`); "" where the template refuses it."""
        key = (bool(tools), thinking_off)
        if key not in self._probes:
            probe, shown = [{"role": "user", "content": "?"}], normalize_tools(tools)
            extra = {"enable_thinking": False} if thinking_off else {}
            try:
                self._probes[key] = self.template(shown).render(
                    probe,
                    tools=shown,
                    add_generation_prompt=True,
                    **{**self.template_kwargs, **extra},
                )
            except ChatTemplateError:
                self._probes[key] = ""
        return self._probes[key]

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        max_model_len: int | None = None,
        anchors: bool = True,
        continue_final: bool = False,
        **kwargs: Any,
    ) -> Prompt:
        """The Prompt of `messages`; `kwargs` are template variables.

        `continue_final`: the final message, the assistant's, is left open after its text for
        the model to go on from (no generation prompt then; continuation.py says how the end
        of its text is found). Anchors inside what the cut leaves out are dropped.

        `anchors=False`: the tokens and text only (no anchors, no generation prefix), for a
        count (POST /tokenize, ChatFreeToken's token counts): locating anchors renders a
        history prefix per message, work a count does not need.

        `max_model_len` (the engine's context, prompt + output): a rendering of that many
        tokens or more is refused (ContextLengthError, the engine's wording) before anchors are
        located. Locating them renders a history prefix per message (anchor_locator.py), work
        that grows with the square of the history's length: an over-long history must not pay
        for it only to be refused by the engine afterwards."""
        records = coerce_messages(messages)
        if not records:
            raise InvalidRequestError("cannot render an empty history: give at least one message")
        tools = normalize_tools(tools)
        template = self.template(tools)
        # Plain data once (ChatTemplate.render_plain): the history and its variants are
        # rendered once a message or more to locate anchors.
        dicts = plain_data(to_template_messages(records))
        if wants_mistral_ids(template.source):  # its ids are 9 characters (template_call_ids)
            dicts = with_mistral_ids(dicts)
        if continue_final:  # rendered with a mark after the last text: cut there below
            dicts, add_generation_prompt = continuation_probe(dicts), False
        tools = plain_data(tools)
        variables = plain_data({**self.template_kwargs, **kwargs})  # `documents` among them

        def render(ds: list[dict], gen: bool, with_tools: bool = True) -> str:
            shown = tools if with_tools else None
            return template.render_plain(ds, shown, gen, **variables)

        try:
            full = render(dicts, add_generation_prompt)
        except ChatTemplateError as e:
            raise InvalidRequestError(f"the chat template rejected this history: {e}") from e
        cut = continuation_end(full) if continue_final else len(full)
        text = full[:cut]  # what the model sees; `full` is what anchors are located in
        encoding = encode_text(self.tokenizer.backend, text)
        ids, offsets = list(encoding.ids), list(encoding.offsets)  # [T]
        if max_model_len is not None and len(ids) >= max_model_len:
            # Refused before the marking below, which may render the history dozens of times:
            # marking only makes the encoding longer (an added token becomes its text's tokens).
            raise context_length_error(len(ids), max_model_len)
        if self._literal.held_by(dicts, tools):  # control-token text in them: encoded as text
            marked = lambda ds, ts: template.render_plain(  # noqa: E731
                ds, ts, add_generation_prompt, **variables
            )
            spans = [s for s in self._literal.spans(marked, dicts, tools, full) if s[1] <= cut]
            ids, offsets = self._literal.encode(text, ids, offsets, spans)
        if max_model_len is not None and len(ids) >= max_model_len:
            raise context_length_error(len(ids), max_model_len)
        if not anchors:
            return Prompt(ids, text, [], records)
        # Cache entries are valid for one template, tool list and set of variables. (A template
        # printing strftime_now() changes text without changing these; the stability check below
        # compares digests of real text, so it only costs cache misses there.)
        # Variables are keywords, whose order the template cannot see: sorted by name.
        salt = key_bytes([template.source, tools, sorted(variables.items())])
        locator = AnchorLocator(render, dicts, full, add_generation_prompt, self._cache, salt)
        if tools and not locator.tools_rendered():
            raise unrendered("tool definitions")
        marks, gen_text = locator.locate()  # raises when tool calls or results go unrendered
        ends = [end for _, end in offsets]  # [T] character end of each token
        starts = [start for start, _ in offsets]
        anchors = []
        for char, kind, index in marks:
            if char > cut:  # in what a continued message's cut left out
                continue
            tok = bisect.bisect_right(ends, char)  # tokens lying wholly before `char`
            next_start = starts[tok] if tok < len(starts) else len(text)
            if next_start < char and ids[tok] in self._literal.added_ids:
                # Added tokens (<|im_end|>, <tool_call>) are indivisible markers: a boundary
                # inside one only means two compared renderings continued with markers that
                # share leading characters ("<|im_end|>" vs "<tool_call>"). It is its start.
                char = next_start
            anchors.append(Anchor(tok, kind, index, char, exact=next_start >= char))
        anchors.sort(key=lambda a: (a.offset, a.char_offset, _KIND_ORDER[a.kind]))
        return Prompt(ids, text, anchors, records, gen_text)


def _closes_reasoning(prompt_text: str) -> bool:
    """Whether a rendered generation prompt ends with a closed think block (a hybrid template
    with thinking off: `<think>\n\n</think>\n\n`)."""
    return prompt_text.rstrip().endswith(CLOSE)
