"""FTW: FreeToken's expert-bank checkpoint format.

An FTW folder is an HF folder whose routed experts were moved out of safetensors into two raw
banks, flattened by logical id `lid = moe_layer * n_experts + expert`, each expert contiguous:

    experts.w13.bin   [L*E, 2I, H]   gate rows 0..I-1, then up rows I..2I-1
    experts.w2.bin    [L*E, H, I]    down
    dense.safetensors every other tensor, under its HF name
    ftw.json          manifest: format version, shapes, the banks' dtype (the source experts',
                      which the load casts), per-expert CRC32 of each bank
    config.json, tokenizer files, generation_config.json: copied as they are

This is the layout of the expert pool and of the GPU slots, so loading is one memory map per
bank (no per-tensor Python work) and a slot fill is one contiguous copy per bank. Conversion
streams one tensor at a time: peak memory is one tensor, not the checkpoint (the dense tensors
are copied byte for byte into dense.safetensors, safetensors_stream.py).

Integrity: every load checks what costs nothing (the manifest's fields, shapes and dtype, the
file sizes). The rows' CRC32s are read back by `convert`, by `freetoken verify DIR` (`bad_rows`)
and, when asked (EngineConfig.verify_checksums), by the load as it copies the rows.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from freetoken_agent.engine.config import ModelSpec, read_config
from freetoken_agent.engine.models.base import MoeCausalLM
from freetoken_agent.engine.models.registry import family, spec_from_config
from freetoken_agent.engine.weights import ftw_dense, safetensors_stream
from freetoken_agent.engine.weights.disk_files import allocate, synced
from freetoken_agent.engine.weights.loader import (
    CheckpointError,
    load_safetensors,
    name_pattern,
    opened,
    safetensors_files,
    untie_differing_head,
)
from freetoken_agent.engine.weights.names import Expert, FusedExperts

# L MoE layers, E experts per layer, I expert width, H hidden

FORMAT = "freetoken-ftw"
VERSION = 1
MANIFEST = "ftw.json"
PARTIAL_MARK = ".freetoken-convert"  # in DST.partial while convert writes it: the folder is ours
BANKS = ("w13", "w2")
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
COPIED_FOLDERS = ("additional_chat_templates",)  # named templates (tool_use.jinja, ...)


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


def _expert_rows(spec: ModelSpec) -> list[tuple]:
    """(name template, target) rows of the family's routed expert tensors."""
    table = family(spec.arch).CHECKPOINT_NAMES
    return [(t, tgt) for t, tgt in table if isinstance(tgt, (Expert, FusedExperts))]


def _expert_targets(spec: ModelSpec) -> list[tuple]:
    """(regex, target) pairs of the family's expert names."""
    return [(name_pattern(t), tgt) for t, tgt in _expert_rows(spec)]


def _expert_names(spec: ModelSpec) -> str:
    """The family's expert tensor names, for an error that says what convert looked for."""
    return ", ".join(t for t, _ in _expert_rows(spec))


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
    """Write the FTW form of HF folder `src` into `dst` (created; must not exist). The banks
    are read back from the disk and checked against their CRC32s before `dst` appears. The
    work goes to `DST.partial`, removed again when the conversion fails."""
    src, dst = Path(src), Path(dst)
    if is_ftw(src):
        raise CheckpointError(f"{src} is already an FTW checkpoint ({MANIFEST}): load it as it is")
    spec = spec_from_config(read_config(src))
    if not spec.moe_layers:
        raise CheckpointError(f"{src} has no MoE layers: nothing to put in expert banks")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; choose a new folder for the FTW checkpoint")
    with _only_writer(dst):
        return _convert(src, dst, spec, progress)


@contextlib.contextmanager
def _only_writer(dst: Path) -> Iterator[None]:
    """Held while convert writes `dst`: a second convert to it is refused by name (it took the
    first's DST.partial for a dead run's leftover and deleted it under the first, and both
    failed, the first blaming the disk). An advisory lock on DST.lock, where fcntl exists."""
    try:
        import fcntl
    except ImportError:  # not POSIX: unguarded, as before
        yield
        return
    lock_path = dst.with_name(dst.name + ".lock")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise FileExistsError(f"another convert is writing {dst}; wait for it to end, or "
                                  "choose another destination") from None  # fmt: skip
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)


def _convert(src: Path, dst: Path, spec: ModelSpec, progress: bool) -> Path:
    """convert's work once `dst` is ours to write."""
    if dst.exists():  # written by a convert that ended while this one waited to start
        raise FileExistsError(f"{dst} exists; choose a new folder for the FTW checkpoint")
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.exists():
        # Only a folder this function made (its mark inside: one a crash or a kill left) is
        # ours to delete; anything else under that name may be someone's data.
        if not (tmp / PARTIAL_MARK).is_file():
            raise FileExistsError(
                f"{tmp} exists and is not a conversion's leftover; move it away or choose "
                "another destination"
            )
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        with _signals_raise():
            (tmp / PARTIAL_MARK).write_text(f"freetoken convert {src} -> {dst}\n")
            _write(src, tmp, spec, progress)
            (tmp / PARTIAL_MARK).unlink()
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a conversion (`timeout`, `docker stop`, a closed terminal);
    `signum` gives the exit status (128 + it, as the signal's default action would)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"convert stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise (Terminated) while convert writes, so its cleanup removes
    DST.partial, as for Ctrl-C: their default action ended the process and left the banks'
    full size on disk. Only where they can be caught (the main thread, not Windows)."""
    wanted = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, stop) for sig in wanted}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_dense(src: Path, spec: ModelSpec, files: list[Path]) -> None:
    """The load's strict checks of the dense tensors (none unexpected or missing, shapes, float
    dtypes), from the files' headers, on a model on the meta device (nothing allocated or
    read), before anything is written: convert copies the dense tensors byte for byte, so a
    folder the load refuses made an FTW folder the load refused too, after the whole
    conversion (the experts are checked as their banks are written)."""
    fam = family(spec.arch)
    spec = untie_differing_head(spec, files, fam.CHECKPOINT_NAMES)  # as the load reads the head
    with torch.device("meta"):
        model = MoeCausalLM(spec, fam.blueprint(spec), None, 1, spec.dtype)
    load_safetensors(src, spec, model, None, fam.CHECKPOINT_NAMES, False, files, headers_only=True)


def _write(src: Path, tmp: Path, spec: ModelSpec, progress: bool) -> None:
    """Convert's work: the banks, dense tensors, manifest and copied files, into `tmp`."""
    shapes = bank_shapes(spec)
    patterns = _expert_targets(spec)
    files = safetensors_files(src)
    dense, experts = _source_tensors(src, files, patterns)  # from the files' headers
    if not experts:
        raise CheckpointError(
            f"no routed expert tensors in {src} under the names {spec.arch} checkpoints use "
            f"({_expert_names(spec)}); tensors named like experts: "
            f"{[n for n in dense if 'expert' in n][:4] or 'none'} (is config.json's model_type "
            f"{spec.arch!r} right for these weights?)"
        )
    _check_dense(src, spec, files)
    dtype = _bank_dtype({name: kind for name, (kind, _) in experts.items()})
    itemsize = dtype.itemsize
    for b in BANKS:  # the disk's blocks first: a full disk is an OSError here, not a SIGBUS
        allocate(tmp / f"experts.{b}.bin", _numel(shapes[b]) * itemsize)  # in a mapped write
    _room_for_the_rest(src, tmp, sum(p.size for p in dense.values()))
    banks = {b: torch.from_file(str(tmp / f"experts.{b}.bin"), shared=True,
                                size=_numel(shapes[b]), dtype=dtype).view(shapes[b])
             for b in BANKS}  # fmt: skip
    filled = {b: torch.zeros(shapes[b][0], dtype=torch.uint8) for b in BANKS}  # part bits
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress)
    with bar:
        for path in files:
            with opened(path) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name not in experts:  # a dense tensor: copied below, byte for byte
                        continue
                    hit = experts[name][1]
                    tensor = f.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    match, target = hit
                    layer = int(match.group("L"))
                    expert = int(match.group("E")) if "E" in match.groupdict() else None
                    if expert is None and tensor.shape[0] != spec.n_experts:
                        # Fused [E, ...]: more rows were dropped silently, fewer ran past them
                        raise CheckpointError(
                            f"tensor {name} holds {tensor.shape[0]} experts, but config.json "
                            f"gives {spec.n_experts} a layer"
                        )
                    if layer not in spec.moe_layers:
                        raise CheckpointError(f"expert tensor {name} in non-MoE layer {layer}")
                    if expert is not None and expert >= spec.n_experts:  # it would fill
                        # another layer's rows (or run past the bank)
                        raise CheckpointError(
                            f"expert tensor {name}: expert {expert}, but config.json gives "
                            f"{spec.n_experts} experts a layer"
                        )
                    for slot, k in _where(spec, target, layer, expert):
                        part = tensor if expert is not None else tensor[k]
                        view = banks[slot.bank][slot.lid]
                        view = view if slot.rows is None else view[slot.rows]
                        if tuple(part.shape) != tuple(view.shape):
                            raise CheckpointError(
                                f"tensor {name} has shape {tuple(part.shape)}, "
                                f"the bank expects {tuple(view.shape)}"
                            )
                        if filled[slot.bank][slot.lid] & slot.part:  # two layouts of it:
                            raise CheckpointError(  # the one read last won, silently
                                f"tensor {name} writes expert row {slot.lid} of bank "
                                f"{slot.bank}, which another tensor of {src} wrote: keep one "
                                "layout of the experts"
                            )
                        view.copy_(part)
                        filled[slot.bank][slot.lid] |= slot.part
        missing = [
            f"{b}[{lid}]" for b in BANKS for lid in (filled[b] != FULL).nonzero().flatten().tolist()
        ]
        if missing:
            raise CheckpointError(
                f"{len(missing)} expert rows missing in {src}: {missing[:8]} (row = MoE layer x "
                f"{spec.n_experts} + expert; read under the names {_expert_names(spec)})"
            )
        pieces = list(dense.values())
        safetensors_stream.write(tmp / "dense.safetensors", pieces, {"format": "pt"}, bar.update)
    synced(tmp / "dense.safetensors")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "arch": spec.arch,
        "dtype": str(dtype).removeprefix("torch."),
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
        ftw_dense.FIELD: ftw_dense.file_crc32(tmp / "dense.safetensors"),
        ftw_dense.FILES: ftw_dense.copied_crc32s(tmp, _copy_files(src, tmp)),
    }
    del banks, view  # the last views too: unmapped, so the pages can leave the cache
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    synced(tmp / MANIFEST)
    for b in BANKS:
        synced(tmp / f"experts.{b}.bin")
    verify(tmp, spec, progress)  # read back: a damaged write fails here, not at the first load


def _expert_match(patterns: list[tuple], name: str) -> tuple | None:
    """(the name's match, its bank target) where `name` is a routed expert's tensor."""
    return next(((m, t) for p, t in patterns if (m := p.match(name))), None)


def _source_tensors(
    src: Path, files: list[Path], patterns: list[tuple]
) -> tuple[dict[str, safetensors_stream.Piece], dict[str, tuple[str, tuple]]]:
    """From the files' headers alone, before the expert pass: every tensor but the routed
    experts by name (the disk's room for them is checked before the pass), and each routed
    expert tensor's safetensors dtype (the banks take theirs) and its name's match and bank
    target (`_expert_match`, for the pass)."""
    dense: dict[str, safetensors_stream.Piece] = {}
    experts: dict[str, tuple[str, tuple]] = {}
    for path in files:
        header, data_start = safetensors_stream.read_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            hit = _expert_match(patterns, name)
            if hit is not None:
                experts[name] = (entry["dtype"], hit)
                continue
            if name in dense:
                raise CheckpointError(f"tensor {name} is in two files of {src}")
            dense[name] = safetensors_stream.Piece.of(path, name, header, data_start)
    return dense, experts


# safetensors' names of the float dtypes an expert bank may hold
BANK_DTYPES = {k: getattr(torch, v) for k, v in safetensors_stream.FLOAT_DTYPES.items()}


def _bank_dtype(experts: dict[str, str]) -> torch.dtype:
    """The banks' dtype: the expert tensors' own, not config.json's. A checkpoint saved in
    fp32 under a bf16 config was rounded into bf16 banks (and bf16 experts under an fp16
    config overflowed to inf): the FTW folder then loaded as another model than the folder
    it came from. The load casts to the dtype it runs in, as it does from an HF folder.
    Experts of several dtypes: the widest (bf16 with fp16: fp32, which holds both)."""
    for name, kind in experts.items():
        if kind not in BANK_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {kind}; expected a float tensor")
    kinds = {BANK_DTYPES[k] for k in experts.values()}
    if len(kinds) == 1:
        return kinds.pop()
    return torch.float64 if torch.float64 in kinds else torch.float32


def _room_for_the_rest(src: Path, tmp: Path, dense_bytes: int) -> None:
    """Refuse before the expert pass (minutes on a large model) when the disk, its banks
    reserved, has no room left for the dense file and the copied files: that failure came
    only after the pass."""
    copied = sum((src / name).stat().st_size for name in _copied_names(src))
    needed = dense_bytes + copied + (1 << 20)  # + the headers and the manifest
    free = shutil.disk_usage(tmp).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"{tmp.parent}: no room for the dense weights and files ({needed / 1e9:.2f} GB "
            f"needed beside the expert banks, {free / 1e9:.2f} GB free)",
        )


def _copied_names(src: Path) -> list[str]:
    """The files of COPIED and COPIED_FOLDERS that `src` holds, as paths inside it."""
    names = [name for name in COPIED if (src / name).is_file()]
    for folder in COPIED_FOLDERS:
        if (src / folder).is_dir():
            names += sorted(
                str(p.relative_to(src)) for p in (src / folder).rglob("*") if p.is_file()
            )
    return names


def _copy_files(src: Path, tmp: Path) -> list[str]:
    """Copy COPIED and COPIED_FOLDERS' files from `src`; their paths inside `tmp`."""
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    for name in COPIED_FOLDERS:
        if (src / name).is_dir():
            shutil.copytree(src / name, tmp / name)
    return _copied_names(tmp)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _row_crcs(bank: torch.Tensor) -> list[int]:
    """CRC32 of each row of a contiguous bank (slice): zlib reads the rows in place, no copy."""
    raw = bank.reshape(bank.shape[0], -1).view(torch.uint8).numpy()
    return [zlib.crc32(row) for row in raw]


def mismatched(rows: torch.Tensor, crcs: list[int], first: int = 0) -> list[int]:
    """Row indices (counted from `first`, the slice's first row) whose CRC32 is not crcs[i]."""
    return [first + r for r, crc in enumerate(_row_crcs(rows)) if crc != crcs[first + r]]


def checksum_error(folder: str | Path, bad: dict[str, list[int]]) -> CheckpointError:
    """The error naming each bank's rows that fail their checksum (lids)."""
    parts = [
        f"FTW bank {b}: {len(rows)} expert rows fail their checksum: {rows[:8]}"
        + (f" and {len(rows) - 8} more" if len(rows) > 8 else "")
        for b, rows in bad.items()
        if rows
    ]
    return CheckpointError(
        "; ".join(parts) + f" (in {folder}: damaged on disk or in transit; convert it again, "
        "`freetoken verify` lists every bad row)"
    )


_JSON = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def _field(where: Path, obj: object, key: str, kind: type, prefix: str = "") -> object:
    """obj[key] when obj is a dict and the value a `kind`, else a CheckpointError naming the
    manifest and the field (a damaged manifest must not crash with a KeyError)."""
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointError(f"{where}: field '{prefix}{key}' is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        found = _JSON.get(type(value), "null" if value is None else type(value).__name__)
        raise CheckpointError(
            f"{where}: field '{prefix}{key}' should be {_JSON[kind]}, found {found}"
        )
    return value


def read_manifest(folder: str | Path, spec: ModelSpec) -> dict:
    """The manifest, checked against the model and the files beside it: every field, the bank
    shapes, the dtype, the file sizes (cheap: at every load). The rows' CRC32s are checked by
    `verify` (a full read of the banks)."""
    folder = Path(folder)
    where = folder / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict):
        found = _JSON.get(type(manifest), type(manifest).__name__)
        raise CheckpointError(f"{where} should hold a JSON object, found {found}")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{where}: format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this FreeToken reads {FORMAT!r} version {VERSION}"
        )
    # The banks hold the source's expert dtype (the load casts them): a dtype and item size
    # that disagree would be reinterpreted bit by bit (NaN logits), or mapped past their end.
    dtype = _field(where, manifest, "dtype", str)
    itemsize = _field(where, manifest, "itemsize", int)
    known = {str(d).removeprefix("torch."): d for d in BANK_DTYPES.values()}
    if dtype not in known or known[dtype].itemsize != itemsize:
        raise CheckpointError(
            f"{where}: the banks hold {dtype!r} in {itemsize}-byte items; expected one of "
            f"{', '.join(f'{n} ({d.itemsize}-byte)' for n, d in known.items())}: convert the "
            "HF folder again"
        )
    banks = _field(where, manifest, "banks", dict)
    for b, shape in bank_shapes(spec).items():
        entry = _field(where, banks, b, dict, "banks.")
        file = _field(where, entry, "file", str, f"banks.{b}.")
        if tuple(_field(where, entry, "shape", list, f"banks.{b}.")) != shape:
            raise CheckpointError(
                f"FTW bank {b} has shape {entry['shape']}; config.json implies {shape}"
            )
        crcs = _field(where, entry, "crc32", list, f"banks.{b}.")
        ints = all(type(c) is int for c in crcs)
        if len(crcs) != shape[0] or not ints:
            raise CheckpointError(
                f"{where}: field 'banks.{b}.crc32' should hold {shape[0]} integers (one per "
                f"expert row), found {len(crcs)} entries" + ("" if ints else ", not all integers")
            )
        path = folder / file
        want = _numel(shape) * itemsize
        if not path.is_file() or path.stat().st_size != want:
            size = path.stat().st_size if path.is_file() else "no file"
            raise CheckpointError(f"FTW bank {path} should hold {want} bytes, found {size}")
    dense = folder / _field(where, manifest, "dense", str)
    if not dense.is_file():
        raise CheckpointError(f"{dense} (the dense weights, named in {where}) does not exist")
    return manifest


def open_banks(folder: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Memory-map the banks (read-only, pages load on first touch): {"w13": [L*E, 2I, H],
    "w2": [L*E, H, I]} in the dtype they were written in (the source's experts')."""
    folder = Path(folder)
    manifest = read_manifest(folder, spec)
    dtype = getattr(torch, manifest["dtype"])  # (checked: one of BANK_DTYPES)
    return {
        b: torch.from_file(
            str(folder / manifest["banks"][b]["file"]),
            shared=False,
            size=_numel(shape),
            dtype=dtype,
        ).view(shape)
        for b, shape in bank_shapes(spec).items()
    }


def bad_rows(folder: str | Path, spec: ModelSpec, progress: bool = False) -> dict[str, list[int]]:
    """The rows (lids) of each bank that fail their CRC32: a full read of the banks, on one
    thread at zlib's speed (EngineConfig.verify_checksums)."""
    manifest = read_manifest(folder, spec)
    banks = open_banks(folder, spec)
    total = sum(b.nbytes for b in banks.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verifying", disable=not progress)
    bad: dict[str, list[int]] = {}
    with bar:
        for b, bank in banks.items():
            crcs, bad[b] = manifest["banks"][b]["crc32"], []
            step = max(1, (256 << 20) // max(1, bank[0].nbytes))  # ~256 MB at a time
            for lo in range(0, bank.shape[0], step):
                bad[b] += mismatched(bank[lo : lo + step], crcs, lo)
                bar.update(bank[lo : lo + step].nbytes)
    return bad


def verify(folder: str | Path, spec: ModelSpec, progress: bool = False) -> None:
    """Check every expert row against its CRC32 (a full read of the banks), and the dense file
    (ftw_dense.py); a CheckpointError names the rows, or the file, that fail. `progress`: a
    "verifying" bar (convert's read back is a second pass over the banks)."""
    bad = bad_rows(folder, spec, progress)
    if any(bad.values()):
        raise checksum_error(folder, bad)
    problem = ftw_dense.file_problem(Path(folder), read_manifest(folder, spec))
    if problem is not None:
        raise CheckpointError(problem)
