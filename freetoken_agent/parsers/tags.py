"""Tag matching on text that may end in the middle of a tag."""

from __future__ import annotations


def partial_tag_len(text: str, *tags: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`.

    That suffix must be held back: the next chunk may complete the tag. Anything shorter is
    released at once, so `<b>` never waits while `<to` does (it may become `<tool_call>`).
    """
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def find_first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Position and tag of the earliest occurrence of any of `tags` at or after `start`.

    Returns (-1, "") when none occurs. Ties cannot happen between distinct tags that do not
    prefix one another; when they do, the longer one wins.
    """
    best_pos, best_tag = -1, ""
    for tag in tags:
        pos = text.find(tag, start)
        if pos >= 0 and (
            best_pos < 0 or pos < best_pos or (pos == best_pos and len(tag) > len(best_tag))
        ):
            best_pos, best_tag = pos, tag
    return best_pos, best_tag
