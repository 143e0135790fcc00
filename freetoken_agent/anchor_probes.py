"""Single probes: where a field, a call or a turn begins in a rendered history, one render of
a variant each (anchor_locator.py says what they are for and how they are combined).

    # render(dicts, add_generation_prompt) -> text, or None where the template refuses it
    span = field_span(render, dicts, i, "content", text, gen)     # (start, end) | None
    start = call_start(render, dicts, i, c, text, gen)            # character | None
"""

from __future__ import annotations

from collections.abc import Callable

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.text_prefix import common_prefix, common_suffix

Render = Callable[[list[dict], bool], str | None]  # None where the template refuses it

# Sentinels for field probes: private-use characters no template tests for, differing in their
# first and last characters so the common prefix/suffix of two renderings stops exactly at them.
_SENTINELS = ("\U000f0001\U000f0101\U000f0003", "\U000f0002\U000f0102\U000f0004")


def unrendered(what: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the model's chat template does not render {what}, so the model would never see them; "
        "give a chat template that renders them (chat_template=...) or leave them out"
    )


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def probe_start(render: Render, dicts: list[dict], m: int, ref: str) -> int | None:
    """Where message m begins in `ref` when the template refuses the history before it.

    That history followed by sentinel user messages is accepted (they are the user query it
    wanted): one = X + H + s0 + F and two = X + H + s1 + F + H + s0 + F, where X renders
    messages 0..m-1, H is a user turn's header (`<|im_start|>user\\n`) and F what follows
    the last user's content. F is one's tail after s0; H lies between F and s0 in two; X
    ends |H| before s0 in one. Taking the common prefix with `ref` as well keeps the start
    at or before the true one should the template render X differently there.
    None when the template refuses this too (e.g. it requires alternating roles)."""
    s0, s1 = _SENTINELS
    one = render([*dicts[:m], _user(s0)], False)
    two = render([*dicts[:m], _user(s1), _user(s0)], False)
    if one is None or two is None or one.count(s0) != 1 or two.count(s0) != 1:
        return None
    if two.count(s1) != 1:
        return None
    footer = one[one.index(s0) + len(s0) :]
    after_s1 = two.index(s1) + len(s1)
    if not two.startswith(footer, after_s1) or after_s1 + len(footer) > two.index(s0):
        return None
    header = two[after_s1 + len(footer) : two.index(s0)]
    start = one.index(s0) - len(header)
    if start < 0 or one[start : one.index(s0)] != header:
        return None
    return min(start, common_prefix(one, ref))


def field_span(
    render: Render,
    dicts: list[dict],
    i: int,
    key: str,
    reference: str,
    gen: bool,
    required: str | None = None,
) -> tuple[int, int] | None:
    """[start, end) of message i's `key` in `reference` (= the rendering of `dicts`).

    A non-empty value is compared with one sentinel rendering: the sentinel's first and
    last characters differ from the value's, so the common prefix and suffix stop exactly
    at the field. An empty value might change the template's structure (`if content`), so
    two sentinels are compared with each other and the result checked against the text.
    A field the template does not render is no error (stripped reasoning) unless `required`
    names what the model would then miss."""
    value = dicts[i].get(key)
    single = (
        isinstance(value, str)
        and value != ""
        and value[0] not in (_SENTINELS[0][0], _SENTINELS[1][0])
        and value[-1] not in (_SENTINELS[0][-1], _SENTINELS[1][-1])
    )
    variants = []
    for sentinel in _SENTINELS[:1] if single else _SENTINELS:
        probe = [*dicts]
        probe[i] = {**dicts[i], key: sentinel}
        variants.append(render(probe, gen))
    a, b = variants[0], variants[-1] if not single else reference
    if a is not None and a == b and required:
        raise unrendered(required)
    if a is None or b is None or a == b:
        return None  # refused, or the template does not render the field
    pre = common_prefix(a, b)
    post = min(common_suffix(a, b), len(a) - pre, len(b) - pre)
    start, end = pre, len(reference) - post
    ok = reference.startswith(a[:pre]) and reference.endswith(a[len(a) - post :])
    return (start, end) if ok and start <= end else None


def call_start(
    render: Render, dicts: list[dict], i: int, j: int, reference: str, gen: bool
) -> int | None:
    """Where call j of message i begins in `reference`: cut the calls before it. Cutting
    them all (j = 0) must change the text, else the template ignores tool calls."""
    probe = [*dicts]
    probe[i] = {**dicts[i], "tool_calls": dicts[i]["tool_calls"][:j]}
    if not probe[i]["tool_calls"]:
        del probe[i]["tool_calls"]
    text = render(probe, gen)
    if j == 0 and text == reference:
        raise unrendered("tool calls")
    return None if text is None else common_prefix(text, reference)
