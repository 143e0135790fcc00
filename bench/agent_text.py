"""Synthetic text for agent sessions: a word list, line makers by output style, the tool table.

    text, n = text_of(tok, rng, "code", 300)  # lines of code until 300 tokens (n: the count)
    TOOLS["coding"]["read_file"]  # ("numbered", ("path", "offset", "limit")): style, params

Everything is drawn from a `random.Random` the caller passes, so the same stream gives the same
text. Sizes are token counts on the tokenizer passed in (the demo tokenizer, in agent_trace.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from freetoken_agent.engine.text.tokenizer import Tokenizer

KINDS = ("coding", "tools")  # session kinds: each draws its tools from its own table rows

_VOCABULARY = """
    agent anchor array batch buffer cache call chunk client config context count cursor data
    debug decode device diff entry error event expert field file filter format frame graph
    handle header index input item kernel layer limit line list load lock log memory merge
    message method model module node number offset option order output page parse path pool
    prefix queue range reader record request result route row schema scope search segment
    server session shape slot source state status step stream string table task test thread
    token tool trace tree update user value version view window worker write the a of to and
    in is it for on with as by this that from we should check first then next why because
    when not only all new old each more most some every still after before again look fix
    run read find keep move test call seems likely wrong right case missing extra"""
_WORDS = tuple(_VOCABULARY.split())


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def ident(rng: random.Random) -> str:
    return "_".join(rng.choice(_WORDS[:110]) for _ in range(rng.randint(1, 3)))


def _sentence(rng: random.Random) -> str:
    s = words(rng, rng.randint(5, 16))
    return s[0].upper() + s[1:] + rng.choice("..,;:?")


# Line makers by output style: (rng, line number) -> one line of text.
def _prose(rng: random.Random, i: int) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))


def _code(rng: random.Random, i: int) -> str:
    a, b, c = ident(rng), ident(rng), ident(rng)
    forms = (
        f"def {a}({b}, {c}):",
        f"{a} = {b}.{c}({ident(rng)}, {rng.randint(0, 4096)})",
        f"if {a} is not None and {b} > {rng.randint(0, 64)}:",
        f"return {a}[{b}]",
        f"# {words(rng, rng.randint(4, 12))}",
        f'raise ValueError(f"{words(rng, 4)} {{{a}}}")',
        f"for {a} in {b}.{c}():",
        f"self.{a} = {b}",
    )
    return "    " * rng.choice((0, 1, 1, 2, 2, 3)) + rng.choice(forms)


def _log(rng: random.Random, i: int) -> str:
    if rng.random() < 0.5:
        status = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"))
        return f"tests/test_{ident(rng)}.py::test_{ident(rng)} {status} [{i % 100:3d}%]"
    level = rng.choice(("INFO", "INFO", "WARNING", "ERROR", "DEBUG"))
    return f"12:{i // 60 % 60:02d}:{i % 60:02d} {level} {ident(rng)}: {_sentence(rng)}"


STYLES: dict[str, Callable[[random.Random, int], str]] = {
    "prose": _prose,
    "code": _code,
    "log": _log,
    "numbered": lambda rng, i: f"{i + 1:6d}\t{_code(rng, i)}",
    "grep": lambda rng, i: f"src/{ident(rng)}.py:{rng.randint(1, 900)}:{_code(rng, i).strip()}",
    "diff": lambda rng, i: rng.choice("+- ") + _code(rng, i),
    "paths": lambda rng, i: f"{'  ' * rng.randint(0, 3)}{ident(rng)}/{ident(rng)}.py",
    "json": lambda rng, i: json.dumps(
        {"id": i, "title": words(rng, 5), "snippet": _sentence(rng), "score": rng.randint(1, 99)}
    ),
    "table": lambda rng, i: " | ".join([str(i), *(words(rng, rng.randint(1, 3)) for _ in "abcd")]),
}

# kind, tool, output style, parameters (* marks the one carrying a long argument: code, a body)
_TOOL_TABLE = """
    coding read_file numbered path offset limit
    coding edit_file numbered path old_string *new_string
    coding write_file log path *content
    coding apply_patch log *patch
    coding bash log command timeout
    coding run_tests log target flags
    coding grep grep pattern path glob
    coding search_symbols grep query kind
    coding glob paths pattern
    coding list_dir paths path depth
    coding git_diff diff ref path
    coding web_fetch prose url prompt
    tools web_search json query top_k
    tools fetch_page prose url
    tools sql_query table database *sql
    tools send_email json to subject *body
    tools calendar_lookup json start end attendee
    tools weather table location date
    tools read_document prose doc_id section
    tools spreadsheet table sheet range formula
    tools translate prose *text target
    tools calculator table expression
    tools crm_lookup json customer_id fields
    tools create_ticket json title *body priority"""
TOOLS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {kind: {} for kind in KINDS}
for _kind, _tool, _style, *_params in map(str.split, _TOOL_TABLE.strip().splitlines()):
    TOOLS[_kind][_tool] = (_style, tuple(_params))
INTEGER_PARAMS = frozenset({"offset", "limit", "timeout", "depth", "top_k"})


def count_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.backend.encode(text, add_special_tokens=False).ids)


def text_of(
    tok: Tokenizer, rng: random.Random, style: str, n_tokens: int, lo: int = 0, hi: int = 0
) -> tuple[str, int]:
    """(text, tokens): lines of `style` until `n_tokens`; within [lo, hi] when hi > 0."""
    lines: list[str] = []
    total = 0
    while total < n_tokens:
        lines.append(STYLES[style](rng, len(lines)))
        total += count_tokens(tok, lines[-1] + "\n")
    exact = count_tokens(tok, "\n".join(lines))
    while (hi and exact > hi and len(lines) > 1) or exact < lo:
        if exact < lo:
            lines.append(STYLES[style](rng, len(lines)))
        else:
            lines.pop()
        exact = count_tokens(tok, "\n".join(lines))
    return "\n".join(lines), exact
