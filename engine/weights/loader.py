"""Streaming, strict loading of an HF safetensors folder into a model and its expert bank.

Streaming: tensors are read one at a time from memory-mapped safetensors files and copied
straight into preallocated parameters / bank rows on the target device, so peak host memory is
one tensor, not the checkpoint. Strict: before anything is read, the name table is expanded into
the full set of tensors the model needs; a name outside it, a wrong shape, or a requirement left
unmet at the end is a `CheckpointError` that names the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.engine.weights.names import Dense, Expert, FusedExperts, Ignore, NameTable

# E experts per layer, I expert width, H hidden, V vocab

log = logging.getLogger("freetoken.load")


class CheckpointError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped tensors."""


def unreadable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable safetensors file ({error}): it is damaged or cut short (an "
        "interrupted download?); fetch or convert it again"
    )


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Any]:
    """safe_open of a checkpoint file: what safetensors cannot read, while opening it or in
    the `with` body, raises CheckpointError naming the file (not a bare SafetensorError)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise unreadable(path, e) from e


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise TypeError("weight_map must map tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e!r:.120})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
    elif (model_dir / "model.safetensors").is_file():
        # As transformers reads a folder: model.safetensors alone, not a stray copy or an
        # adapter beside it (whichever sorted last replaced the weights).
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {model_dir} (only safetensors checkpoints are supported)"
        )
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{index} lists {f.name}, which does not exist")
    return files


class ExpertSink:
    """What the loader needs from an expert bank: a writable view of one projection."""

    def projection(self, layer: int, expert: int, proj: str) -> torch.Tensor: ...


@dataclass(slots=True)
class _Plan:
    """The full set of checkpoint names the model accepts, expanded from the table."""

    targets: dict[str, tuple] = field(default_factory=dict)  # hf name -> (kind, payload)
    requirements: dict[tuple, str] = field(default_factory=dict)  # requirement -> hf name to cite
    ignore: list[re.Pattern] = field(default_factory=list)


def name_pattern(template: str) -> re.Pattern:
    """The regex of a name-table template: {L} and {E} become named digit groups, {*} any
    rest of the name (whole subtrees a family ignores, e.g. a vision tower)."""
    escaped = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(escaped.replace(r"\{\*\}", ".*") + "$")


def _plan(spec: ModelSpec, table: NameTable, params: dict[str, _Param]) -> _Plan:
    plan = _Plan()
    moe_layers = set(spec.moe_layers)
    for template, target in table:
        if isinstance(target, Ignore):
            plan.ignore.append(name_pattern(template))
            continue
        layers = range(spec.n_layers) if "{L}" in template else [None]
        for layer in layers:
            fmt = {"L": layer} if layer is not None else {}
            if isinstance(target, Dense):
                param = target.param.format(**fmt)
                if param not in params:
                    continue  # e.g. a bias this family's layer does not have
                name = template.format(**fmt)
                plan.targets[name] = ("dense", (param, target.shard))
                plan.requirements.setdefault(("dense", param, target.shard), name)
            elif layer in moe_layers:
                moe = spec.moe_index(layer)
                if isinstance(target, Expert):
                    for e in range(spec.n_experts):
                        name = template.format(L=layer, E=e)
                        plan.targets[name] = ("expert", (moe, e, target.proj))
                        plan.requirements.setdefault(("expert", moe, e, target.proj), name)
                elif isinstance(target, FusedExperts):
                    plan.targets[template.format(**fmt)] = ("fused", (moe, target.proj))
    for name, param in params.items():
        for shard in param.shards:
            if ("dense", name, shard) not in plan.requirements:
                raise AssertionError(f"name table has no entry for parameter {name} ({shard})")
    return plan


@dataclass(slots=True)
class _Param:
    tensor: torch.Tensor
    shards: tuple[str | None, ...]  # stacked linears: the shard names; else (None,)
    module: nn.Module


def _dense_params(model: nn.Module) -> dict[str, _Param]:
    """Named parameters (tied weights once), with the shard names of stacked linears."""
    params: dict[str, _Param] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        shards = tuple(getattr(module, "shards", None) or (None,))
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied: lm_head shares the embedding
            seen.add(id(p))
            full = f"{module_name}.{pname}" if module_name else pname
            params[full] = _Param(p.data, shards, module)
    return params


def _view(
    kind: str, payload: tuple, params: dict[str, _Param], bank: ExpertSink | None
) -> torch.Tensor:
    if kind == "dense":
        param_name, shard = payload
        param = params[param_name]
        if shard is None:
            return param.tensor
        return param.module.shard_view(param_name.rsplit(".", 1)[1], shard)
    moe, e, proj = payload
    return bank.projection(moe, e, proj)


def _stream(files: list[Path]) -> Iterator[tuple[str, object, Path]]:
    for path in files:
        with opened(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f, path


def _read(path: Path, read: Any, key: Any) -> Any:
    """`read(key)` from the file at `path`; what safetensors cannot read names that file."""
    try:
        return read(key)
    except SafetensorError as e:
        raise unreadable(path, e) from e


# safetensors' dtype names as torch's, so a header's refusal reads as the load's
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip


@dataclass(slots=True)
class _Header:
    """A tensor as its file's header describes it (safetensors' slice), for `_check_shape`."""

    shape: tuple[int, ...]
    dtype: torch.dtype | str  # safetensors' own name where torch has none

    def is_floating_point(self) -> bool:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype.is_floating_point
        return self.dtype.startswith(("F", "BF"))


def _header(path: Path, handle: Any, name: str) -> _Header:
    view = _read(path, handle.get_slice, name)
    kind = view.get_dtype()
    return _Header(tuple(view.get_shape()), _DTYPES.get(kind, kind))


def load_safetensors(
    model_dir: str | Path,
    spec: ModelSpec,
    model: nn.Module,
    bank: ExpertSink | None,
    table: NameTable,
    progress: bool = True,
    files: list[Path] | None = None,
    experts_elsewhere: bool = False,
    headers_only: bool = False,
) -> None:
    """Fill `model`'s parameters and `bank`'s experts from the folder's safetensors files.
    With experts_elsewhere (FTW folders: experts are in banks), only dense tensors are read
    and expert tensors count as unexpected. With headers_only, nothing is read or filled: the
    dense tensors are checked by these same rules from the files' headers (`model` may be on
    the meta device) and expert tensors are left to the caller (convert checks them as it
    writes its banks: it runs this first, so a folder the load would refuse is refused before
    anything is written)."""
    files = files or safetensors_files(model_dir)
    params = _dense_params(model)
    plan = _plan(spec, table, params)
    if experts_elsewhere or headers_only:
        plan.requirements = {r: n for r, n in plan.requirements.items() if r[0] == "dense"}
    if experts_elsewhere:
        plan.targets = {n: t for n, t in plan.targets.items() if t[0] == "dense"}
    met: dict[tuple, str] = {}  # each weight filled -> the tensor that filled it
    unexpected: list[str] = []
    seen: dict[str, Path] = {}  # name -> the file it came from
    total = sum(f.stat().st_size for f in files)
    # delay: the bar appears only for loads that take more than a moment.
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="loading", delay=1.0, disable=not progress
    )
    with torch.no_grad(), bar:
        for name, handle, path in _stream(files):
            if name in seen:  # two files hold it: which one is the model's is anyone's guess
                raise CheckpointError(f"tensor {name} is in two files of {model_dir}: "
                                      f"{seen[name].name} and {path.name}")  # fmt: skip
            seen[name] = path
            target = plan.targets.get(name)
            if target is None:
                if spec.tie_word_embeddings and name == "lm_head.weight":
                    continue  # a copy of the embeddings (untie_differing_head unties others)
                if not any(p.match(name) for p in plan.ignore):
                    unexpected.append(name)
                continue
            kind, payload = target
            if headers_only:
                if kind == "dense":
                    dst = _view(kind, payload, params, None)
                    _check_shape(name, _header(path, handle, name), tuple(dst.shape), path)
                    _met(met, [(kind, *payload)], name, model_dir)
                continue
            tensor = _read(path, handle.get_tensor, name)  # outside `_stream`'s `opened`
            if kind == "fused":
                filled = _load_fused(name, tensor, payload, spec, bank)
            else:
                dst = _view(kind, payload, params, bank)
                _check_shape(name, tensor, tuple(dst.shape), path)
                dst.copy_(tensor)
                filled = [(kind, *payload)]
            _met(met, filled, name, model_dir)
            bar.update(tensor.numel() * tensor.element_size())
    if unexpected:
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensor(s) in {model_dir}: {_names(unexpected)} "
            f"(is config.json's model_type {spec.arch!r} right for these weights?)"
        )
    missing = [name for req, name in plan.requirements.items() if req not in met]
    if missing:
        raise CheckpointError(f"{len(missing)} missing tensor(s) in {model_dir}: {_names(missing)}")


def _met(met: dict[tuple, str], filled: list[tuple], name: str, model_dir: Any) -> None:
    """Record that tensor `name` filled the weights `filled`."""
    for key in filled:  # two layouts of one weight (a family's names in both forms):
        if key in met:  # the one read last won, silently
            raise CheckpointError(f"tensors {met[key]} and {name} in {model_dir} "
                                  "hold the same weights: keep one layout")  # fmt: skip
        met[key] = name


def untie_differing_head(spec: ModelSpec, files: list[Path], table: NameTable) -> ModelSpec:
    """`spec`, untied when config.json ties the head to the embeddings but the checkpoint
    carries an lm_head.weight that differs from its embedding table.

    transformers 5 ties the two only when both are present and equal, and otherwise keeps the
    checkpoint's head (PreTrainedModel.tie_weights, with a warning). We do the same rather
    than refuse: MoeCausalLM builds a separate head whenever the spec is untied, so it costs
    only the head's memory. Decided before the model is built, so that the budget and the
    host-embedding choice count that head. An equal copy stays tied (the loader skips it)."""
    if not spec.tie_word_embeddings:
        return spec
    embed = Dense("embed_tokens.weight")
    embed_names = {t for t, target in table if target == embed}
    found: dict[str, Path] = {}
    for path in files:
        with opened(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name == "lm_head.weight" or name in embed_names:
                    found[name] = path
    table_name = next((n for n in found if n in embed_names), None)
    if "lm_head.weight" not in found or table_name is None:
        return spec
    if _equal("lm_head.weight", found["lm_head.weight"], table_name, found[table_name]):
        return spec
    log.warning(
        "config.json ties lm_head to the embeddings, but the checkpoint's lm_head.weight differs "
        "from its %s: using the checkpoint's head, untied (as transformers does)",
        table_name,
    )
    return dataclasses.replace(spec, tie_word_embeddings=False)


def _equal(name_a: str, file_a: Path, name_b: str, file_b: Path, rows: int = 4096) -> bool:
    """torch.equal of two checkpoint tensors, compared a few thousand rows at a time so that
    host memory stays far below a table's."""
    # Each read is blamed on its own file (nested `opened`s would name the inner one for a
    # failure of the outer's).
    with opened(file_a) as fa, opened(file_b) as fb:
        sa, sb = _read(file_a, fa.get_slice, name_a), _read(file_b, fb.get_slice, name_b)
        if sa.get_shape() != sb.get_shape():
            return False
        for lo in range(0, sa.get_shape()[0], rows):
            x = _read(file_a, sa.__getitem__, slice(lo, lo + rows))  # [<= rows, H]
            y = _read(file_b, sb.__getitem__, slice(lo, lo + rows))
            if not torch.equal(x, y.to(x.dtype)):
                return False
    return True


def _load_fused(
    name: str, tensor: torch.Tensor, payload: tuple, spec: ModelSpec, bank: ExpertSink
) -> list[tuple]:
    moe, proj = payload
    e, i, h = spec.n_experts, spec.moe_intermediate_size, spec.hidden_size
    shapes = {"gate_up": (e, 2 * i, h), "gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
    _check_shape(name, tensor, shapes[proj], None)
    met = []
    for expert in range(e):
        bank.projection(moe, expert, proj).copy_(tensor[expert])
        for part in ("gate", "up") if proj == "gate_up" else (proj,):
            met.append(("expert", moe, expert, part))
    return met


def _check_shape(
    name: str, tensor: torch.Tensor, expected: tuple[int, ...], path: Path | None
) -> None:
    if tuple(tensor.shape) != expected:
        where = f" in {path.name}" if path else ""
        raise CheckpointError(
            f"tensor {name}{where} has shape {tuple(tensor.shape)}, the model expects {expected}"
        )
    if not (tensor.is_floating_point()):
        raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}; expected a float tensor")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
