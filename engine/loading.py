"""Builds everything a model folder needs to run: spec, model, expert bank, KV pool, tokenizer.

Memory on CUDA: the budget (default: free device memory minus a reserve) pays for the dense
weights, the expert bank (resident, or slots in front of the host pool: experts/placement.py),
a workspace for one step's activations, and the KV pool, which takes what is left (capped at
what `max_num_seqs` sequences of `max_model_len` tokens could use). An offloaded model keeps
its untied token embedding table in pinned host memory instead (layers/embedding.py). A budget
too small for the weights is an error that says how much is needed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from freetoken_agent.engine.config import (
    ConfigError,
    EngineConfig,
    ModelSpec,
    eos_ids,
    parse_dtype,
    read_config,
)
from freetoken_agent.engine.engine_config import check_option_names
from freetoken_agent.engine.experts.offload import OffloadedExpertBank
from freetoken_agent.engine.experts.placement import (
    BudgetError,
    gpu_budget,
    gpu_ceiling,
    make_bank,
    offloads,
    size,
    workspace_bytes,
)
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.radix import RadixCache
from freetoken_agent.engine.kv.recurrence import build_recurrence, recurrent_device_bytes
from freetoken_agent.engine.l2_prefetcher import use_l2_prefetch
from freetoken_agent.engine.layers.linear import use_skinny_gemv
from freetoken_agent.engine.layers.moe import ExpertBank, use_fused_router
from freetoken_agent.engine.models.base import (
    MoeCausalLM,
    use_attention_block,
    use_fused_norm_qkv,
    use_fused_proj_norm,
)
from freetoken_agent.engine.models.registry import family, spec_from_config
from freetoken_agent.engine.request import Recurrence
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.engine.weights import ftw, ftw_dense
from freetoken_agent.engine.weights.loader import (
    CheckpointError,
    load_safetensors,
    safetensors_files,
    untie_differing_head,
)
from freetoken_agent.kernels import pdl_switch

log = logging.getLogger("freetoken.load")

GiB = 1 << 30


@dataclass(slots=True)
class LoadedModel:
    spec: ModelSpec
    config: EngineConfig
    model: MoeCausalLM
    bank: ExpertBank
    kv: KVPool
    radix: RadixCache
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    dense_bytes: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    recurrence: Recurrence | None = None  # hybrid models: state slots and checkpoint pool


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's own wording lists every backend it knows of
        raise ValueError(
            f"unknown device {str(device)!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={str(device)!r} was asked for, but torch sees no CUDA device")
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device={str(device)!r} was asked for, but torch sees {count} CUDA device(s): "
                f"cuda:0 to cuda:{count - 1}"
            )
    return dev


def build_model(
    spec: ModelSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    pool: ExpertPool | None = None,
) -> tuple[MoeCausalLM, ExpertBank, int]:
    """An uninitialised model and its expert bank (chosen by policy and budget once the dense
    weights are allocated; `pool`: host experts already loaded, see make_bank); returns them
    and the model length."""
    max_len = min(
        config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings
    )
    fam = family(spec.arch)
    host_table = host_embeddings_asked(spec, config, device)
    with torch.device(device):
        model = MoeCausalLM(spec, fam.blueprint(spec), None, max_len, dtype, host_table)
    model.to(dtype=dtype)
    model.eval()
    if host_table:
        place_embeddings(model, spec, config, device, dtype)
    bank = make_bank(spec, config, device, dtype, dense_nbytes(model), pool)
    model.set_expert_bank(bank)
    return model, bank, max_len


def host_embeddings_asked(spec: ModelSpec, config: EngineConfig, device: torch.device) -> bool:
    """Whether the embedding table is built in host memory (EngineConfig.host_embeddings;
    auto: on CUDA when the experts may be offloaded, unless FREETOKEN_HOST_EMBEDDINGS=0). A
    tied table is the LM head: never."""
    if spec.tie_word_embeddings or config.host_embeddings is False:
        return False
    if config.host_embeddings:
        return True
    if os.environ.get("FREETOKEN_HOST_EMBEDDINGS") == "0":  # auto off, for every engine
        return False
    return device.type == "cuda" and config.policy != "resident"


def place_embeddings(
    model: MoeCausalLM, spec: ModelSpec, config: EngineConfig, device: torch.device,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """Settle a host-built embedding table: auto moves it to the device when every expert
    fits beside it there (nothing to gain on the host), and any table that cannot be pinned
    moves too (the device reads only pinned host memory)."""
    table = model.embed_tokens
    with_table = dense_nbytes(model) + table.weight.nbytes
    auto = config.host_embeddings is None
    gains = not auto or offloads(spec, config, device, dtype, with_table)
    if not gains or (device.type == "cuda" and not table.pin()):
        table.to_device(device)


def dense_nbytes(model: MoeCausalLM) -> int:
    """Device bytes of the dense weights (a table kept on the host is not counted)."""
    seen, total = set(), 0
    if model.embed_tokens.on_host:
        seen.add(id(model.embed_tokens.weight))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.nbytes
    return total


def size_kv_pool(
    spec: ModelSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    resident_bytes: int,
    max_len: int,
    offloaded: bool,
) -> int:
    """Number of KV pages (scratch page included). `offloaded`: the expert bank is (its
    workspace is smaller: placement.workspace_bytes)."""
    s = config.page_size
    if config.kv_pages is not None:
        return config.kv_pages
    wanted_tokens = config.max_num_seqs * max_len
    if device.type != "cuda":
        return -(-min(config.kv_tokens, wanted_tokens) // s) + 1
    page_bytes = KVPool.page_bytes(
        len(spec.attention_layers), s, spec.n_kv_heads, spec.head_dim, dtype
    )
    budget = gpu_budget(config, device, resident_bytes)
    workspace = workspace_bytes(spec, config, offloaded=offloaded)
    recurrent = recurrent_device_bytes(spec, config, device, dtype, budget)
    left = budget - resident_bytes - workspace - recurrent
    if left < 2 * page_bytes:
        raise BudgetError(
            f"GPU budget of {size(budget)} cannot hold the resident weights "
            f"({size(resident_bytes)}), a {size(workspace)} workspace, "
            f"{size(recurrent)} of recurrent state and checkpoints and a KV pool"
        )
    return int(min(left // page_bytes, -(-wanted_tokens // s) + 1))


def load_model(
    path: str | Path,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    gpu_budget: int | None = None,
    policy: str = "adaptive",
    progress: bool = True,
    **options,
) -> LoadedModel:
    check_option_names(options)  # before anything is read
    path = Path(path)
    cfg = read_config(path)
    spec = spec_from_config(cfg)
    end_ids = end_token_ids(path)  # a bad generation_config.json fails before the weights load
    dev = resolve_device(device)
    run_dtype = parse_dtype(dtype) or spec.dtype
    config = EngineConfig(
        device=str(dev), dtype=run_dtype, gpu_budget=gpu_budget, policy=policy, **options
    )
    table = family(spec.arch).CHECKPOINT_NAMES
    manifest = ftw.read_manifest(path, spec) if ftw.is_ftw(path) else None
    files = [path / manifest["dense"]] if manifest else safetensors_files(path)
    spec = untie_differing_head(spec, files, table)  # before the model and its budget
    if manifest is not None and config.verify_checksums:
        # The dense file too, not only the banks' rows: a flipped bit in a weight loads as a
        # subtly wrong model. Read once more for its CRC; it is a few percent of the experts.
        problem = ftw_dense.file_problem(path, manifest)
        if problem is not None:
            raise CheckpointError(problem)
    model, bank, max_len = build_model(spec, config, dev, run_dtype)
    if manifest is not None:
        load_safetensors(path, spec, model, bank, table, progress, files, experts_elsewhere=True)
        crcs = {b: manifest["banks"][b]["crc32"] for b in ftw.BANKS}
        copy_banks(ftw.open_banks(path, spec), bank, progress,
                   crcs if config.verify_checksums else None, path)  # fmt: skip
    else:
        load_safetensors(path, spec, model, bank, table, progress, files)
    if isinstance(bank, OffloadedExpertBank):
        bank.ready()
    return assemble(spec, config, model, bank, dev, run_dtype, max_len, _tokenizer(path), end_ids)


def assemble(
    spec: ModelSpec,
    config: EngineConfig,
    model: MoeCausalLM,
    bank: ExpertBank,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    tokenizer: Tokenizer | None,
    end_ids: Iterable[int] = (),
) -> LoadedModel:
    """Size the KV pool around loaded weights and bundle the parts (also used by benchmarks
    that fill the weights themselves). `end_ids`: the folder's end_token_ids, which end
    generation with the spec's and the tokenizer's eos."""
    pdl_switch.requested()  # a misspelt FREETOKEN_PDL fails here, not at the first CUDA step
    if config.skinny_gemv:
        use_skinny_gemv(model)
    if config.fused_router:
        use_fused_router(model)
    if config.fused_proj_norm:
        use_fused_proj_norm(model)
    if config.fused_norm_qkv:
        use_fused_norm_qkv(model)
    if config.attention_block:
        use_attention_block(model)
    if config.l2_prefetch:
        use_l2_prefetch(model, bank, device)
    dense = dense_nbytes(model)
    arena = getattr(getattr(bank, "cache", None), "arena", None)
    if arena is not None:  # elastic memory: the KV pool lives in the arena with the slots
        kv = KVPool.on_arena(arena)
        n_pages = arena.initial_pages
        # A sequence may grow as far as the arena allows with the fewest slots.
        most = arena.boundary_for(n_slots=bank.min_slots) // arena.kv_unit.nbytes - 1
        max_len = min(max_len, most * config.page_size)
    else:
        offloaded = isinstance(bank, OffloadedExpertBank)
        n_pages = size_kv_pool(spec, config, device, dtype, dense + bank.nbytes, max_len, offloaded)
        n_attn = len(spec.attention_layers)
        kv = KVPool(
            n_attn, n_pages, config.page_size, spec.n_kv_heads, spec.head_dim, dtype, device
        )
    radix = RadixCache(config.page_size, kv.allocator)
    budget = gpu_budget(config, device, dense + bank.nbytes) if device.type == "cuda" else 0
    # Elastic memory: the checkpoints' device tier is part of the split (memory_manager.py),
    # resizable up to its share of the most the budget can reach.
    ceiling = None
    if arena is not None:
        loaded_budget = config.gpu_budget if config.gpu_budget is not None else budget
        ceiling = gpu_ceiling(config, device, loaded_budget)
    recurrence = build_recurrence(spec, config, device, dtype, budget, ceiling)
    if recurrence is not None:
        views = [
            recurrence.states.view(i, recurrence.checkpoints)
            for i in range(len(spec.recurrent_layers))
        ]
        model.bind_recurrent_state(views)
        # The tree releases a node's checkpoints when it evicts the node and tells the pool
        # what lies above one it hangs; the pool tells the tree when it drops one for space.
        radix.release_checkpoint = recurrence.checkpoints.release
        recurrence.checkpoints.on_drop = radix.forget_checkpoint
        radix.link_checkpoint = recurrence.checkpoints.link
    if arena is None:  # one sequence can never hold more than the whole pool
        max_len = min(max_len, kv.allocator.capacity * config.page_size)
    eos = set(spec.eos_token_ids) | set(end_ids)
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    host = model.embed_tokens.host_nbytes
    on_host = f", embedding table on the host ({host / GiB:.2f} GiB)" if host else ""
    log.info(
        "loaded %s on %s (%s): dense %.2f GiB%s, experts %.2f GiB, KV %d pages (%.2f GiB)",
        spec.arch, device, dtype, dense / GiB, on_host, bank.nbytes / GiB, n_pages,
        kv.nbytes / GiB,
    )  # fmt: skip
    return LoadedModel(
        spec, config, model, bank, kv, radix, tokenizer, device, dtype, dense, max_len,
        frozenset(eos), recurrence,
    )  # fmt: skip


def copy_banks(
    banks: dict[str, torch.Tensor],
    bank: ExpertBank,
    progress: bool,
    crcs: dict[str, list[int]] | None = None,
    folder: Path | None = None,
) -> None:
    """Copy memory-mapped FTW banks into the resident bank, a few experts per copy (disk-bound:
    pages are read once, no per-tensor work). With `crcs` (the manifest's, per bank and row:
    EngineConfig.verify_checksums) each copied chunk's rows are checked while its pages are
    still cached; rows that fail are a CheckpointError naming them and `folder`."""
    total = sum(b.nbytes for b in banks.values())
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="experts", delay=1.0, disable=not progress
    )
    bad: dict[str, list[int]] = {}
    with bar:
        for name, src in banks.items():
            dst = getattr(bank, name)
            step = max(1, (256 << 20) // max(1, src[0].nbytes))  # ~256 MB per copy
            bad[name] = []
            for lo in range(0, src.shape[0], step):
                dst[lo : lo + step].copy_(src[lo : lo + step])
                if crcs is not None:
                    bad[name] += ftw.mismatched(src[lo : lo + step], crcs[name], lo)
                bar.update(src[lo : lo + step].nbytes)
    if any(bad.values()):
        raise ftw.checksum_error(folder or "the FTW checkpoint", bad)


def end_token_ids(path: Path) -> set[int]:
    """The ids that end generation by the folder's configs: generation_config.json's (what
    transformers' generate stops on) and config.json's, a multimodal one's text_config too.
    Read here, the one place, so that a folder without tokenizer.json ends on them as well."""
    ids: set[int] = set()
    gen_file, model_file = path / "generation_config.json", path / "config.json"
    for file in (gen_file, model_file):
        if not file.is_file():
            continue
        try:
            cfg = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ConfigError(f"{file} must hold a JSON object, got {type(cfg).__name__}")
        ids |= set(eos_ids(cfg.get("eos_token_id"), f"{file}: eos_token_id"))
        text_cfg = cfg.get("text_config")
        if isinstance(text_cfg, dict):  # multimodal checkpoints nest the language model's
            ids |= set(eos_ids(text_cfg.get("eos_token_id"), f"{file}: text_config.eos_token_id"))
    return ids


def _tokenizer(path: Path) -> Tokenizer | None:
    try:
        return Tokenizer.from_dir(path)
    except FileNotFoundError:
        log.warning("no tokenizer.json in %s: the engine takes and returns token ids only", path)
        return None
