"""Constrained output shared by ChatFreeToken (langchain_*.py) and the OpenAI server (server/):
the JSON schemas that constrain a turn, the parser of "a tool call or the answer's JSON", and
the call block a forced call's prompt opens (`WrappedBlock`).

Schemas nest inside larger ones with their $defs moved to the root, renamed per part, where
their $refs still resolve (recursive ones too; `hoisted`), or inlined where a ref points
elsewhere; and they are closed (additionalProperties false unless they say otherwise).
Tools plus a response format, as LangChain agents bind them and the OpenAI Agents SDK sends
them, give "one call of one of the tools, or the answer": an anyOf of each tool's {"name",
"arguments"} object and the answer's schema. One call, not a list: the model writes a call
where it would otherwise answer, and the agent loop comes back for the next one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from langchain_core.utils.json_schema import dereference_refs

from freetoken_agent.engine.constrained import tool_call_schema
from freetoken_agent.parsers import ContentDelta, OutputParser, ParseWarning, ToolCallEnd

HERMES_OPEN = "<tool_call>\n"
HERMES_CLOSE = "\n</tool_call>"


class JsonOrCallParser:
    """Output constrained to "the answer's JSON or a {"name", "arguments"} call of a tool": only
    the whole text tells which, so content is held until the end, then read as a Hermes call
    body or released as the answer. (Held, not streamed: an answer may begin exactly as a call
    does, a json_object answer may even be one, and content sent cannot be taken back.)"""

    def __init__(self, opened: bool, tools: list[dict], in_block: bool = False) -> None:
        """`opened`: the output starts inside a think block; `in_block`: the JSON comes inside
        a Hermes call block the grammar writes (a forced call after the reasoning:
        reasoned_json.py), whose markup is read off it, and off a call cut short by max_tokens
        (the content then is what the JSON got to, as where no block is written)."""
        self.inner = OutputParser(None, opened, None)
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools}
        self.held: list[str] = []
        self.in_block = in_block

    def feed(self, text: str) -> list:
        return self._hold(self.inner.feed(text))

    def finish(self) -> list:
        out = self._hold(self.inner.finish())
        text = "".join(self.held)
        if self.in_block:
            text = _block_body(text)
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        is_call = (
            isinstance(obj, dict)
            and set(obj) == {"name", "arguments"}
            and obj["name"] in self.names
            # the call branch always writes an object; an answer shaped like a call with other
            # arguments stays the answer rather than a call the parser would void as markup
            and isinstance(obj["arguments"], dict)
        )
        if is_call:
            calls = OutputParser("hermes", False, self.tools)
            return out + calls.feed(HERMES_OPEN + text + HERMES_CLOSE) + calls.finish()
        return out + ([ContentDelta(text)] if text else [])

    def _hold(self, events: list) -> list:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                self.held.append(event.text)
            else:
                out.append(event)
        return out


def _block_body(text: str) -> str:
    """The JSON of a Hermes call block as the grammar writes it (`<tool_call>\\n{...}\\n
    </tool_call>`), whole or cut anywhere: the JSON is written compact (no newline), so the
    first newline after the opener starts the closer."""
    if HERMES_OPEN.startswith(text):
        return ""  # cut inside the opener: no JSON yet
    if not text.startswith(HERMES_OPEN):
        return text  # not a block (no grammar wrote it): as written
    return text[len(HERMES_OPEN) :].split("\n", 1)[0]


def is_json(text: str) -> bool:
    """Whether `text` is one whole JSON value: a call body the grammar finished, where one
    cut by max_tokens is not (its closer is then not written for it)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class WrappedBlock:
    """A call block the host opened (the prompt ends with `opener`), and may close by feeding
    the parser a closer, around what the model writes under the grammar. When the parser voids
    the block, the content it gives back and the warning's text are only what the model wrote:
    the opener and the closer are not the model's. Used by ChatFreeToken's PrefedParser and the
    server's ForcedCallParser."""

    def __init__(self, opener: str) -> None:
        self.opener = opener
        self.open = bool(opener)  # the block the opener began has not ended yet

    def as_written(self, events: list, closer: str) -> list:
        """`events` with the opener (and `closer`, when that was fed) taken out of the voided
        block's text. The parser re-emits a voided block as a ContentDelta of its raw text right
        before the ParseWarning."""
        out: list = []
        for event in events:
            if self.open and isinstance(event, ToolCallEnd):
                self.open = False
            elif self.open and isinstance(event, ParseWarning):
                self.open = False
                raw = event.raw_text.removeprefix(self.opener)
                raw = raw.removesuffix(closer) if closer else raw
                if out and out[-1] == ContentDelta(event.raw_text):
                    out.pop()
                    out += [ContentDelta(raw)] if raw else []
                event = ParseWarning(event.message, raw, event.index)
            out.append(event)
        return out


def inline(schema: dict) -> dict:
    """`schema` with its $refs inlined, so it can sit inside a larger schema (anyOf, a call's
    arguments) where "#/$defs/..." would no longer resolve. A $ref that resolves nowhere raises
    KeyError (ValueError when it is not a "#/..." pointer)."""
    if not refers(schema):  # nothing to inline (a property may be *named* "$ref")
        return schema
    try:
        out = dereference_refs(schema)
    except TypeError as e:  # langchain's walk takes a property named "$ref" for a pointer
        raise ValueError(f"the schema's $refs cannot be inlined ({e}); is a property named "
                         "'$ref'?") from e  # fmt: skip
    if not refers(out):
        out = {k: v for k, v in out.items() if k not in ("$defs", "definitions")}
    return out


def refers(schema: Any) -> bool:
    """Whether `schema` holds a $ref pointer (a "$ref" key with a string value) anywhere."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                return True
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return False


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_COMBINATIONS = ("anyOf", "oneOf", "allOf")


def closed(schema: Any) -> Any:
    """`schema` with its objects closed (`_closed`), but for the defs some object reads as one
    of its parts (`_part_defs`): closed alone, such a def forbade the keys the object's other
    parts add (OpenAPI's `allOf: [{"$ref": Base}, {...}]`), and the schema admitted nothing."""
    return _closed(schema, False, _part_defs(schema))


def closed_with(schema: dict, defs: dict[str, Any]) -> tuple[dict, dict[str, Any]]:
    """`schema` and `defs` (the defs its refs read, kept apart for a root elsewhere) closed as
    one schema, so a def it reads as a part of an object stays open (`closed`)."""
    whole = closed({**schema, "$defs": defs})
    return {k: v for k, v in whole.items() if k != "$defs"}, whole["$defs"]


def _part_defs(schema: Any) -> set[str]:
    """The names of the $defs that a $ref reads as a part of an object, beside other parts: an
    allOf branch among others (or beside the object's own properties), or a $ref beside the
    object's own properties or combinations. Not a lone allOf branch, the wrapper pydantic v1
    and OpenAPI 3.0 put around a $ref to give it a description: that def is the whole value,
    and stays closed."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
            continue
        if not isinstance(node, dict):
            continue
        own = "properties" in node or any(isinstance(node.get(k), list) for k in ("anyOf", "oneOf"))
        branches = [b for b in node.get("allOf") or [] if isinstance(b, dict)]
        parts = branches if len(branches) > 1 or own else []
        if own or branches:
            parts = [*parts, node]
        for part in parts:
            ref = part.get("$ref")
            if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                found.add(_pointer_name(ref.split("/")[2]))
        stack += node.values()
    return found


def _closed(schema: Any, partial: bool = False, part_defs: frozenset | set = frozenset()) -> Any:
    """Objects that list their properties get additionalProperties false unless they say
    otherwise (OpenAI's strict mode does the same): otherwise the grammar lets a model append
    keys nobody asked for, and a weak one rambles there until max_tokens. Walks subschemas by
    keyword, so a property that happens to be named "properties" is left alone.

    Not where the object is only part of one: additionalProperties sees its own `properties`
    alone, so closing a part forbids what the other parts allow, and the whole may then admit
    nothing. The parts are the branches of allOf (each lists some of the properties), and
    anyOf/oneOf branches that constrain an object listing its own properties (`partial`): they
    stay open, and the object they combine into is closed over every name its parts list (a
    name only a branch lists gets `{}` beside it; the branch still holds its value). Open
    where a part cannot be read (a $ref) or opens the object itself. anyOf/oneOf branches of a
    schema without properties are whole alternatives, closed as any object."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            defs = key in _DEF_MAPS
            out[key] = {
                name: _closed(sub, defs and name in part_defs, part_defs)
                for name, sub in out[key].items()
            }
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            part = key == "allOf" or (key != "prefixItems" and "properties" in out)
            out[key] = [_closed(sub, part, part_defs) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            sub = out[key]
            out[key] = (
                [_closed(s, False, part_defs) for s in sub]
                if isinstance(sub, list)
                else _closed(sub, False, part_defs)
            )
    combined = "$ref" in out or any(isinstance(out.get(k), list) for k in _COMBINATIONS)
    if "additionalProperties" in out or partial:
        return out
    if not combined:
        if "properties" in out:
            # A required name it does not list is one of its keys too: closed over its
            # properties alone, the object would admit nothing.
            missing = [n for n in out.get("required") or [] if n not in out["properties"]]
            out["properties"] = {**out["properties"], **{n: {} for n in missing}}
            out["additionalProperties"] = False
        return out
    # Parts (allOf branches, or branches beside the object's own properties; whole
    # alternatives are closed each on its own, above) and no $ref beside them.
    parts = "properties" in out or isinstance(out.get("allOf"), list)
    names = named_properties(out) if parts and "$ref" not in out else None
    if names is not None:  # and every name a part requires: a key too, listed or not
        names |= _required_names(out)
    if names:  # closed over every name a part lists: each part still holds its own
        own = out.get("properties") or {}
        out["properties"] = {**{n: {} for n in names if n not in own}, **own}
        out["additionalProperties"] = False
    return out


def _required_names(schema: Mapping[str, Any]) -> set[str]:
    """The names `schema` and its allOf/anyOf/oneOf branches (theirs too) require."""
    names = {n for n in schema.get("required") or [] if isinstance(n, str)}
    for key in _COMBINATIONS:
        for branch in schema.get(key) or []:
            if isinstance(branch, Mapping):
                names |= _required_names(branch)
    return names


def named_properties(schema: Mapping[str, Any]) -> set[str] | None:
    """The property names `schema` and its allOf/anyOf/oneOf branches list (theirs too), or
    None where a branch cannot be read or opens the object itself (a $ref, an explicit
    additionalProperties or patternProperties): then the object stays open, and any name
    may be one of its keys. `closed` closes an object over them; the MCP host checks the
    argument names a forced call pins against them."""
    if schema.get("additionalProperties", False) is not False or "patternProperties" in schema:
        return None  # its own extra names are open
    names = set(schema.get("properties") or {})
    for key in _COMBINATIONS:
        for branch in schema.get(key) or []:
            if not isinstance(branch, Mapping) or "$ref" in branch:
                return None
            if branch.get("additionalProperties", False) is not False:
                return None
            if "patternProperties" in branch:
                return None
            inner = named_properties(branch)
            if inner is None:
                return None
            names |= inner
    return names


def output_schema(mode: str, tools: list[dict], schema: dict | None) -> dict | None:
    """The json_schema that constrains a turn of `mode` (None: unconstrained). mode: auto | none
    (unconstrained) | json (the answer's `schema`) | required (a call of one of `tools`) |
    json_or_call (that or the answer). Each part's $defs move to the root, renamed per part
    (`hoisted`), where their $refs resolve, recursive ones too; a part whose refs point
    elsewhere is inlined."""
    if mode in ("auto", "none"):
        return None
    if mode == "json":
        return closed(schema)
    defs: dict[str, Any] = {}
    calls = [call_part(tool, f"tool{i}.", defs) for i, tool in enumerate(tools)]
    if mode == "json_or_call":
        calls.append(placed(schema, "answer.", defs))
    return closed(rooted(calls, defs))


def call_part(tool: Any, prefix: str, defs: dict[str, Any]) -> dict:
    """The schema of one call of `tool` ({"name", "arguments"}: tool_call_schema) to nest in a
    larger one, its parameters `placed` (their $defs added to `defs`, renamed with `prefix`).
    No parameters: an empty object."""
    fn = dict(tool["function"])
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    fn["parameters"] = placed(params, prefix, defs)
    return tool_call_schema({"type": "function", "function": fn})


def rooted(parts: list[dict], defs: dict[str, Any]) -> dict:
    """One of `parts` (an anyOf of them where several), `defs` at the root where the parts'
    $refs ("#/$defs/...") resolve."""
    out = parts[0] if len(parts) == 1 else {"anyOf": parts}
    return {**out, "$defs": defs} if defs else out


def placed(schema: dict, prefix: str, defs: dict[str, Any]) -> dict:
    """`schema` to nest in a larger one: hoisted (its defs added to `defs`), else inlined."""
    moved = hoisted(schema, prefix)
    if moved is None:
        return inline(schema)
    body, own = moved
    defs.update(own)
    return body


_DEF_MAPS = ("$defs", "definitions")


def _pointer_name(token: str) -> str:
    """A JSON pointer token as the name it stands for (RFC 6901's ~1 and ~0; a $ref is a URI
    fragment, so %-escapes too: "My%20Def" is the def "My Def")."""
    return unquote(token).replace("~1", "/").replace("~0", "~")


def hoisted(schema: dict, prefix: str) -> tuple[dict, dict[str, Any]] | None:
    """`schema` without its $defs (or definitions) and those defs, each renamed `prefix` +
    name, their $refs ("#/$defs/Name") renamed alike: to sit inside a larger schema whose root
    holds the defs. llguidance resolves refs from the root, a cycle included, where inlining
    cuts it to {} (a tree's children would then be anything). A ref into the schema itself
    ("#", zod's recursion through the root, or "#/properties/...") points to a copy of the
    schema made a def of its own (`prefix` + "root"). Its $id and $schema are dropped (an
    $id would make the nested body a resource of its own, against which the renamed refs no
    longer resolve). None where a ref points to another document or to a def not there."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    if not isinstance(own, dict):
        return None
    root = prefix + "root"
    while root in {prefix + name for name in own}:
        root += "_"
    into_root = False

    def renamed(ref: str) -> str:
        nonlocal into_root
        if ref != "#" and not ref.startswith("#/"):
            raise LookupError(ref)  # another document
        tokens = ref[2:].split("/") if ref != "#" else []
        if tokens[:1] and tokens[0] in _DEF_MAPS and len(tokens) > 1:
            if _pointer_name(tokens[1]) not in own:
                raise LookupError(ref)
            # prefix needs no escaping ("tool0.", "answer."): name's token as written after it
            return "/".join(["#", "$defs", prefix + tokens[1], *tokens[2:]])
        into_root = True
        return "/".join(["#", "$defs", root, *tokens])

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        return {
            key: renamed(value) if key == "$ref" and isinstance(value, str) else walk(value)
            for key, value in node.items()
        }

    drop = (*_DEF_MAPS, "$id", "$schema")
    body = {k: v for k, v in schema.items() if k not in drop}
    try:
        defs = {prefix + name: walk(sub) for name, sub in own.items()}
        body = walk(body)
    except LookupError:
        return None
    if into_root:  # the body stays in place (its properties readable there), a copy its def
        defs[root] = body
    return body, defs
