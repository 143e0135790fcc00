"""A reply on the terminal, for the `freetoken` commands that generate (cli.py): streamed to
stdout as it comes, Ctrl-C stopping it between tokens, its statistics on stderr; chat prompts
rendered as the server renders them; command-line text read as Unicode."""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator

from freetoken_agent.anchor_options import AnchorOptions
from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.engine.sampling_params import SamplingParams


@contextlib.contextmanager
def ctrl_c() -> Iterator[threading.Event]:
    """Ctrl-C sets the event instead of raising: the stream reads it between tokens and aborts
    the request there, where a KeyboardInterrupt inside a step would leave the engine half-way
    through it. A second Ctrl-C raises (a step that takes too long)."""
    pressed = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_reply(engine, prompt, sampling: SamplingParams, **options) -> tuple[str, dict]:
    """Print a completion as it streams; returns its text and statistics (finish
    "interrupted" when Ctrl-C stopped it). `options` go to the engine's submit (a chat's
    anchor_options)."""
    start = time.perf_counter()
    first, n, reason, error, parts = None, 0, None, None, []
    with ctrl_c() as pressed:
        # Asked before each step too: a long prompt's prefill, which yields no event, stops
        # after its running chunk (the stream then ends without a finished event).
        request = engine.stream(prompt, sampling, stop=pressed.is_set, **options)
        with contextlib.closing(request) as stream:
            for event in stream:
                if event.token_id is not None:
                    n += 1
                    first = first or time.perf_counter()
                print(event.text, end="", flush=True)
                parts.append(event.text)
                if event.finished:
                    reason, error = event.finish_reason, event.error
                elif pressed.is_set():
                    break  # closing the stream aborts the request
        if reason is None and pressed.is_set():
            reason = "interrupted"
    end = time.perf_counter()
    print()
    ttft = (first - start) if first else float("nan")
    rate = (n - 1) / (end - first) if first and n > 1 else float("nan")
    stats = {"tokens": n, "ttft_s": ttft, "decode_tok_s": rate, "finish": reason, "error": error}
    return "".join(parts), stats


def report(stats: dict, engine) -> None:
    s = engine.stats()["tokens"]
    rate = stats["decode_tok_s"]  # NaN with one token or none: no decode step to time
    decode = "no decode steps" if math.isnan(rate) else f"{rate:.1f} tok/s decode"
    first = stats["ttft_s"]
    first = "no token" if math.isnan(first) else f"first after {first * 1e3:.0f} ms"
    print(
        f"[freetoken] {stats['tokens']} tokens, {first}, {decode}, finish: {stats['finish']}; "
        f"prefilled {s['prefilled']} / reused {s['reused']} prompt tokens so far",
        file=sys.stderr,
    )


def chat_ids(fmt: ChatFormat, messages: list[dict]) -> list[int]:
    """The rendered chat as token ids, as the server and Session render it (ChatFormat): the
    template's own control tokens are control tokens, while text in a message that spells one
    (a pasted transcript's `<|im_end|>`) stays text; the template writes its bos itself."""
    return fmt.render(messages).token_ids


def chat_turn(
    fmt: ChatFormat, messages: list[dict], options: AnchorOptions
) -> tuple[list[int], dict]:
    """A chat turn's prompt ids (chat_ids') and the engine options that let the next turn reuse
    it (AnchorOptions: a hybrid model checkpoints at its anchors; without them a template that
    re-renders the last reply differently re-prefilled the whole history every turn)."""
    prompt = fmt.render(messages)
    return prompt.token_ids, options(prompt)


def as_text(arg: str) -> str:
    """A command-line or typed text as Unicode: bytes that were not UTF-8 (Python keeps them
    as lone surrogates) become U+FFFD, as a decoder replaces them, not a refusal mid-chat."""
    return arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def failed(stats: dict) -> int | None:
    """The exit code of a reply that failed (its error said on stderr), else None."""
    if stats["error"] is None and stats["finish"] != "error":
        return None
    print(f"freetoken: error: the request failed: {stats['error']}", file=sys.stderr)
    return 1
