"""Chat templates: a model's Jinja template rendered exactly as `transformers` renders it.

A model's chat template decides which tokens the model sees, so any difference from the
reference renderer (`transformers.PreTrainedTokenizerBase.apply_chat_template`) is a silent
accuracy bug. This module reproduces its environment and input handling:

- `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with `loopcontrols`,
  plus a pass-through `{% generation %}` block (templates on the Hub mark assistant spans with
  it for training masks; rendering ignores the markers);
- globals `raise_exception`, `strftime_now`, a hardened `dict` and `namespace`;
- a `tojson` filter that is plain `json.dumps` (ensure_ascii=False; optional indent,
  separators, sort_keys), not Jinja's HTML-escaping one;
- inputs rebuilt from plain JSON-like data; message keys whose value is None dropped (APIs send
  `content=None`, templates handle a missing key better); reasoning aliased between
  `reasoning_content`, `thinking` and `reasoning`;
- variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
  (`bos_token`, `eos_token`, ...) and any extra keyword (`enable_thinking`, ...), extras winning.

Templates come from checkpoints, i.e. untrusted code: the sandbox stays on, and the template
only ever sees rebuilt plain data, never the caller's objects.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken_agent.engine.outputs import InvalidRequestError

# The names a message's reasoning travels under; templates read the first (Qwen, DeepSeek),
# gpt-oss templates read `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(jinja2.exceptions.TemplateError, ValueError):
    """A chat template failed to compile or render. Also a ValueError: the usual cause is input
    the template rejects (an unknown role, a tool call without a name)."""


class TemplateRaisedError(ChatTemplateError):
    """The template called `raise_exception(message)`: it rejected the conversation on purpose."""


def _raise_exception(message: str) -> None:
    raise TemplateRaisedError(f"chat template rejected the input: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Stdlib json on purpose: templates were written against its spacing (", " and ": ") and
    # float formatting; orjson would change the prompt's bytes.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the real type (and its attributes) to them."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names that could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


# Attribute names a dict has as a Python object (`items`, `get`, ...): `m.items` means them.
_DICT_ATTRIBUTES = frozenset(dir(dict))
# Jinja's loop and our namespace: objects whose public attributes are the template's own values.
_PLAIN_HOLDERS = (jinja2.runtime.LoopContext, _TemplateNamespace)
_MISSING = object()


class _Environment(ImmutableSandboxedEnvironment):
    def getattr(self, obj: Any, attribute: str) -> Any:
        """`message.role` on a dict, as the sandbox resolves it: its getattr tries the Python
        attribute first and takes the key in the AttributeError handler, an exception per
        access (~3 us), most of a long history's render time (each anchor probe is a render).
        A key that no dict attribute shadows is what that path returns, found directly; the
        rest (attributes, other types) goes the sandbox's way."""
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if type(obj) in _PLAIN_HOLDERS and not attribute.startswith("_"):
            # `loop.index0`, `ns.last_query_index`: a plain value of Jinja's own objects, which
            # the sandbox's checks (internal names, known mutables, str.format) all pass.
            # Callables (`loop.cycle`) and misses go the sandbox's way.
            value = getattr(obj, attribute, _MISSING)
            if value is not _MISSING and not callable(value):
                return value
        return super().getattr(obj, attribute)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def plain_data(value: Any) -> Any:
    """Rebuild `value` from JSON-like types only.

    Str/int/float subclasses (enums, numpy scalars) lose their extra methods, dataclasses and
    pydantic models become dicts, and anything else becomes a "<TypeName>" placeholder: the
    sandbox cannot know which methods of an arbitrary object are dangerous.

    Input nested deeper than Python's recursion limit (tool arguments or a schema of hundreds
    of levels) is refused with InvalidRequestError: the last guard, front-ends check the depth
    of what they accept, naming the field, before it gets here.
    """
    try:
        return _plain(value)
    except RecursionError:
        raise InvalidRequestError(
            "the chat history or tools are nested too deeply to render (more levels of lists "
            "and objects than Python's recursion limit allows); flatten them"
        ) from None


def _plain(value: Any) -> Any:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError(f"chat message {index} must be a dict, got {type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        # Same key order as transformers: `thinking` first unless present, the standard name last.
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _describe(error: jinja2.exceptions.TemplateError) -> str:
    lineno = getattr(error, "lineno", None)
    where = f" (template line {lineno})" if lineno else ""
    return f"{type(error).__name__}: {error.message or error}{where}"


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template is empty or not a string")
        self.source = source
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {_describe(e)}") from e

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (dicts with role/content/tool_calls/...).

        `tools` are JSON-schema dicts ({"type": "function", "function": {...}}); `extra`
        reaches the template as variables (e.g. `enable_thinking=False`) and overrides special
        tokens of the same name.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of message dicts")
        if tools is not None:
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise TypeError(
                        f"tool {i} must be a JSON-schema dict, got {type(tool).__name__}"
                    )
        # Converted outside the template's `try`: input too deep to convert is the caller's
        # error (InvalidRequestError), not the template's.
        return self.render_plain(
            plain_data(list(messages)),
            plain_data(list(tools)) if tools is not None else None,
            add_generation_prompt,
            plain_data(list(documents)) if documents is not None else None,
            **extra,
        )

    def render_plain(
        self,
        messages: list[Any],
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        documents: list[Any] | None = None,
        **extra: Any,
    ) -> str:
        """`render` of messages, tools and documents that are `plain_data`'s output already:
        not converted again. ChatFormat converts a history once and renders it and its
        variants (prefixes, probes) hundreds of times: converting each time was about a
        quarter of a long history's first rendering. Anything else passed here would reach
        the sandbox as it is, so only plain data may come this way."""
        if len(messages) == 0:
            raise ValueError("cannot render an empty conversation: give at least one message")
        chat = [_normalize_message(m, i) for i, m in enumerate(messages)]
        variables = {**self.special_tokens, **plain_data(extra)}
        try:
            return self._template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateRaisedError:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {_describe(e)}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # Python errors inside template expressions (e.g. `'a' + none`) are template
            # problems too; name them as such rather than as a bug in the caller.
            raise ChatTemplateError(
                f"chat template failed to render: {type(e).__name__}: {e}"
            ) from e
