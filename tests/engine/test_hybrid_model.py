"""Hybrid models (qwen3_next, qwen3_5_moe) against transformers, driven by hand (CPU, fp32).

No scheduler or runner: the test builds our model through `build_model`, loads the tiny
checkpoint with our loader, binds a KV pool (attention layers) and per-layer recurrent state
tensors itself, and writes each step's AttentionMetadata + RecurrentMetadata. Every pool row a
sequence does not own is NaN, so a read of the wrong slot or page poisons the logits. Logits are
compared with transformers' full-sequence forward (max relative error <= 1e-4).
"""

# T tokens of a step, B sequences, V vocab, S page size

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import HYBRID_FAMILIES, make_tiny, max_rel_err

from freetoken_agent.engine.config import EngineConfig, read_config
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.layers.attention import AttentionMetadata
from freetoken_agent.engine.layers.recurrent import RecurrentMetadata, RecurrentStateView
from freetoken_agent.engine.loading import build_model
from freetoken_agent.engine.models.base import MoeCausalLM
from freetoken_agent.engine.models.registry import family, spec_from_config
from freetoken_agent.engine.weights.loader import CheckpointError, load_safetensors

VOCAB, PAGE, SLOTS, SNAPS = 320, 16, 4, 3
VARIANTS = (*HYBRID_FAMILIES, "qwen3_5_moe_vl")  # vl: the multimodal checkpoint layout


def load_ours(folder, device: str = "cpu") -> MoeCausalLM:
    spec = spec_from_config(read_config(folder))
    config = EngineConfig(device=device, dtype=torch.float32, policy="resident")
    model, bank, _ = build_model(spec, config, torch.device(device), torch.float32)
    load_safetensors(folder, spec, model, bank, family(spec.arch).CHECKPOINT_NAMES, False)
    return model


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request, tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.param} checkpoint seed={seed}")
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(request.param, folder, seed)
    # Real repos carry a multi-token-prediction head; the tables ignore it by name.
    save_file({"mtp.fc.weight": torch.randn(4, 4)}, str(folder / "extra.safetensors"))
    return request.param, hf, load_ours(folder), folder


@dataclass
class Seq:
    ids: list[int]
    slot: int  # row in the state pools
    pages: list[int] = field(default_factory=list)
    done: int = 0  # tokens already run


class Harness:
    """What the runner will own: KV pages, state rows, metadata. Plain tensors, NaN-poisoned."""

    def __init__(self, model: MoeCausalLM, device: str = "cpu") -> None:
        spec, lin = model.spec, model.spec.linear
        self.model, self.device = model, device
        n_attn = len(spec.attention_layers)
        self.kv = KVPool(n_attn, 32, PAGE, spec.n_kv_heads, spec.head_dim, torch.float32, device)
        self.kv.k.fill_(float("nan"))
        self.kv.v.fill_(float("nan"))

        def nan(rows: int, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.full((rows, *shape), float("nan"), device=device)

        self.views = [
            RecurrentStateView(
                conv=nan(SLOTS, lin.conv_state_shape),
                ssm=nan(SLOTS, lin.ssm_state_shape),
                conv_snap=nan(SNAPS, lin.conv_state_shape),
                ssm_snap=nan(SNAPS, lin.ssm_state_shape),
            )
            for _ in spec.recurrent_layers
        ]
        model.bind_kv_cache(self.kv.k, self.kv.v)
        model.bind_recurrent_state(self.views)

    def new_seq(self, ids: list[int], slot: int) -> Seq:
        for view in self.views:  # a fresh request's state: zeros
            view.conv[slot] = 0
            view.ssm[slot] = 0
        return Seq(ids, slot)

    def step(self, work: list[tuple[Seq, int]], decode: bool = False, snaps=None) -> torch.Tensor:
        """Run n new tokens of each (seq, n); returns logits [T, V]. decode: seq_bounds None (the
        CUDA-graph form). snaps: {(work index, token index in the step's chunk): snapshot row}."""
        ids, pos, slots, cu, kv_lens = [], [], [], [0], []
        for seq, n in work:
            while len(seq.pages) * PAGE < seq.done + n:
                seq.pages += self.kv.allocator.alloc(1)
            for p in range(seq.done, seq.done + n):
                ids.append(seq.ids[p])
                pos.append(p)
                slots.append(seq.pages[p // PAGE] * PAGE + p % PAGE)
            seq.done += n
            cu.append(cu[-1] + n)
            kv_lens.append(seq.done)
        width = max(len(s.pages) for s, _ in work)
        table = [s.pages + [0] * (width - len(s.pages)) for s, _ in work]
        snap_slots = None
        if snaps:
            snap_slots = torch.full((cu[-1],), -1, dtype=torch.int64)
            for (b, t), row in snaps.items():
                snap_slots[cu[b] + t] = row
            snap_slots = snap_slots.to(self.device)

        def tensor(values, dtype=torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            positions=tensor(pos),
            slot_mapping=tensor(slots),
            page_table=tensor(table, torch.int32),
            cu_q_lens=tensor(cu, torch.int32),
            kv_lens=tensor(kv_lens, torch.int32),
            max_q_len=max(n for _, n in work),
            max_kv_len=max(kv_lens),
            recurrent=RecurrentMetadata(
                state_slots=tensor([s.slot for s, _ in work]),
                snap_slots=snap_slots,
                seq_bounds=None if decode else tuple(cu),
            ),
        )
        with torch.no_grad():
            return self.model.compute_logits(self.model(tensor(ids), meta)).cpu()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = max_rel_err(ours, ref)
    print(f"{name}: max relative error {err:.2e}")
    assert err <= tol, f"{name}: {err}"


def test_one_prefill_chunk(tiny, rng_seed):
    name, hf, model, _ = tiny
    ids = prompt(random.Random(rng_seed), 83)  # crosses the delta rule's 64-token chunk
    h = Harness(model)
    check(name, h.step([(h.new_seq(ids, 1), len(ids))]), hf_logits(hf, ids))


def test_two_chunks_carry_state(tiny, rng_seed):
    name, hf, model, _ = tiny
    rng = random.Random(rng_seed)
    ids = prompt(rng, 50)
    cut = rng.randrange(1, 49)
    h = Harness(model)
    seq = h.new_seq(ids, 2)
    ours = torch.cat([h.step([(seq, cut)]), h.step([(seq, len(ids) - cut)])])
    check(f"{name} cut at {cut}", ours, hf_logits(hf, ids))


def test_decode_after_prefill(tiny, rng_seed):
    name, hf, model, _ = tiny
    rng = random.Random(rng_seed)
    ids = prompt(rng, 30)
    n_prefill = rng.randrange(1, 20)
    h = Harness(model)
    seq = h.new_seq(ids, 3)
    rows = [h.step([(seq, n_prefill)])]
    rows += [h.step([(seq, 1)], decode=True) for _ in range(len(ids) - n_prefill)]
    check(f"{name} prefill {n_prefill} + decode", torch.cat(rows), hf_logits(hf, ids))


def test_packed_sequences(tiny, rng_seed):
    """Two sequences in one step (prefill), then a mixed step, then batched decode."""
    name, hf, model, _ = tiny
    rng = random.Random(rng_seed)
    a_ids, b_ids = prompt(rng, 40), prompt(rng, 33)
    h = Harness(model)
    a, b = h.new_seq(a_ids, 3), h.new_seq(b_ids, 1)  # slot order differs from batch order
    first = h.step([(a, 17), (b, 25)])
    mixed = h.step([(b, 1), (a, 20)])  # b decodes while a prefills: one non-decode step
    rest = [h.step([(a, 1), (b, 1)], decode=True) for _ in range(3)]
    ours_a = torch.cat([first[:17], mixed[1:], *(r[:1] for r in rest)])
    ours_b = torch.cat([first[17:], mixed[:1], *(r[1:] for r in rest)])
    check(f"{name} seq a", ours_a, hf_logits(hf, a_ids))
    check(f"{name} seq b", ours_b, hf_logits(hf, b_ids[:29]))


def test_snapshot_equals_stopped_run(tiny, rng_seed):
    """A snapshot after token t (inside a packed prefill, and in a decode step) holds the state
    a run stopped after t leaves."""
    name, hf, model, _ = tiny
    rng = random.Random(rng_seed)
    ids, other = prompt(rng, 45), prompt(rng, 12)
    t = rng.randrange(0, 43)
    stopped = Harness(model)
    stopped.step([(stopped.new_seq(ids, 2), t + 1)])
    expect = [(v.conv[2].clone(), v.ssm[2].clone()) for v in stopped.views]

    h = Harness(model)
    seq = h.new_seq(ids, 2)
    h.step([(h.new_seq(other, 1), 12), (seq, 44)], snaps={(1, t): 2, (1, 43): 0})
    h.step([(seq, 1)], decode=True, snaps={(0, 0): 1})
    for view, (conv, ssm) in zip(h.views, expect, strict=True):
        # Not bitwise: the layers below ran their matmuls over other token batches.
        assert max_rel_err(view.conv_snap[2], conv) <= 1e-5
        assert max_rel_err(view.ssm_snap[2], ssm) <= 1e-5
        # The decode-step snapshot (row 1) is the final state; row 0 the state after token 43.
        torch.testing.assert_close(view.ssm_snap[1], view.ssm[2], rtol=0, atol=0)
        torch.testing.assert_close(view.conv_snap[1], view.conv[2], rtol=0, atol=0)
        assert not view.ssm_snap[0].isnan().any() and not view.conv_snap[0].isnan().any()


def test_checkpoint_names_are_strict(tiny, tmp_path):
    """The extra mtp tensor (and the vision tower of the vl variant) loaded without complaint;
    a tensor nobody names is still an error that names it."""
    name, _, _, folder = tiny
    for f in folder.iterdir():
        (tmp_path / f.name).symlink_to(f)
    bogus = "model.layers.0.linear_attn.bogus.weight"
    save_file({bogus: torch.randn(2)}, str(tmp_path / "zz_bogus.safetensors"))
    # A shard the index lists (a stray file beside model.safetensors is not read at all)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    weight_map = {n: f for f in shards for n in safe_open_names(tmp_path / f)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=bogus):
        load_ours(tmp_path)


def safe_open_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


# ---- pieces against transformers' modules, in bf16 where rounding points matter ---------------


def test_norms_match_transformers_bitwise(rng_seed):
    """Zero-centred RMSNorm (decoder and q/k heads) and the gated norm of the DeltaNet output
    round exactly where transformers rounds: bitwise equal in bf16."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

    from freetoken_agent.engine.layers.gated_delta_net import GatedRMSNorm
    from freetoken_agent.engine.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(rng_seed)
    x, z = (torch.randn(7, 3, 64, generator=gen).bfloat16() * 3 for _ in range(2))
    w = (0.3 * torch.randn(64, generator=gen)).bfloat16()
    ours, ref = RMSNorm(64, 1e-6, zero_centred=True), hf_next.Qwen3NextRMSNorm(64, 1e-6)
    ours.weight.data, ref.weight.data = w.clone(), w.clone()
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))  # [T, heads, D]: the per-head path
        assert torch.equal(ours(x[:, 0]), ref(x[:, 0]))  # [T, H]
        gated, ref_gated = GatedRMSNorm(64, 1e-6), hf_next.Qwen3NextRMSNormGated(64, 1e-6)
        gated.weight.data, ref_gated.weight.data = (1 + w).clone(), (1 + w).clone()
        gated_ref = ref_gated(x.reshape(-1, 64), z.reshape(-1, 64)).view(x.shape)
        assert torch.equal(gated(x, z), gated_ref)


def test_qwen3_5_mrope_is_plain_rope_for_text(tmp_path):
    """Interleaved multimodal RoPE with equal (text) position ids equals our rope table."""
    from tiny_models import tiny_config
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_q35

    from freetoken_agent.engine.layers.rope import RotaryEmbedding

    cfg = tiny_config("qwen3_5_moe")
    cfg.rope_parameters = {**cfg.rope_parameters, "mrope_section": [1, 1, 0],
                           "mrope_interleaved": True}  # fmt: skip
    cfg.head_dim = 32  # rotary dim 8: four frequencies, so the H slot (index 1) is exercised
    spec = spec_from_config(cfg.to_dict())
    ours = RotaryEmbedding(spec, 64, torch.float32)
    positions = torch.arange(64).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = hf_q35.Qwen3_5MoeTextRotaryEmbedding(cfg)(torch.zeros(1), positions)
    assert spec.rope.rotary_dim == 8 == ours.cos.shape[1]
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])


def test_hybrid_specs():
    from tiny_models import tiny_config

    cfg = tiny_config("qwen3_next").to_dict()
    del cfg["layer_types"]
    cfg.update(num_hidden_layers=8, full_attention_interval=4)
    spec = spec_from_config(cfg)
    assert spec.attention_layers == (3, 7) and spec.recurrent_layers == (0, 1, 2, 4, 5, 6)
    assert spec.is_hybrid and spec.moe_layers == (0, 2, 3, 4, 5, 6, 7)  # mlp_only_layers [1]
    assert spec.linear.conv_channels == 2 * 2 * 16 + 4 * 16
    assert spec.linear.conv_state_shape == (128, 3)
    assert spec.linear.ssm_state_shape == (4, 16, 16)
    assert spec.rope.rotary_dim == 4
    vl = tiny_config("qwen3_5_moe_vl").to_dict()
    vl["text_config"].pop("dtype", None)
    vl["dtype"] = "bfloat16"  # the wrapper's settings apply to its text model
    spec = spec_from_config(vl)
    assert spec.arch == "qwen3_5_moe_text" and spec.dtype == torch.bfloat16
    assert spec.moe_layers == (0, 1, 2, 3) and spec.norm_topk_prob
    plain = spec_from_config(tiny_config("qwen3_moe").to_dict())
    assert plain.attention_layers == (0, 1, 2) and not plain.is_hybrid


@pytest.mark.gpu
def test_gpu_prefill_chunks_and_decode(tiny, rng_seed):
    """The same model on CUDA (Triton gated delta rule, paged attention), fp32: a packed
    prefill in two chunks, then batched decode, against transformers on the CPU."""
    name, hf, _, folder = tiny
    rng = random.Random(rng_seed)
    a_ids, b_ids = prompt(rng, 90), prompt(rng, 70)
    h = Harness(load_ours(folder, "cuda"), "cuda")
    a, b = h.new_seq(a_ids, 2), h.new_seq(b_ids, 3)
    first, second = h.step([(a, 70), (b, 30)]), h.step([(a, 10), (b, 30)])
    rest = [h.step([(a, 1), (b, 1)], decode=True) for _ in range(10)]
    ours_a = torch.cat([first[:70], second[:10], *(r[:1] for r in rest)])
    ours_b = torch.cat([first[70:], second[10:], *(r[1:] for r in rest)])
    # tensor cores may run fp32 dots as tf32 (as tests/engine/test_gpu.py allows)
    check(f"{name} cuda seq a", ours_a, hf_logits(hf, a_ids), tol=5e-3)
    check(f"{name} cuda seq b", ours_b, hf_logits(hf, b_ids), tol=5e-3)
