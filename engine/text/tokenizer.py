"""Tokenizer: a checkpoint folder's `tokenizers` tokenizer plus what the configs say about it.

Reads, from a Hugging Face model folder:
- `tokenizer.json`: the fast tokenizer itself (required; a missing file is a FileNotFoundError
  naming the path, which the engine catches to run on token ids only);
- `tokenizer_config.json`: named special tokens (strings or {"content": ...} dicts),
  `added_tokens_decoder`, `add_bos_token`, `chat_template`;
- `chat_template.jinja` (wins over the config's template, as in transformers 5) and
  `additional_chat_templates/*.jinja` (named templates).

The ids that end generation beyond the tokenizer's own eos_token (generation_config.json's and
config.json's) are read by engine/loading.py (end_token_ids), whether or not a tokenizer exists.

Encoding runs the tokenizer.json pipeline as is; transformers rebuilds some tokenizer classes
from vocab and merges instead, so a checkpoint whose tokenizer.json disagrees with its class
could tokenize differently there (the tests check the demo checkpoint against transformers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from freetoken_agent.engine.text.chat_template import ChatTemplate
from freetoken_agent.engine.text.token_bytes import TokenBytes

# Named special tokens that chat templates receive as variables, as in transformers 5.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


# Texts longer than this (characters) are encoded through `encode_batch`: tokenizers' `encode`
# holds the GIL for its whole run (seconds for a few MB, stalling the server's event loop and
# the engine thread), `encode_batch` releases it. Same ids and offsets; shorter texts keep the
# plain call, whose overhead is lower.
LONG_TEXT_CHARS = 20_000


def encode_text(
    backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool = False
) -> tokenizers.Encoding:
    """`backend.encode(text)`, releasing the GIL while a long text is encoded."""
    if len(text) > LONG_TEXT_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return backend.encode(text, add_special_tokens=add_special_tokens)


class TokenizerConfigError(ValueError):
    """A tokenizer or config file exists but cannot be used; the message names file and field."""


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path.name} not found: {path}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token given as "text", {"content": "text", ...} or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerConfigError(f"{where}: expected a string or a {{'content': ...}} dict")


def _load_templates(path: Path, config: Mapping[str, Any], where: Path) -> dict[str, str]:
    """All chat templates by name ("default" for the main one)."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        # The older multi-template form: [{"name": ..., "template": ...}, ...]
        for entry in raw:
            if not (isinstance(entry, Mapping) and {"name", "template"} <= entry.keys()):
                raise TokenizerConfigError(
                    f"{where}: chat_template list entries need 'name' and 'template'"
                )
            templates[str(entry["name"])] = str(entry["template"])
    elif raw is not None:
        raise TokenizerConfigError(f"{where}: chat_template must be a string or a list")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool = False,
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        # Padding or truncation saved in tokenizer.json would silently change prompts.
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._ensure_tokens_exist()
        self.bos_token_id = self._named_id("bos_token")
        self.pad_token_id = self._named_id("pad_token")
        self.eos_token_id = self._named_id("eos_token")
        eos = set(extra_eos_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        decoder = backend.get_added_tokens_decoder()
        named = {self.token_to_id(t) for t in self.special_tokens.values()}
        self.special_token_ids: frozenset[int] = frozenset(
            {i for i, tok in decoder.items() if tok.special} | (named - {None})
        )
        # Only prepend bos ourselves when the config asks for it and tokenizer.json's
        # post-processor does not already add it (Llama-style TemplateProcessing does).
        adds_bos = (
            self.bos_token_id is not None
            and self.bos_token_id in backend.encode("", add_special_tokens=True).ids
        )
        self._prepend_bos = add_bos_token and self.bos_token_id is not None and not adds_bos
        # Compiled on first use: a broken template must not stop a model from serving
        # token ids or raw prompts; the error comes when a chat is actually rendered.
        self.chat_template_sources: dict[str, str] = dict(chat_templates or {})
        self._compiled: dict[str, ChatTemplate] = {}
        self._token_bytes: TokenBytes | None = None

    @property
    def token_bytes(self) -> TokenBytes:
        """token id -> the bytes it stands for (token_bytes.py), built once: it reads the
        whole tokenizer spec (~1 s for a 150k vocabulary), so never per request."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.backend)  # (two threads may both build it)
        return self._token_bytes

    # ----------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path} (looked for {tok_file}); "
                "without it the model runs on token ids only"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise TokenizerConfigError(f"{tok_file} cannot be loaded: {e}") from e

        cfg_file = path / "tokenizer_config.json"
        config = _read_json(cfg_file)
        special: dict[str, str] = {}
        for key, value in config.items():
            # Named tokens plus model-specific ones such as "image_token"; transformers passes
            # both to the template. Other "*_token" keys (add_bos_token: true) are not tokens.
            custom = key.endswith("_token") and isinstance(value, (str, Mapping))
            if key in NAMED_SPECIAL_TOKENS or custom:
                content = _token_content(value, f"{cfg_file}: {key}")
            else:
                content = None
            if content is not None:
                special[key] = content
        _add_declared_tokens(backend, config.get("added_tokens_decoder"), cfg_file)

        add_bos = config.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise TokenizerConfigError(f"{cfg_file}: add_bos_token must be true or false")

        return cls(
            backend,
            special_tokens=special,
            add_bos_token=add_bos,
            chat_templates=_load_templates(path, config, cfg_file),
        )

    def _ensure_tokens_exist(self) -> None:
        # Every special token named in the config is a special added token, as transformers
        # makes it: one absent from the vocabulary is added; one that is an ordinary piece of
        # the model's vocabulary (an export that lists only some control tokens as added) is
        # registered at its id, so that "</s>" in text encodes to it, not to "<", "/s", ">",
        # and decoding skips it as the streaming detokenizer does.
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        named = [t for t in dict.fromkeys(self.special_tokens.values()) if t not in added]
        if named:
            self.backend.add_special_tokens(
                [tokenizers.AddedToken(t, special=True, normalized=False) for t in named]
            )

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    # ----------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds bos (etc.) when the model wants it."""
        ids = encode_text(self.backend, text, add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = False
    ) -> tuple[list[int], list[int]]:
        """`encode(text)` and where each token's text starts in `text` (characters; the
        legacy completions' text_offset of an echoed prompt). A token the tokenizer added
        (bos) spans nothing of the text: it starts where the text before it ends."""
        encoding = encode_text(self.backend, text, add_special_tokens)
        ids, offsets, reach = list(encoding.ids), [], 0
        for start, end in encoding.offsets:
            offsets.append(start if end > start else reach)
            reach = max(reach, end)
        if add_special_tokens and self._prepend_bos:
            ids, offsets = [self.bos_token_id, *ids], [0, *offsets]
        return ids, offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ----------------------------------------------------------------- chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template_sources)

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The default template, compiled (None when the model has none)."""
        if "default" not in self.chat_template_sources:
            return None
        return self.get_chat_template("default")

    def get_chat_template(self, name: str | None = None, tools: Any = None) -> ChatTemplate:
        """The template to use: `name` if given, else "tool_use" when tools are passed and the
        model has one, else "default"."""
        sources = self.chat_template_sources
        if name is None:
            if tools is not None and "tool_use" in sources:
                name = "tool_use"
            elif "default" in sources:
                name = "default"
            elif sources:
                raise ValueError(
                    "this model has several chat templates and no default; pick one of "
                    f"{sorted(sources)}"
                )
            else:
                raise ValueError(
                    "this model has no chat template (no chat_template in tokenizer_config.json "
                    "and no chat_template.jinja); pass token ids or plain text instead"
                )
        if name not in sources:
            raise ValueError(f"no chat template named {name!r}; this model has {sorted(sources)}")
        if name not in self._compiled:
            self._compiled[name] = ChatTemplate(sources[name], self.special_tokens)
        return self._compiled[name]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation (render only; `encode` it to get ids, without
        special tokens: a template writes its own bos, and `Engine.generate(str)` encodes a
        string with them, as a raw prompt, so the text given there would get two)."""
        template = self.get_chat_template(template_name, tools)
        return template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _add_declared_tokens(backend: tokenizers.Tokenizer, declared: Any, where: Path) -> None:
    """Add tokens from tokenizer_config's `added_tokens_decoder` missing in tokenizer.json."""
    if declared is None:
        return
    if not isinstance(declared, Mapping):
        raise TokenizerConfigError(f"{where}: added_tokens_decoder must be an object")
    entries: list[tuple[int, Mapping[str, Any]]] = []
    for key, value in declared.items():
        if not (str(key).isdigit() and isinstance(value, Mapping)):
            raise TokenizerConfigError(
                f"{where}: added_tokens_decoder entry {key!r} must map an id to a token dict"
            )
        entries.append((int(key), value))
    for token_id, entry in sorted(entries):
        content = _token_content(entry, f"{where}: added_tokens_decoder[{token_id}]")
        if content is None:
            raise TokenizerConfigError(f"{where}: added_tokens_decoder[{token_id}] has no content")
        existing = backend.token_to_id(content)
        if existing is not None:
            if existing != token_id:
                raise TokenizerConfigError(
                    f"{where}: {content!r} is id {token_id} here but {existing} in tokenizer.json"
                )
            continue
        token = tokenizers.AddedToken(
            content,
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not entry.get("special", False))),
            special=bool(entry.get("special", False)),
        )
        backend.add_tokens([token])
        got = backend.token_to_id(content)
        if got != token_id:
            raise TokenizerConfigError(
                f"{where}: added token {content!r} should be id {token_id} but the vocabulary "
                f"gives it id {got}"
            )
