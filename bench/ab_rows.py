"""Decode rows measured two ways inside one engine (bench offload's --lend-ab and
--every-miss-ab): each row a switch applies to runs twice in a row, switched on then off, so a
round's rotation keeps the pair together; two processes differ by the host's drift more than
by such a switch (bench/lend_switch.py)."""

from __future__ import annotations

from collections.abc import Callable


def ab_rows(rows: list[tuple], ab: bool, words: tuple[str, str],
            applies: Callable[[tuple], bool] = lambda row: True) -> list[tuple]:  # fmt: skip
    """The rows with the switch's value appended: None (as loaded) for each row without `ab`
    and for rows it does not `apply` to; with `ab`, each other row twice, NAME+words[0] (on,
    True) then NAME+words[1] (off, False)."""
    out = []
    for row in rows:
        if not ab or not applies(row):
            out.append((*row, None))
            continue
        name, *rest = row
        out += [
            (f"{name}+{word}", *rest, on) for word, on in zip(words, (True, False), strict=True)
        ]
    return out
