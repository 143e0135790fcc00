"""FTW conversion: the banks hold every expert at its lid, loading FTW equals loading HF, and
damaged FTW folders are refused with an error that names the damage."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from tiny_models import FAMILIES, HYBRID_FAMILIES, make_tiny

from freetoken_agent import Engine
from freetoken_agent.engine.config import read_config
from freetoken_agent.engine.models.registry import spec_from_config
from freetoken_agent.engine.weights import ftw, safetensors_stream
from freetoken_agent.engine.weights.loader import CheckpointError


@pytest.mark.parametrize("family", (*FAMILIES, *HYBRID_FAMILIES))
def test_ftw_loads_identically(family, tmp_path, rng_seed):
    hf_dir, ftw_dir = tmp_path / "hf", tmp_path / "ftw"
    hf = make_tiny(family, hf_dir, rng_seed)
    ftw.convert(hf_dir, ftw_dir, progress=False)
    spec = spec_from_config(read_config(ftw_dir))
    ftw.verify(ftw_dir, spec)
    banks = ftw.open_banks(ftw_dir, spec)
    # Spot-check a random expert against transformers' own weights.
    moe_layer = random.Random(rng_seed).choice(spec.moe_layers)
    expert = random.Random(rng_seed + 1).randrange(spec.n_experts)
    lid = spec.moe_index(moe_layer) * spec.n_experts + expert
    experts = hf.model.layers[moe_layer].mlp.experts  # transformers 5: fused 3-D parameters
    assert torch.equal(banks["w13"][lid], experts.gate_up_proj[expert].detach())
    assert torch.equal(banks["w2"][lid], experts.down_proj[expert].detach())
    a = Engine.load(hf_dir, device="cpu", progress=False, kv_tokens=1024)
    b = Engine.load(ftw_dir, device="cpu", progress=False, kv_tokens=1024)
    ids = [random.Random(rng_seed).randrange(3, 320) for _ in range(50)]
    assert torch.equal(a.score(ids), b.score(ids))


def test_damaged_ftw_is_refused(tmp_path, rng_seed):
    hf_dir, ftw_dir = tmp_path / "hf", tmp_path / "ftw"
    make_tiny("qwen3_moe", hf_dir, rng_seed)
    ftw.convert(hf_dir, ftw_dir, progress=False)
    spec = spec_from_config(read_config(ftw_dir))
    bank = ftw_dir / "experts.w2.bin"
    raw = bytearray(bank.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bank.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="w2: 1 expert rows fail their checksum"):
        ftw.verify(ftw_dir, spec)
    bank.write_bytes(bytes(raw[:-2]))
    with pytest.raises(CheckpointError, match="experts.w2.bin should hold"):
        Engine.load(ftw_dir, device="cpu", progress=False)
    manifest = json.loads((ftw_dir / "ftw.json").read_text())
    manifest["version"] = 99
    (ftw_dir / "ftw.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="version 99"):
        Engine.load(ftw_dir, device="cpu", progress=False)
    with pytest.raises(FileExistsError):
        ftw.convert(hf_dir, ftw_dir, progress=False)


@pytest.fixture
def converted(tmp_path, rng_seed):
    """(HF folder, FTW folder, spec, rng) of a tiny qwen3_moe."""
    hf_dir, ftw_dir = tmp_path / "hf", tmp_path / "ftw"
    make_tiny("qwen3_moe", hf_dir, rng_seed)
    ftw.convert(hf_dir, ftw_dir, progress=False)
    return hf_dir, ftw_dir, spec_from_config(read_config(ftw_dir)), random.Random(rng_seed)


def _flip_rows(folder, spec, bank: str, rows: list[int], rng: random.Random) -> None:
    """Flip one random bit in each of `rows` of `bank` (a disk's damage: sizes unchanged)."""
    path = folder / f"experts.{bank}.bin"
    raw = bytearray(path.read_bytes())
    row_bytes = len(raw) // ftw.bank_shapes(spec)[bank][0]
    for r in rows:
        raw[r * row_bytes + rng.randrange(row_bytes)] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(raw))


def _damage(spec, rng: random.Random) -> tuple[str, list[int]]:
    bank = rng.choice(ftw.BANKS)
    return bank, sorted(rng.sample(range(spec.n_moe_layers * spec.n_experts), rng.randint(1, 5)))


def test_dense_tensors_are_copied_without_loading_them(tmp_path, rng_seed, monkeypatch):
    """convert copies the dense tensors' bytes into dense.safetensors (safetensors_stream.py):
    it read every one into memory before (15-40 GB for the largest MoE checkpoints). Here the
    checkpoint is split over shards with extra tensors of other dtypes and an empty one (under
    the multi-token-prediction head's names, which the load ignores: others it refuses, and so
    does convert): the file holds each non-expert tensor exactly and none was loaded."""
    from safetensors.torch import load_file, save_file

    hf_dir, dst = tmp_path / "hf", tmp_path / "ftw"
    make_tiny("qwen3_5_moe", hf_dir, rng_seed)
    gen = torch.Generator().manual_seed(rng_seed)
    extra = {  # odd sizes: a tensor after them would be misaligned in the order met
        "mtp.odd": torch.randn(3, generator=gen).bfloat16(),
        "mtp.f32": torch.randn(3, 5, generator=gen),
        "mtp.i64": torch.randint(-9, 9, (7,), generator=gen),
        "mtp.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "mtp.f16": torch.randn(2, 2, 2, generator=gen).half(),
    }
    save_file(extra, str(hf_dir / "extra.safetensors"), metadata={"format": "pt"})
    sources, weight_map = {}, {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        sources.update(load_file(str(path)))
        weight_map.update(dict.fromkeys(load_file(str(path)), path.name))
    # Shards are listed by their index (without one, model.safetensors alone is read)
    index = {"metadata": {}, "weight_map": weight_map}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded: list[str] = []
    opened = ftw.opened

    @contextlib.contextmanager
    def spying(path):
        with opened(path) as f:
            get = f.get_tensor

            class Spy:
                def keys(self):
                    return f.keys()

                def get_tensor(self, name):
                    loaded.append(name)
                    return get(name)

            yield Spy()

    monkeypatch.setattr(ftw, "opened", spying)
    ftw.convert(hf_dir, dst, progress=False)
    dense = load_file(str(dst / "dense.safetensors"))
    expected = {n for n in sources if not any(p.match(n) for p, _ in ftw._expert_targets(
        spec_from_config(read_config(hf_dir))))}  # fmt: skip
    assert set(dense) == expected and set(extra) <= expected
    for name in expected:
        assert dense[name].dtype == sources[name].dtype and torch.equal(dense[name], sources[name])
    assert not set(loaded) & expected, "dense tensors were loaded into memory"
    header, _ = safetensors_stream.read_header(dst / "dense.safetensors")
    sizes = {"F32": 4, "I64": 8, "BF16": 2, "F16": 2}
    for name, entry in header.items():  # each tensor at a multiple of its element size
        if name != "__metadata__":
            assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0, (name, entry)
    monkeypatch.undo()
    ftw.verify(dst, spec_from_config(read_config(dst)))


def test_convert_reads_back_what_it_wrote(tmp_path, rng_seed, monkeypatch):
    """A bank that reads back other bytes than convert hashed (a failing disk) is refused
    before the checkpoint appears."""
    hf_dir, dst = tmp_path / "hf", tmp_path / "ftw"
    make_tiny("qwen3_moe", hf_dir, rng_seed)
    spec = spec_from_config(read_config(hf_dir))
    bank, rows = _damage(spec, random.Random(rng_seed))
    sync = ftw.synced

    def damaging_sync(path):
        if path.name == f"experts.{bank}.bin":
            _flip_rows(path.parent, spec, bank, rows, random.Random(rng_seed))
        sync(path)

    monkeypatch.setattr(ftw, "synced", damaging_sync)
    with pytest.raises(CheckpointError, match=rf"{bank}: {len(rows)} expert rows fail"):
        ftw.convert(hf_dir, dst, progress=False)
    assert not dst.exists() and not (tmp_path / "ftw.partial").exists()  # its work removed


def test_a_disk_without_room_for_the_dense_part_is_refused_before_the_expert_pass(
    tmp_path, rng_seed, monkeypatch
):
    """The banks' blocks are reserved first; the dense file and the copied files are checked
    against the room left before any expert is read (the failure came after the whole pass):
    the error names both sizes, nothing is left behind, and a disk just large enough converts."""
    import shutil

    from safetensors.torch import load_file

    hf_dir, dst = tmp_path / "hf", tmp_path / "ftw"
    make_tiny(random.Random(rng_seed).choice(FAMILIES), hf_dir, rng_seed)
    spec = spec_from_config(read_config(hf_dir))
    dense_bytes = sum(
        t.numel() * t.element_size()
        for path in hf_dir.glob("*.safetensors")
        for n, t in load_file(str(path)).items()
        if not any(p.match(n) for p, _ in ftw._expert_targets(spec))
    )
    copied = sum((hf_dir / n).stat().st_size for n in ftw.COPIED if (hf_dir / n).is_file())
    needed = dense_bytes + copied + (1 << 20)
    usage = shutil.disk_usage(tmp_path)
    read: list[str] = []
    opened = ftw.opened

    @contextlib.contextmanager
    def spying(path):
        read.append(str(path))
        with opened(path) as f:
            yield f

    monkeypatch.setattr(ftw, "opened", spying)
    monkeypatch.setattr(ftw.shutil, "disk_usage", lambda p: usage._replace(free=needed - 1))
    with pytest.raises(OSError, match=rf"no room for the dense.*{needed / 1e9:.2f} GB needed"):
        ftw.convert(hf_dir, dst, progress=False)
    assert not read, "the expert pass ran before the disk's room was checked"
    assert not dst.exists() and not (tmp_path / "ftw.partial").exists()
    monkeypatch.setattr(ftw.shutil, "disk_usage", lambda p: usage._replace(free=needed))
    ftw.convert(hf_dir, dst, progress=False)
    assert ftw.is_ftw(dst) and read


def test_convert_deletes_only_its_own_partial_folder(tmp_path, rng_seed):
    """`DST.partial` that convert did not make (someone's data) is refused and kept; one a
    killed convert left is replaced; an FTW source is named as such."""
    rng = random.Random(rng_seed)
    hf_dir, dst = tmp_path / "hf", tmp_path / f"out{rng.randrange(1000)}"
    make_tiny("qwen3_moe", hf_dir, rng_seed)
    partial = dst.with_name(dst.name + ".partial")
    partial.mkdir()
    precious = partial / f"notes{rng.randrange(1000)}.txt"
    precious.write_bytes(rng.randbytes(rng.randint(1, 4096)))
    kept = precious.read_bytes()
    with pytest.raises(FileExistsError, match="is not a conversion's leftover"):
        ftw.convert(hf_dir, dst, progress=False)
    assert precious.read_bytes() == kept and not dst.exists()
    precious.unlink()
    (partial / ftw.PARTIAL_MARK).write_text("a convert that was killed\n")
    (partial / "experts.w13.bin").write_bytes(rng.randbytes(64))
    ftw.convert(hf_dir, dst, progress=False)
    assert ftw.is_ftw(dst) and not partial.exists()
    assert not (dst / ftw.PARTIAL_MARK).exists()
    with pytest.raises(CheckpointError, match="already an FTW checkpoint"):
        ftw.convert(dst, tmp_path / "again", progress=False)
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.partial").exists()


def test_verify_command_names_every_bad_row(converted, capsys):
    from freetoken_agent import cli

    _, ftw_dir, spec, rng = converted
    assert cli.main(["verify", str(ftw_dir)]) == 0
    bank, rows = _damage(spec, rng)
    _flip_rows(ftw_dir, spec, bank, rows, rng)
    capsys.readouterr()
    assert cli.main(["verify", str(ftw_dir)]) == 1
    out, err = capsys.readouterr()
    named = [line.split()[:3] for line in out.splitlines()]
    assert named == [[f"experts.{bank}.bin", "row", str(r)] for r in rows], out
    assert f"{len(rows)} of {2 * spec.n_moe_layers * spec.n_experts} expert rows" in err
    assert cli.main(["verify", str(ftw_dir.parent / "hf")]) == 2  # not FTW: said, not a crash


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_verify_finds_damaged_dense_weights(converted, capsys, damage):
    """A bit flipped in a weight (which loads as a wrong model) or the file cut short: the
    manifest's dense_crc32 and a read of the file find both."""
    from freetoken_agent import cli

    _, ftw_dir, spec, rng = converted
    path = ftw_dir / "dense.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        i = rng.randrange(len(data) // 2, len(data))  # in the tensors, past the header
        data[i] ^= 1 << rng.randrange(8)
    else:
        data = data[: rng.randrange(8, len(data))]
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(ftw_dir)]) == 1
    assert str(path) in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="dense.safetensors"):
        ftw.verify(ftw_dir, spec)


def test_verify_finds_a_damaged_copied_file(converted, capsys):
    """config.json and the files copied beside it: a flipped bit there (a rope_theta, an eos
    id) loads a wrong model that looked verified; the manifest's "files" CRCs find it, in
    `verify` and in a load with verify_checksums."""
    from freetoken_agent import cli

    _, ftw_dir, spec, rng = converted
    copied = ftw.read_manifest(ftw_dir, spec)["files"]
    assert "config.json" in copied
    name = rng.choice(sorted(copied))
    path = ftw_dir / name
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(ftw_dir)]) == 1
    assert f"{path} fails its checksum" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"{name} fails its checksum"):
        ftw.verify(ftw_dir, spec)


@pytest.mark.parametrize("policy", ["resident", "transfer"])
def test_verify_checksums_at_load_names_the_bank_and_rows(converted, policy):
    _, ftw_dir, spec, rng = converted
    bank, rows = _damage(spec, rng)
    _flip_rows(ftw_dir, spec, bank, rows, rng)
    opts = dict(device="cpu", progress=False, policy=policy, kv_tokens=256)
    if policy != "resident":
        opts["expert_slots"] = rng.randint(1, spec.n_experts)
    with pytest.raises(CheckpointError, match=rf"{bank}: {len(rows)} expert rows fail their "
                       rf"checksum: \[{', '.join(map(str, rows))}\]"):  # fmt: skip
        Engine.load(ftw_dir, verify_checksums=True, **opts)
    Engine.load(ftw_dir, **opts)  # off by default: a load reads at the disk's speed


def test_verify_checksums_at_load_checks_the_dense_file(converted):
    """A bit flipped in a dense weight loads as a subtly wrong model: with verify_checksums
    the load refuses it, as `verify` does (it checked only the banks' rows)."""
    _, ftw_dir, spec, rng = converted
    path = ftw_dir / "dense.safetensors"
    data = bytearray(path.read_bytes())
    i = rng.randrange(len(data) // 2, len(data))  # in the tensors, past the header
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    opts = dict(device="cpu", progress=False, kv_tokens=256)
    with pytest.raises(CheckpointError, match="dense.safetensors fails its checksum"):
        Engine.load(ftw_dir, verify_checksums=True, **opts)
    Engine.load(ftw_dir, **opts)  # off by default: the flip is not looked for


def _manifest_damage(folder, field: str):
    manifest = json.loads((folder / "ftw.json").read_text())
    parent = manifest
    *path, last = field.split(".")
    for key in path:
        parent = parent[key]
    return manifest, parent, last


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("banks.w2", None, "field 'banks.w2' is missing"),
        ("banks.w13.file", None, "field 'banks.w13.file' is missing"),
        ("itemsize", None, "field 'itemsize' is missing"),
        ("itemsize", "4", "field 'itemsize' should be an integer, found a string"),
        ("dense", None, "field 'dense' is missing"),
        ("banks", [], "field 'banks' should be an object, found a list"),
        ("banks.w2.shape", "oops", "field 'banks.w2.shape' should be a list, found a string"),
        ("banks.w13.crc32", "short", "field 'banks.w13.crc32' should hold"),
        ("dtype", "int8", "the banks hold .int8. in 2-byte items"),
        ("", [1, 2], "should hold a JSON object, found a list"),
    ],
)
def test_a_damaged_manifest_is_a_checkpoint_error_naming_the_field(converted, field, value, says):
    _, ftw_dir, spec, rng = converted
    manifest, parent, last = _manifest_damage(ftw_dir, field)
    if not field:
        manifest = value
    elif value is None:
        del parent[last]
    elif value == "short":  # a checksum lost: one fewer than the bank's rows
        parent[last].pop(rng.randrange(len(parent[last])))
    else:
        parent[last] = value
    if field == "dtype":  # a dtype no bank holds, in 2-byte items
        manifest["itemsize"] = 2
    (ftw_dir / "ftw.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=says) as raised:
        Engine.load(ftw_dir, device="cpu", progress=False, kv_tokens=256)
    assert "ftw.json" in str(raised.value)


@pytest.mark.parametrize("saved, configured", [("float32", "bfloat16"), ("bfloat16", "float16"),
                                                ("float16", "float32")])  # fmt: skip
def test_banks_keep_the_experts_dtype_whatever_config_json_says(
    tmp_path, rng_seed, saved, configured
):
    """Tensors saved in one dtype under a config.json naming another (an fp32 save of a bf16
    model; a bf16 model whose config says fp16): the banks hold the experts as saved and the
    load casts them, so the FTW folder is the model its source folder loads as, in any run
    dtype. Rounded into config.json's dtype at convert, they differed by up to 0.5 in the
    logits, and bf16 experts past fp16's range became inf (NaN logits)."""
    from safetensors.torch import load_file, save_file

    rng = random.Random(rng_seed)
    hf_dir, ftw_dir = tmp_path / "hf", tmp_path / "ftw"
    make_tiny(rng.choice(FAMILIES), hf_dir, rng_seed)
    spec = spec_from_config(read_config(hf_dir))
    for path in hf_dir.glob("*.safetensors"):
        tensors = {n: t.to(getattr(torch, saved)) for n, t in load_file(str(path)).items()}
        if saved == "bfloat16":  # an expert value fp16 cannot hold
            name = next(n for n in tensors if any(p.match(n) for p, _ in ftw._expert_targets(spec)))
            tensors[name].view(-1)[rng.randrange(tensors[name].numel())] = 2.0**17
        save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(dtype=configured, torch_dtype=configured)
    (hf_dir / "config.json").write_text(json.dumps(config))
    ftw.convert(hf_dir, ftw_dir, progress=False)
    assert json.loads((ftw_dir / "ftw.json").read_text())["dtype"] == saved
    ids = [rng.randrange(3, 320) for _ in range(40)]
    for run in ("float32", saved):
        a = Engine.load(hf_dir, device="cpu", dtype=run, progress=False, kv_tokens=256)
        b = Engine.load(ftw_dir, device="cpu", dtype=run, progress=False, kv_tokens=256)
        assert torch.equal(a.score(ids), b.score(ids)), run


def test_a_manifest_dtype_that_disagrees_with_its_item_size_or_no_dense_file_is_refused(
    converted,
):
    """Banks read as another dtype than written are reinterpreted bit by bit (NaN logits) or
    mapped past their end; a missing dense file is named."""
    _, ftw_dir, _, _ = converted
    manifest = json.loads((ftw_dir / "ftw.json").read_text())
    for dtype, itemsize in (("bfloat16", manifest["itemsize"]), ("int8", 1)):
        if (dtype, itemsize) == ("bfloat16", 2):
            continue  # (a bf16 checkpoint: that one is right)
        (ftw_dir / "ftw.json").write_text(json.dumps({**manifest, "dtype": dtype,
                                                      "itemsize": itemsize}))  # fmt: skip
        with pytest.raises(CheckpointError, match=f"the banks hold '{dtype}' in {itemsize}-byte"):
            Engine.load(ftw_dir, device="cpu", progress=False, kv_tokens=256)
    (ftw_dir / "ftw.json").write_text(json.dumps(manifest))
    (ftw_dir / "dense.safetensors").unlink()
    with pytest.raises(CheckpointError, match="dense.safetensors .the dense weights"):
        Engine.load(ftw_dir, device="cpu", progress=False, kv_tokens=256)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_convert_stopped_by_a_signal_leaves_no_partial_folder(tmp_path, rng_seed, sig):
    """`timeout`, `docker stop` or a closed terminal (SIGTERM, SIGHUP) mid-convert: DST.partial
    is removed as after Ctrl-C (their default action left the banks' full size on disk)."""
    import signal
    import subprocess
    import sys
    import time

    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    script = (
        "import sys, time\n"
        "from freetoken_agent.engine.weights import ftw\n"
        "write = ftw._write\n"
        "def slow(*a):\n"
        "    write(*a)\n"
        "    print('written', flush=True)\n"
        "    time.sleep(60)\n"
        "ftw._write = slow\n"
        "from freetoken_agent import cli\n"
        "sys.exit(cli.main(['convert', sys.argv[1], sys.argv[2]]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "m"),
                             str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "written", proc.stderr.read()
    assert (tmp_path / "out.partial").is_dir()
    time.sleep(random.Random(rng_seed).uniform(0, 0.2))
    proc.send_signal(getattr(signal, sig))
    err = proc.communicate(timeout=60)[1]
    # 128 + the signal's number, as its default action gives (supervisors read it)
    assert proc.returncode == 128 + getattr(signal, sig) and f"stopped by {sig}" in err, err
    assert not (tmp_path / "out.partial").exists() and not (tmp_path / "out").exists()


def test_a_second_convert_to_the_same_folder_is_refused_while_the_first_writes(tmp_path, rng_seed):
    """It took the first's DST.partial for a dead run's leftover and deleted it under it: both
    failed, the first blaming the disk. Now the second is refused by name, the first's work
    untouched, and a later convert runs."""
    import fcntl

    make_tiny("qwen3_moe", tmp_path / "hf", rng_seed)
    dst = tmp_path / f"out{random.Random(rng_seed).randrange(99)}"
    with open(dst.with_name(dst.name + ".lock"), "w") as held:  # as a first convert holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FileExistsError, match=f"another convert is writing {dst}"):
            ftw.convert(tmp_path / "hf", dst, progress=False)
        assert not dst.exists() and not dst.with_name(dst.name + ".partial").exists()
    ftw.convert(tmp_path / "hf", dst, progress=False)
    assert ftw.is_ftw(dst) and not dst.with_name(dst.name + ".lock").exists()
