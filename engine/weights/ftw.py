"""FTW: FreeToken's expert-bank checkpoint format.

An FTW folder is an HF folder whose routed experts were moved out of safetensors into two raw
banks, flattened by logical id `lid = moe_layer * n_experts + expert`, each expert contiguous:

    experts.w13.bin   [L*E, 2I, H]   gate rows 0..I-1, then up rows I..2I-1
    experts.w2.bin    [L*E, H, I]    down
    dense.safetensors every other tensor, under its HF name
    ftw.json          manifest: format version, shapes, dtype, per-expert CRC32 of each bank
    config.json, tokenizer files, generation_config.json: copied as they are

This is the layout of the expert pool and of the GPU slots, so loading is one memory map per
bank (no per-tensor Python work) and a slot fill is one contiguous copy per bank. Conversion
streams one tensor at a time: peak memory is one tensor, not the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from freetoken_agent.engine.config import ModelSpec, read_config
from freetoken_agent.engine.models.registry import family, spec_from_config
from freetoken_agent.engine.weights.loader import CheckpointError, name_pattern, safetensors_files
from freetoken_agent.engine.weights.names import Expert, FusedExperts

# L MoE layers, E experts per layer, I expert width, H hidden

FORMAT = "freetoken-ftw"
VERSION = 1
MANIFEST = "ftw.json"
BANKS = ("w13", "w2")
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def is_ftw(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def bank_shapes(spec: ModelSpec) -> dict[str, tuple[int, int, int]]:
    n = spec.n_moe_layers * spec.n_experts
    h, i = spec.hidden_size, spec.moe_intermediate_size
    return {"w13": (n, 2 * i, h), "w2": (n, h, i)}


@dataclass(slots=True)
class _Slot:
    """Where one HF expert tensor lands: bank, row, and the part of the row."""

    bank: str
    lid: int
    rows: slice | None  # gate / up rows within w13[lid]; None: the whole row
    part: int  # bit of the row this fills: gate 1, up 2, a whole row 3


FULL = 3  # both parts of a row written


def _expert_targets(spec: ModelSpec) -> list[tuple]:
    """(regex, target) pairs of the family's expert names."""
    table = family(spec.arch).CHECKPOINT_NAMES
    return [(name_pattern(t), tgt) for t, tgt in table if isinstance(tgt, (Expert, FusedExperts))]


def _where(spec: ModelSpec, target, layer: int, expert: int | None) -> list[tuple[_Slot, int]]:
    """Bank slots of an expert tensor; for fused tensors one per expert (with its index)."""
    i = spec.moe_intermediate_size
    rows = {"gate": slice(0, i), "up": slice(i, 2 * i), "gate_up": None, "down": None}
    part = {"gate": 1, "up": 2}.get(target.proj, FULL)
    bank = "w2" if target.proj == "down" else "w13"
    moe = spec.moe_index(layer)
    experts = [expert] if expert is not None else list(range(spec.n_experts))
    return [
        (_Slot(bank, moe * spec.n_experts + e, rows[target.proj], part), k)
        for k, e in enumerate(experts)
    ]


def convert(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """Write the FTW form of HF folder `src` into `dst` (created; must not exist)."""
    src, dst = Path(src), Path(dst)
    spec = spec_from_config(read_config(src))
    if not spec.moe_layers:
        raise CheckpointError(f"{src} has no MoE layers: nothing to put in expert banks")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; choose a new folder for the FTW checkpoint")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    itemsize = torch.tensor([], dtype=spec.dtype).element_size()
    shapes = bank_shapes(spec)
    banks = {b: torch.from_file(str(tmp / f"experts.{b}.bin"), shared=True,
                                size=_numel(shapes[b]), dtype=spec.dtype).view(shapes[b])
             for b in BANKS}  # fmt: skip
    filled = {b: torch.zeros(shapes[b][0], dtype=torch.uint8) for b in BANKS}  # part bits
    patterns = _expert_targets(spec)
    dense: dict[str, torch.Tensor] = {}
    files = safetensors_files(src)
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress)
    with bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = f.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    hit = next(((m, t) for p, t in patterns if (m := p.match(name))), None)
                    if hit is None:
                        dense[name] = tensor
                        continue
                    match, target = hit
                    layer = int(match.group("L"))
                    expert = int(match.group("E")) if "E" in match.groupdict() else None
                    if layer not in spec.moe_layers:
                        raise CheckpointError(f"expert tensor {name} in non-MoE layer {layer}")
                    for slot, k in _where(spec, target, layer, expert):
                        part = tensor if expert is not None else tensor[k]
                        view = banks[slot.bank][slot.lid]
                        view = view if slot.rows is None else view[slot.rows]
                        if tuple(part.shape) != tuple(view.shape):
                            raise CheckpointError(
                                f"tensor {name} has shape {tuple(part.shape)}, "
                                f"the bank expects {tuple(view.shape)}"
                            )
                        view.copy_(part)
                        filled[slot.bank][slot.lid] |= slot.part
    missing = [
        f"{b}[{lid}]" for b in BANKS for lid in (filled[b] != FULL).nonzero().flatten().tolist()
    ]
    if missing:
        raise CheckpointError(f"{len(missing)} expert rows missing in {src}: {missing[:8]}")
    save_file(dense, str(tmp / "dense.safetensors"), metadata={"format": "pt"})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "arch": spec.arch,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "itemsize": itemsize,
        "n_moe_layers": spec.n_moe_layers,
        "n_experts": spec.n_experts,
        "banks": {
            b: {
                "file": f"experts.{b}.bin",
                "shape": list(shapes[b]),
                "crc32": _row_crcs(banks[b]),
            }
            for b in BANKS
        },
        "dense": "dense.safetensors",
    }
    del banks
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    os.replace(tmp, dst)
    return dst


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _row_crcs(bank: torch.Tensor) -> list[int]:
    raw = bank.view(bank.shape[0], -1).view(torch.uint8)
    return [zlib.crc32(raw[r].numpy().tobytes()) for r in range(bank.shape[0])]


def read_manifest(folder: str | Path, spec: ModelSpec) -> dict:
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder / MANIFEST} is not valid JSON: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{folder / MANIFEST}: format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this FreeToken reads {FORMAT!r} version {VERSION}"
        )
    for b, shape in bank_shapes(spec).items():
        entry = manifest["banks"][b]
        if tuple(entry["shape"]) != shape:
            raise CheckpointError(
                f"FTW bank {b} has shape {entry['shape']}; config.json implies {shape}"
            )
        path = folder / entry["file"]
        want = _numel(shape) * manifest["itemsize"]
        if not path.is_file() or path.stat().st_size != want:
            size = path.stat().st_size if path.is_file() else "no file"
            raise CheckpointError(f"FTW bank {path} should hold {want} bytes, found {size}")
    return manifest


def open_banks(folder: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Memory-map the banks (read-only, pages load on first touch): {"w13": [L*E, 2I, H],
    "w2": [L*E, H, I]} in the checkpoint dtype."""
    folder = Path(folder)
    manifest = read_manifest(folder, spec)
    return {
        b: torch.from_file(
            str(folder / manifest["banks"][b]["file"]),
            shared=False,
            size=_numel(shape),
            dtype=spec.dtype,
        ).view(shape)
        for b, shape in bank_shapes(spec).items()
    }


def verify(folder: str | Path, spec: ModelSpec) -> None:
    """Check every expert row against its CRC32 (a full read of the banks)."""
    manifest = read_manifest(folder, spec)
    for b, bank in open_banks(folder, spec).items():
        bad = [
            r for r, crc in enumerate(_row_crcs(bank)) if crc != manifest["banks"][b]["crc32"][r]
        ]
        if bad:
            raise CheckpointError(
                f"FTW bank {b}: {len(bad)} expert rows fail their checksum: {bad[:8]}"
            )
