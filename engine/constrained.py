"""Constrained decoding: a grammar (a JSON schema's, or one in llguidance's Lark syntax) masks a
request's logits before each sample.

Used for structured output (`SamplingParams.json_schema`, or `response_format` json_schema /
json_object) and for forced tool calls: `tool_call_schema(tool)` gives the schema of a
`{"name": ..., "arguments": {...}}` call (the JSON that Qwen/Hermes-style models write inside
`<tool_call>...</tool_call>`; the caller ends the prompt with the opener and closes it after),
`tool_arguments_schema(tool)` the arguments alone (vLLM's way for a named `tool_choice`).

The grammar library is llguidance (MIT), chosen over xgrammar and outlines-core because:
- it is one self-contained wheel (abi3, CPython >= 3.10, ~3 MB download, ~8 MB installed) with
  no Python dependencies; xgrammar pulls torch, transformers, triton, pydantic and a TVM FFI
  runtime; outlines-core is small too but builds a whole-vocabulary index per schema up front
  (seconds for larger schemas) and covers less of JSON Schema;
- it builds its tokenizer straight from a `tokenizers` JSON string (`Tokenizer.backend`), so
  neither transformers nor a hub download is involved;
- it computes masks lazily (tens of microseconds per token, no per-schema precompute), reports
  unsupported keywords and unsatisfiable schemas as errors that name them, and tells when the
  grammar can take no more bytes, which is where a request ends.

llguidance is imported only when a request asks for constrained output (the GPU image does not
carry it): nothing here imports it at module level, and a missing package is a
`GrammarBackendMissing` error naming it, raised when such a request is submitted.

Flow (host-driven, outside CUDA graphs): `Engine.submit` -> `Grammars.add` (grammar compiled
once per schema and tokenizer, each request gets a copy of the compiled matcher) -> per step,
`Grammars.masks` packs each constrained sampling row's allowed ids into int32 words ->
`ModelRunner` turns them into a [B, V] bool mask on the device (`allowed_tokens`) and the sampler
sets the other logits to -inf -> `RequestOutcomes._accept` (request_outcomes.py) advances the
matcher by the sampled token; when the grammar is complete the request ends with finish reason
"stop", before any token past the end of the JSON.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from freetoken_agent.engine.outputs import InvalidRequestError, SchemaError
from freetoken_agent.engine.sampling_params import Constraint

if TYPE_CHECKING:
    from freetoken_agent.engine.text.tokenizer import Tokenizer

# B sampling rows, V model vocab (lm_head rows), W = ceil(V / 32) mask words

BACKEND = "llguidance"
# Keep in step with pyproject.toml. 1.7.x dead-ends on negative numeric ranges with multipleOf
# (no token allowed mid-number); 1.8 wheels need glibc >= 2.31 (manylinux_2_31, abi3).
MIN_VERSION = (1, 8)
BACKEND_REQUIREMENT = f"{BACKEND}>={MIN_VERSION[0]}.{MIN_VERSION[1]}"
# Fixed separators, as json.dumps writes them: flexible whitespace would let a model (a weak or
# random one above all) pad the JSON with whitespace until max_tokens. A schema can still ask
# for other options through llguidance's "x-guidance" key, which overrides these defaults.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled schemas kept per engine
_GRAMMAR_PLACE = re.compile(r"\bat \d+\(\d+\): ")  # llguidance's "at LINE(COLUMN): " in errors


class GrammarBackendMissing(ImportError):
    """Constrained output was asked for but the grammar library is not installed."""


def load_backend() -> Any:
    # Imported here, not at module level: only constrained requests need it, and the GPU
    # image does not carry it (tests/test_project.py allows it in the engine for that use).
    need = (
        f"constrained output (json_schema, response_format or a forced tool call) needs the "
        f"'{BACKEND}' package"
    )
    try:
        import llguidance as module
    except ImportError as e:
        raise GrammarBackendMissing(
            f"{need}, which is not installed: pip install '{BACKEND_REQUIREMENT}'"
        ) from e
    try:
        version = importlib.metadata.version(BACKEND)
    except importlib.metadata.PackageNotFoundError:
        return module  # imported from a path without metadata: trust it
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_VERSION:
        raise GrammarBackendMissing(
            f"{need} at version {'.'.join(map(str, MIN_VERSION))} or later, found {version}: "
            f"pip install -U '{BACKEND_REQUIREMENT}'"
        )
    return module


def schema_refusal(schema: dict) -> str | None:
    """Why the grammar library cannot take `schema` (its first line), or None; compiled
    without a tokenizer, so a part of a larger grammar (a strict tool's call) can be judged,
    and named, on its own before the whole is compiled. None too where the library is not
    installed: the request itself then says so. Judged once per schema text: an agent sends
    the same tools every turn (~2 ms a tool each time otherwise)."""
    return _schema_refusal(json.dumps(schema, separators=(",", ":")))


@functools.lru_cache(maxsize=CACHE_SIZE * 4)
def _schema_refusal(text: str) -> str | None:
    try:
        llg = load_backend()
    except GrammarBackendMissing:
        return None
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_OPTIONS)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except ValueError as e:
        failed, messages = True, [str(e)]
    return _GRAMMAR_PLACE.sub("", "; ".join(messages)).split("\n", 1)[0] if failed else None


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer; keeps the last CACHE_SIZE compiled ones."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Iterable[int]) -> None:
        self.llg = load_backend()
        eos = sorted(eos_ids)
        # The tokenizer's own vocabulary; padded lm_head rows are banned by `Grammars`.
        self.lltokenizer = self.llg.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos or None
        )
        self._cache: OrderedDict[str, Any] = OrderedDict()  # canonical schema -> LLMatcher

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher (llguidance LLMatcher) at the start of the constraint's grammar."""
        # Key order is kept: properties are written in the order the schema lists them.
        key = constraint.kind + ":" + json.dumps(constraint.spec, separators=(",", ":"))
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(constraint)
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return compiled.deep_copy()  # shares the compiled grammar, owns its parse state

    def _compile(self, constraint: Constraint) -> Any:
        matcher_cls = self.llg.LLMatcher
        what = constraint.name or ("json_schema" if constraint.kind == "json_schema" else "grammar")

        def refused(said: str) -> SchemaError:
            if constraint.kind == "lark" and what == "json_schema":
                # A schema inside a grammar (integrations/reasoned_json.py): the grammar's
                # line and column, and the listing of its text after the first line, are not
                # the caller's.
                said = _GRAMMAR_PLACE.sub("", said).split("\n", 1)[0]
            return SchemaError(f"{what} cannot be used: {said}")

        try:
            if constraint.kind == "lark":
                grammar = matcher_cls.grammar_from_lark(constraint.spec)
            else:
                grammar = matcher_cls.grammar_from_json_schema(
                    dict(constraint.spec), defaults=JSON_OPTIONS
                )
        except ValueError as e:
            raise refused(str(e)) from e
        failed, messages = matcher_cls.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if failed:
            raise refused("; ".join(messages))
        matcher = matcher_cls(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise refused(matcher.get_error())
        return matcher


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, valid: np.ndarray) -> None:
        self._m = matcher
        self._valid = valid  # [W] int32: bits of the ids the tokenizer can produce
        self.problem: str | None = None  # set once the grammar cannot go on

    def fill(self, row: np.ndarray) -> bool:  # row: [W] int32
        """Write the allowed next ids into `row`; False (and `problem` set) if there are none."""
        src = np.frombuffer(self._m.compute_bitmask(), dtype=np.int32)  # [ceil(vocab / 32)]
        n = min(len(src), len(row))
        row[:] = 0
        row[:n] = src[:n]
        row &= self._valid
        if self._m.is_error():
            self.problem = f"constrained output failed: {self._m.get_error()}"
        elif not row.any():
            self.problem = (
                "constrained output failed: no token of the vocabulary can continue the "
                f"grammar (its state: {self._m.stop_reason()})"
            )
        return self.problem is None

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar is complete (nothing may follow)."""
        if not self._m.consume_token(token):
            self.problem = f"constrained output failed at token {token}: {self._m.get_error()}"
            return False
        return self._m.is_stopped()


class Grammars:
    """The engine's constrained requests: request id -> GrammarMatcher, plus the compiler."""

    def __init__(self, tokenizer: Tokenizer | None, model_vocab: int, eos_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.words = -(-model_vocab // 32)
        # lm_head may have more rows than the tokenizer has ids (padded to a multiple of 64 or
        # 128): those rows are never allowed.
        n_ids = min(tokenizer.vocab_size, model_vocab) if tokenizer is not None else 0
        bits = np.zeros(self.words * 32, dtype=np.uint8)
        bits[:n_ids] = 1
        self._valid = np.packbits(bits, bitorder="little").view(np.int32)  # [W]
        self._compiler: GrammarCompiler | None = None  # built by the first constrained request
        self._matchers: dict[str, GrammarMatcher] = {}

    def add(self, request_id: str, constraint: Constraint) -> None:
        """Register a request's grammar; raises before the request exists if it cannot run."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "constrained output needs the model's tokenizer (tokenizer.json), which this "
                "model folder lacks"
            )
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.eos_ids)
        self._matchers[request_id] = GrammarMatcher(self._compiler.matcher(constraint), self._valid)

    def masks(self, request_ids: Iterable[str]) -> dict[str, np.ndarray]:
        """Packed allowed-id rows ([W] int32) of the constrained requests among `request_ids`.
        A request whose grammar allows nothing gets no row; `problem` then says why."""
        out = {}
        for rid in request_ids:
            m = self._matchers.get(rid)
            if m is None or m.problem is not None:
                continue
            row = np.empty(self.words, dtype=np.int32)
            if m.fill(row):
                out[rid] = row
        return out

    def problem(self, request_id: str) -> str | None:
        m = self._matchers.get(request_id)
        return None if m is None else m.problem

    def advance(self, request_id: str, token: int) -> bool:
        """True when the request's JSON is complete (False for unconstrained requests)."""
        m = self._matchers.get(request_id)
        return m is not None and m.advance(token)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)


def allows(row: np.ndarray, token: int) -> bool:
    """Whether a packed mask row ([W] int32, bit i of word w: id 32 w + i) allows `token`."""
    return token < 32 * len(row) and bool((int(row[token >> 5]) >> (token & 31)) & 1)


def allows_only(row: np.ndarray, ids: Iterable[int]) -> bool:
    """Whether a packed mask row ([W] int32, bit i of word w: id 32 w + i) allows no id
    outside `ids` (ids past the row are ignored)."""
    rest = row.view(np.uint32).copy()  # unsigned: bit 31 is a plain bit
    for t in ids:
        if t < 32 * len(rest):
            rest[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return not rest.any()


def allowed_tokens(
    request_ids: Sequence[str], masks: Mapping[str, np.ndarray], vocab: int, device: torch.device
) -> torch.Tensor | None:  # [B, V] bool, or None when no row is constrained
    """The sampler's mask: one row per sampling request, all True for unconstrained ones."""
    if not any(rid in masks for rid in request_ids):
        return None
    words = -(-vocab // 32)
    packed = np.full((len(request_ids), words), -1, dtype=np.int32)  # [B, W]
    for i, rid in enumerate(request_ids):
        if rid in masks:
            packed[i] = masks[rid]
    host = torch.from_numpy(packed)
    if device.type == "cuda":  # a pageable copy waits for everything queued: under overlap
        host = host.pin_memory()  # scheduling, the decode step just launched (device_index.py)
    bits = host.to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = (bits[:, :, None] >> shifts) & 1  # [B, W, 32]: bit i of word w is id 32 w + i
    return allowed.reshape(len(request_ids), words * 32)[:, :vocab].bool()


def tool_arguments_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments, from an OpenAI tool ({"type": "function",
    "function": {...}}) or a bare function ({"name": ..., "parameters": {...}})."""
    fn = tool.get("function", tool) if tool.get("type") == "function" else tool
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"a tool needs a function with a name, got {tool!r:.100}")
    params = fn.get("parameters")
    if params is None:  # a tool without parameters takes an empty object
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, Mapping):
        raise InvalidRequestError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
    if "properties" in params and "type" not in params:
        # Arguments are an object (OpenAI's and MCP's rule); without the type a schema that
        # lists properties still admits `true` or a number, which a forced call could write.
        return {"type": "object", **params}
    return dict(params)


def tool_call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of one call of `tool`: {"name": <its name>, "arguments": {...}}, in that
    order (llguidance writes properties in the order given)."""
    fn = tool.get("function", tool) if tool.get("type") == "function" else tool
    arguments = tool_arguments_schema(tool)
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
