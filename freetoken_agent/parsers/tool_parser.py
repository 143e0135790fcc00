"""The content side shared by every tool-call format: text in, calls cut out.

A format is an opening tag plus a reader for what follows it. This class finds the tags in the
content stream (holding back a partial tag only while it can still become one), hands the text
after a tag to a fresh reader until the reader says the call block is over, and takes the rest
back as content. Readers live in the per-format files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

from freetoken_agent.parsers.events import ContentDelta, Event, new_call_id
from freetoken_agent.parsers.tags import partial_tag_len


class CallNumbering:
    """Hands out the stable (index, id) of each call of one output, in order; ids from
    `make_id` (a format's templates may want their own kind: Mistral's)."""

    __slots__ = ("count", "make_id")

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        self.count = 0
        self.make_id = make_id

    def next(self) -> tuple[int, str]:
        index = self.count
        self.count += 1
        return index, self.make_id()


class CallReader(Protocol):
    """Reads one call block, from just after its opening tag."""

    completed: bool  # the block ended and held only well-formed calls

    def feed(self, text: str, out: list[Event]) -> str | None:
        """Consume text; return the text after the block once it has ended, else None."""
        ...

    def finish(self, out: list[Event]) -> None:
        """The output ended inside the block: re-emit it as content with a ParseWarning."""
        ...


class ToolCallParser:
    """Streams content text and the tool calls embedded in it (one format per subclass).

    Whitespace alone between or after well-formed call blocks is dropped: chat templates put
    newlines there themselves and render them again from the structured calls, so it is not
    answer text. Any other text there, and all text before the first call, stays as it is.
    """

    open_tag: ClassVar[str]
    make_call_id: ClassVar[Callable[[], str]] = staticmethod(new_call_id)

    def __init__(self) -> None:
        self._text = ""  # content not yet released (a partial tag, or template whitespace)
        self._reader: CallReader | None = None
        self._after_call = False
        self._numbering = CallNumbering(self.make_call_id)
        self._finished = False
        self._line_start = True  # the text held starts a line (the output's or after a newline)

    def _new_reader(self, tag: str) -> CallReader:
        """A reader for the block `tag` opened (a format may have more than one opener)."""
        raise NotImplementedError

    def _opening(self, buf: str) -> tuple[int, str] | None:
        """(position, tag) of the first call opener in `buf`, the content held; None if
        none came yet."""
        i = buf.find(self.open_tag)
        return (i, self.open_tag) if i >= 0 else None

    def _held(self, buf: str) -> int:
        """How many characters at the end of `buf` may still become an opener."""
        return partial_tag_len(buf, self.open_tag)

    def feed(self, text: str) -> list[Event]:
        """Consume the next piece of content text; return the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out: list[Event] = []
        pending: str | None = text
        while pending is not None:
            if self._reader is not None:
                pending = self._reader.feed(pending, out)
                if pending is not None:
                    self._after_call = self._reader.completed
                    self._reader = None
            else:
                self._text += pending
                opened = self._scan_text(out)
                pending = None
                if opened is not None:
                    tag, pending = opened
                    self._reader = self._new_reader(tag)
                    self._line_start = True  # what follows a block starts afresh
        return out

    def finish(self) -> list[Event]:
        """The output ended: release held text; an open call block becomes content."""
        out: list[Event] = []
        if not self._finished:
            self._finished = True
            if self._reader is not None:
                self._reader.finish(out)
                self._reader = None
            elif self._text and not (self._after_call and self._text.isspace()):
                out.append(ContentDelta(self._text))
            self._text = ""
        return out

    def _scan_text(self, out: list[Event]) -> tuple[str, str] | None:
        """Release content up to an opener; return (the opener, the text after it), if one
        came."""
        buf = self._text
        found = self._opening(buf)
        if found is not None:
            i, tag = found
            before = buf[:i]
            if before and not (self._after_call and before.isspace()):
                out.append(ContentDelta(before))
            self._text = ""
            return tag, buf[i + len(tag) :]
        cut = len(buf) - self._held(buf)
        if self._after_call and (not buf[:cut] or buf[:cut].isspace()):
            return None  # maybe template whitespace before the next call: hold it
        if cut:
            out.append(ContentDelta(buf[:cut]))
            self._after_call = False
            self._line_start = buf[cut - 1] == "\n"
        self._text = buf[cut:]
        return None
