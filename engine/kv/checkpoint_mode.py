"""Where a hybrid model's recurrent state is checkpointed, so later requests can resume there.

Attention layers can reuse any prefix of cached KV, but a recurrent layer's state exists only
at the boundaries where it was copied out. Three ways to choose those boundaries:

- `anchors`: the semantic boundaries of the rendered history (turn starts, reasoning start and
  end, tool calls, tool outputs, the generation prefix) that the Session passes with each
  request, plus the end of every prompt. An edited history diverges at a message boundary or
  inside a message, so the deepest anchor before the divergence is close to it.
- `positional:N`: every N tokens (llama.cpp's context checkpoints), blind to structure: an edit
  re-prefills from the last multiple of N before it.
- `none`: no checkpoints; a hybrid model re-prefills every request from the start (what engines
  without recurrent-state reuse do). Pure-attention models are unaffected by the mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CheckpointMode:
    kind: str  # anchors | positional | none
    interval: int = 0  # positional only

    @staticmethod
    def parse(text: str) -> CheckpointMode:
        kind, _, arg = str(text).partition(":")
        if kind in ("anchors", "none") and not arg:
            return CheckpointMode(kind)
        if kind == "positional":
            try:
                n = int(arg)
            except ValueError:
                n = 0
            if n > 0:
                return CheckpointMode(kind, n)
        raise ValueError(
            f"checkpoints={text!r}: use 'anchors', 'positional:N' (N > 0 tokens) or 'none'"
        )

    @property
    def reuses(self) -> bool:
        return self.kind != "none"

    def prompt_boundaries(self, n_prompt: int, anchors: Iterable[int]) -> list[int]:
        """Boundaries in (0, n_prompt] at which prefilling this prompt takes a checkpoint
        (boundary b: the state after tokens [0, b))."""
        if self.kind == "anchors":
            picked = {int(a) for a in anchors if 0 < int(a) <= n_prompt}
            picked.add(n_prompt)
            return sorted(picked)
        if self.kind == "positional":
            return list(range(self.interval, n_prompt + 1, self.interval))
        return []

    def at_decode(self, boundary: int, token: int, anchor_tokens: frozenset[int]) -> bool:
        """Whether decoding takes a checkpoint at `boundary`, just before generated `token`."""
        if self.kind == "anchors":
            return token in anchor_tokens
        if self.kind == "positional":
            return boundary % self.interval == 0
        return False
