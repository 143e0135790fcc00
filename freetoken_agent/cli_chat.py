"""`freetoken chat`'s loop: a history kept across turns (its KV reused), slash commands, and
the turns that fail or overflow the context left out so the chat goes on."""

from __future__ import annotations

import contextlib
import io
import re
import sys

from freetoken_agent.anchor_options import AnchorOptions
from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.cli_reply import as_text, chat_turn, failed, report, stream_reply
from freetoken_agent.engine.outputs import ContextLengthError
from freetoken_agent.engine.sampling_params import SamplingParams

# A line that is one "/word" (no space, no second slash: not a path) is a command.
_COMMAND = re.compile(r"/[A-Za-z?]+")
CHAT_COMMANDS = (
    "commands: /reset clears the history (the system prompt stays), /exit (/quit, /bye or "
    "Ctrl-D) leaves, /help (/?) shows this; Ctrl-C stops a reply. A message that starts "
    "with a slash: type it twice (//etc is sent as /etc)."
)


def chat_loop(engine, sampling: SamplingParams, system_prompt: str | None) -> int:
    """Reads lines until /exit or end of input; returns the exit status (0)."""
    fmt = ChatFormat(engine.tokenizer)
    anchors = AnchorOptions(engine, fmt.tokenizer)  # (a hybrid model's checkpoints)
    # A typed line's bytes that are not UTF-8 reach as_text as lone surrogates, whatever the
    # locale (a strict one raised UnicodeDecodeError in input(), ending the chat).
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")
    # Line editing and history at `you> `; without readline a terminal in cooked mode also
    # cut a pasted line at 4095 bytes, silently.
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401
    system = as_text(system_prompt) if system_prompt else None
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    print("[freetoken] chat: /help lists the commands, /exit or Ctrl-D leaves", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if command in ("/exit", "/quit", "/bye"):
            return 0
        if command == "/reset":
            history = history[:1] if system_prompt else []
            continue
        if command in ("/help", "/?"):
            print(CHAT_COMMANDS, file=sys.stderr)
            continue
        if _COMMAND.fullmatch(command):  # a typo of a command: not sent to the model
            print(f"freetoken: unknown command {command}; /help lists them", file=sys.stderr)
            continue
        if command.startswith("//"):  # a message that starts with "/"
            line = line.replace("/", "", 1)
        if not command:
            continue
        history.append({"role": "user", "content": as_text(line)})
        print("model> ", end="", flush=True)
        try:
            try:
                prompt, options = chat_turn(fmt, history, anchors)
            except KeyboardInterrupt:  # while rendering (nothing sent yet): the turn is dropped
                history.pop()
                print("\n[freetoken] interrupted", file=sys.stderr)
                continue
            text, stats = stream_reply(engine, prompt, sampling, **options)
        except ContextLengthError as e:
            history.pop()  # the message that did not fit; the chat goes on
            print(
                f"\nfreetoken: the conversation no longer fits the context: {e}; /reset "
                "clears the history",
                file=sys.stderr,
            )
            continue
        report(stats, engine)
        if failed(stats):
            history.pop()  # no reply to keep; the chat goes on
            continue
        # An interrupted reply stays, as far as it went: the history is what the user saw.
        history.append({"role": "assistant", "content": text})
