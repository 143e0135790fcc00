"""Tool-call ids a Mistral template takes back: it raises unless every call id and result id is
9 characters long, so ids from other clients (or from before) are mapped, pairs kept, and the
Mistral parser hands out such ids itself."""

from __future__ import annotations

import random
import re
import string

from mistral_tokenizer import CONFIG, mistral_v3_backend

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.parsers import OutputParser, ToolCallEnd

# Mistral v0.3 / Mixtral-8x22B's rule, in a template of our own: calls as a [TOOL_CALLS] list
# with their ids, results with theirs, any id of another length refused as theirs refuse it.
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for m in messages %}
  {%- if m.role == "user" %}{{ "[INST] " + m.content + "[/INST]" }}
  {%- elif m.tool_calls %}{{ "[TOOL_CALLS] [" }}
    {%- for c in m.tool_calls %}
      {%- if c.id is not defined or c.id|length != 9 %}
        {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
      {%- endif %}
      {{- '{"name": "' + c.function.name + '", "id": "' + c.id + '"}' }}
      {%- if not loop.last %}{{ ", " }}{% endif %}
    {%- endfor %}{{ "]" + eos_token }}
  {%- elif m.role == "tool" %}
    {%- if m.tool_call_id|length != 9 %}
      {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
    {%- endif %}
    {{- '[TOOL_RESULTS] {"content": "' + m.content + '", "call_id": "' }}
    {{- m.tool_call_id + '"}[/TOOL_RESULTS]' }}
  {%- elif m.role == "assistant" %}{{ " " + m.content + eos_token }}
  {%- endif %}
{%- endfor %}"""
HERMES_TEMPLATE = """{%- for m in messages %}<|{{ m.role }}|>{{ m.content or "" }}
{%- for c in m.tool_calls or [] %}<tool_call>{{ c.id }}</tool_call>{% endfor %}
{%- if m.tool_call_id %}<result id="{{ m.tool_call_id }}">{% endif %}{% endfor %}"""
NINE = re.compile(r"[A-Za-z0-9]{9}")


def _format(template: str) -> ChatFormat:
    tok = Tokenizer(mistral_v3_backend(), dict(CONFIG), chat_templates={"default": template})
    return ChatFormat(tok)


def _foreign_id(rng: random.Random) -> str:
    """An id as other clients make them: OpenAI's, Anthropic's, or any text at all."""
    hexes = "".join(rng.choice("0123456789abcdef") for _ in range(24))
    kinds = [
        "call_" + hexes,
        "toolu_01" + "".join(rng.choice(string.ascii_letters) for _ in range(22)),
        "".join(rng.choice(string.printable[:90]) for _ in range(rng.randrange(1, 40))),
    ]
    return rng.choice(kinds)


def _history(ids: list[list[str]]) -> list[dict]:
    """A user turn, then per round an assistant's calls with `ids` and a result for each."""
    history: list[dict] = [{"role": "user", "content": "go"}]
    for round_ids in ids:
        calls = [{"id": i, "type": "function", "function": {"name": f"f{k}", "arguments": "{}"}}
                 for k, i in enumerate(round_ids)]  # fmt: skip
        history.append({"role": "assistant", "content": None, "tool_calls": calls})
        history += [{"role": "tool", "tool_call_id": i, "content": f"r{i!r:.3}"} for i in round_ids]
    return history


def test_foreign_ids_are_mapped_for_a_mistral_template_pairs_kept(rng_seed):
    rng = random.Random(rng_seed)
    ids = [
        [_foreign_id(rng) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 4))
    ]
    kept = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(9))
    ids[0][0] = kept  # already Mistral's: left as it is
    text = _format(MISTRAL_TEMPLATE).render(_history(ids)).text
    called = re.findall(r'"id": "([^"]*)"', text)
    answered = re.findall(r'"call_id": "([^"]*)"', text)
    assert called == answered and all(NINE.fullmatch(i) for i in called), text
    assert called[0] == kept
    distinct = len({i for r in ids for i in r})
    assert len(set(called)) == distinct  # two ids never become one


def test_the_mapping_is_the_same_every_render(rng_seed):
    """A Session re-renders its history each turn: the same ids map the same way."""
    rng = random.Random(rng_seed)
    ids = [[_foreign_id(rng)]]
    texts = {_format(MISTRAL_TEMPLATE).render(_history(ids)).text for _ in range(2)}
    assert len(texts) == 1


def test_other_templates_keep_the_ids(rng_seed):
    rng = random.Random(rng_seed)
    ids = [[_foreign_id(rng) for _ in range(2)]]
    text = _format(HERMES_TEMPLATE).render(_history(ids), add_generation_prompt=False).text
    for i in ids[0]:
        assert f"<tool_call>{i}</tool_call>" in text


def test_a_mistral_call_parsed_goes_back_as_it_came(rng_seed):
    """The Mistral parser's ids are 9 letters and digits, one per call, and the template takes
    them back unchanged."""
    rng = random.Random(rng_seed)
    n = rng.randrange(1, 5)
    calls = ", ".join(f'{{"name": "f{k}", "arguments": {{"x": {k}}}}}' for k in range(n))
    parser = OutputParser("mistral", False, None)
    events = parser.feed(f"[TOOL_CALLS] [{calls}]") + parser.finish()
    ids = [e.id for e in events if isinstance(e, ToolCallEnd)]
    assert len(ids) == n == len(set(ids)) and all(NINE.fullmatch(i) for i in ids), ids
    text = _format(MISTRAL_TEMPLATE).render(_history([ids])).text
    assert re.findall(r'"id": "([^"]*)"', text) == ids
