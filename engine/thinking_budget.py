"""The thinking budget: a request's reasoning ends after at most N tokens (vLLM's
`thinking_token_budget`, llama.cpp's `--reasoning-budget`, Anthropic's `budget_tokens`).

Reasoning models (Qwen3, QwQ, DeepSeek-R1) write `<think> ... </think>` before the answer, and
may think for thousands of tokens: on a laptop that is minutes before the first word of the
answer, and a max_tokens spent on thinking leaves an empty reply. With
`SamplingParams.thinking_token_budget = N`, once N tokens were sampled inside the block the
engine forces the tokens of `"\\n</think>\\n\\n"` one by one (every other logit -inf), the form
the chat templates write the block's end in, and the model then answers as after a block it
closed itself (the output parsers read it the same way).

Per request, on the host, a state machine over its tokens (`BudgetState`):
- counting: the block is open. From the first output token when the prompt left it open
  (the template's `<think>\\n` generation prompt: the last `<think>` of the prompt comes after
  its last `</think>`); from the token after a `<think>` the model writes as its first token
  (the output parsers read a block only there, so a later `<think>` is content and starts
  nothing);
- forcing: N tokens counted; the forced tokens go out in order, one a step;
- done: the model closed the block itself (`</think>` sampled while counting), the forced
  tokens are out, or the first output token opened no block.
A budget of 0 forces the close as the first token: the model answers without thinking.

Where it runs: logits_processors.apply_processors, after the penalties and min_tokens and
before the constraint mask. It reads the request's accepted output ids, which hold every token
sampled before this one: a step samples only after the previous step's tokens were accepted,
overlap scheduling included (overlap.py: launch N, accept N-1, sample N), the same order the
grammars' masks rely on. A grammar wins, as it does over min_tokens: forcing a token its mask
does not allow would leave the row no token, or break the grammar. Before the first forced
token the close waits, a step at a time (at most MAX_WAIT), for the grammar to allow it: a
grammar over text (integrations/reasoned_json.py) allows no newline in the middle of a
multi-byte character, whose bytes come in several tokens; after that, or once the close has
begun, a refusal drops the budget (a grammar that never allows the close).

The close does not split a character either: while the output ends inside one (its bytes come
in several tokens; `Request.mid_character`, which the detokenizer tells at each accept), the
close waits a step, as llama.cpp's budget waits for UTF-8 to complete (at most MAX_WAIT steps
in all, shared with a grammar's waits).

Cost: host work only, O(1) a step per budgeted row (each output token is looked at once);
two launches a forced token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from freetoken_agent.engine.request import Request

OPEN = "<think>"
CLOSE = "</think>"
FORCED_TEXT = "\n" + CLOSE + "\n\n"  # as the chat templates end a think block

FIRST, COUNTING, FORCING, DONE = "first", "counting", "forcing", "done"
# Steps the close may wait for a grammar to allow it: a character's last bytes, which may
# run into the next character's (byte-fallback text: a rare script, a random model's output).
MAX_WAIT = 16


class _Vocab(Protocol):
    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class ThinkingMarkers:
    """A model's think-block tokens, and what a budget forces."""

    open_id: int
    close_id: int
    forced: tuple[int, ...]  # FORCED_TEXT's ids, close_id among them


def thinking_markers(tokenizer: _Vocab | None) -> ThinkingMarkers | None:
    """The markers, or None when the vocabulary has no `<think>` and `</think>` tokens (the
    model does not think in blocks; a budget is refused for it)."""
    if tokenizer is None:
        return None
    open_id, close_id = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
    if open_id is None or close_id is None:
        return None
    forced = tuple(tokenizer.encode(FORCED_TEXT, add_special_tokens=False))
    if close_id not in forced:  # the tag did not encode as its own token
        return None
    return ThinkingMarkers(open_id, close_id, forced)


@dataclass(slots=True)
class BudgetState:
    """One request's place in the state machine (see the module docstring)."""

    state: str
    start: int = 0  # output index of the first counted token
    seen: int = 0  # output tokens looked at for a close
    forced_from: int = 0  # output index of the first forced token
    waited: int = 0  # steps the close waited (for a character to end, a grammar to allow it)

    def refused(self, n: int) -> None:
        """The row's grammar does not allow this step's forced token (`n`: the output's
        length): the close waits a step if it has not begun and may wait longer, else the
        budget is dropped."""
        if self.forced_from == n and self.waited < MAX_WAIT:
            self.forced_from, self.waited = n + 1, self.waited + 1
        else:
            self.state = DONE


def prompt_opens(prompt: list[int], markers: ThinkingMarkers) -> bool:
    """Whether `prompt` leaves a think block open: its last `<think>` comes after its last
    `</think>` (the template's `<think>\\n` generation prompt)."""
    return _last_index(prompt, markers.open_id) > _last_index(prompt, markers.close_id)


def budget_state(req: Request, markers: ThinkingMarkers) -> BudgetState:
    """The state of a request about to sample its first token (its prompt read once)."""
    return BudgetState(COUNTING if prompt_opens(req.prompt_ids, markers) else FIRST)


def forced_token(req: Request, state: BudgetState, markers: ThinkingMarkers) -> int | None:
    """The token this step must sample for `req`'s budget, or None (advances `state`)."""
    out = req.output_ids
    n = len(out)
    if state.state == FIRST:  # the block may open only with the first output token
        if n == 0:
            return None
        if out[0] != markers.open_id:
            state.state = DONE
            return None
        state.state, state.start = COUNTING, 1
    if state.state == COUNTING:
        # The tokens since the last look: one a step (a row samples one token a step).
        if markers.close_id in out[max(state.seen, state.start) :]:
            state.state = DONE
            return None
        state.seen = n
        if n - state.start < req.sampling.thinking_token_budget:
            return None
        state.state, state.forced_from = FORCING, n
    if state.state == FORCING:
        j = n - state.forced_from
        if j == 0 and markers.close_id in out[state.seen :]:  # closed by the model meanwhile
            state.state = DONE
            return None
        state.seen = max(state.seen, n)
        if j == 0 and req.mid_character and state.waited < MAX_WAIT:
            state.forced_from, state.waited = n + 1, state.waited + 1  # the character first
            return None
        if j < len(markers.forced):
            return markers.forced[j]
        state.state = DONE
    return None


def reasoning_tokens(prompt: list[int], output: list[int], markers: ThinkingMarkers) -> int:
    """How many of `output`'s tokens are its think block, the tags included (OpenAI's
    `reasoning_tokens`), by the budget's rule of where a block starts: open at the output's
    start when the prompt left it open, or opened by the first output token; up to and with
    its `</think>`, or all of the output when it never closed. 0 when no block opened."""
    if prompt_opens(prompt, markers):
        start = 0
    elif output and output[0] == markers.open_id:
        start = 1
    else:
        return 0
    try:
        return output.index(markers.close_id, start) + 1
    except ValueError:
        return len(output)


def _last_index(ids: list[int], token: int) -> int:
    """The index of the last `token` in `ids`, -1 if none (a scan from the end, which the
    generation prompt's open tag is near)."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
