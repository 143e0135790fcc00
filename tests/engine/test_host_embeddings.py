"""The token embedding table in host memory (engine/layers/embedding.py): its bytes leave the
budget and become expert slots, and the tokens stay those of the all-resident engine."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest
import torch
from tiny_models import make_tiny, tiny_config

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.config import EngineConfig
from freetoken_agent.engine.experts.placement import slot_count
from freetoken_agent.engine.experts.streaming import ring_slots
from freetoken_agent.engine.loading import dense_nbytes, place_embeddings
from freetoken_agent.engine.models.base import MoeCausalLM
from freetoken_agent.engine.models.registry import family, spec_from_config

CPU = torch.device("cpu")


def _least_budget(spec, config: EngineConfig, dense: int, slots: int) -> int:
    """The least budget at which slot_count gives `slots` beside `dense` bytes (bisection)."""
    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            enough = slot_count(spec, replace(config, gpu_budget=mid), CPU, torch.float32, dense)
        except ValueError:  # BudgetError: not one slot
            enough = 0
        lo, hi = (lo, mid) if enough >= slots else (mid + 1, hi)
    return lo


def test_host_table_leaves_the_budget_to_expert_slots(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    vocab = rng.randint(1500, 3000)  # a table worth several expert slots
    make_tiny("qwen3_moe", tmp_path, rng_seed, vocab_size=vocab, num_experts=64)
    spec = spec_from_config(tiny_config("qwen3_moe", vocab_size=vocab, num_experts=64).to_dict())
    table = vocab * spec.hidden_size * 4  # fp32
    rows = spec.n_moe_layers * spec.n_experts
    base = EngineConfig(policy="transfer", kv_tokens=1024, max_model_len=512)
    probe = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    dense = probe.loaded.dense_bytes  # the table on the device
    budget = _least_budget(spec, base, dense, rng.randint(4, rows // 3))
    assert rows // 3 + table // spec.expert_bytes + 1 < rows  # the gain is not capped
    opts = dict(device="cpu", policy="transfer", gpu_budget=budget, kv_tokens=1024,
                max_model_len=512, progress=False)  # fmt: skip
    on_device = Engine.load(tmp_path, host_embeddings=False, **opts)
    on_host = Engine.load(tmp_path, host_embeddings=True, **opts)
    assert not on_device.loaded.model.embed_tokens.on_host
    assert on_host.loaded.model.embed_tokens.on_host
    assert on_host.loaded.dense_bytes == on_device.loaded.dense_bytes - table == dense - table
    assert on_host.stats()["memory"]["host_embedding_bytes"] == table
    assert on_device.stats()["memory"]["host_embedding_bytes"] == 0
    gained = on_host.loaded.bank.cache.n_slots - on_device.loaded.bank.cache.n_slots
    # A bank whose cache is too small to lend the prefill ring its slots keeps a ring of its
    # own (streaming.py): the table's bytes may lift the cache past that threshold, and the
    # ring's own rows become slots too.
    own = [0 if e.loaded.bank.streamer.lend else ring_slots(spec.n_experts, 2)
           for e in (on_device, on_host)]  # fmt: skip
    gained -= own[0] - own[1]
    assert gained in (table // spec.expert_bytes, table // spec.expert_bytes + 1), (gained, own)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (rng.randint(5, 40), 60)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in probe.generate(prompts, sp)]
    assert [o.token_ids for o in on_host.generate(prompts, sp)] == want


def test_a_tied_table_stays_on_the_device(tmp_path, rng_seed):
    """A tied table is also the LM head, read whole every step."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, tie_word_embeddings=True)
    engine = Engine.load(tmp_path, device="cpu", policy="transfer", expert_slots=3,
                         host_embeddings=True, progress=False)  # fmt: skip
    model = engine.loaded.model
    assert not model.embed_tokens.on_host
    assert model.lm_head.weight is model.embed_tokens.weight
    assert engine.loaded.dense_bytes == dense_nbytes(model) > model.embed_tokens.weight.nbytes


@pytest.mark.parametrize("fits", [True, False])
def test_auto_keeps_the_table_on_the_host_only_when_experts_are_offloaded(fits, rng_seed):
    """Auto (host_embeddings None) builds the table on the host when the experts may be
    offloaded; if every expert fits beside the table on the device, the table moves there."""
    rng = random.Random(rng_seed)
    spec = spec_from_config(tiny_config("qwen3_moe", vocab_size=rng.randint(500, 3000)).to_dict())
    model = MoeCausalLM(spec, family(spec.arch).blueprint(spec), None, 512, torch.float32, True)
    table = model.embed_tokens.weight.nbytes
    config = EngineConfig(policy="adaptive", kv_tokens=1024)
    rows = spec.n_moe_layers * spec.n_experts
    with_table = dense_nbytes(model) + table
    every = _least_budget(spec, config, with_table, rows)  # all fit with the table on device
    budget = every + rng.randrange(1 << 20) if fits else every - rng.randint(1, table // 2)
    place_embeddings(model, spec, replace(config, gpu_budget=budget), CPU, torch.float32)
    assert model.embed_tokens.on_host is not fits
    assert dense_nbytes(model) == with_table - (0 if fits else table)


class _Cudart:
    """The driver's registrations, recorded; refuses the `fail_at`-th (1-based; 0: none)."""

    def __init__(self, fail_at: int = 0) -> None:
        self.fail_at, self.registered, self.released = fail_at, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        if len(self.registered) + 1 == self.fail_at:
            return 2
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.released.append(ptr)
        return 0


@pytest.mark.parametrize("fail_at", [0, 2])
def test_pinning_registers_the_table_or_undoes_itself(fail_at, monkeypatch, caplog, rng_seed):
    """The table is registered page-exclusive with its values; a refusal midway releases what
    was registered and says so once, and the caller then moves the table to the device."""
    from freetoken_agent.engine import host_memory
    from freetoken_agent.engine.layers.embedding import TokenEmbedding

    gen = torch.Generator().manual_seed(rng_seed)
    cudart = _Cudart(fail_at)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_memory, "PIN_CHUNK_BYTES", 1 << 16)  # several registrations
    vocab, hidden = int(torch.randint(300, 900, (1,), generator=gen)), 64
    emb = TokenEmbedding(vocab, hidden, on_host=True)
    values = torch.randn(vocab, hidden, generator=gen)
    emb.weight.data.copy_(values)
    with caplog.at_level(logging.WARNING, logger="freetoken.load"):
        pinned = emb.pin()
    assert pinned is (fail_at == 0)
    assert torch.equal(emb.weight, values)
    if pinned:
        assert len(cudart.registered) > 1 and cudart.released == []
        ptr = emb.weight.data_ptr()
        assert ptr % host_memory.PAGE == 0 and cudart.registered[0][0] == ptr
        assert sum(size for _, size in cudart.registered) == emb.weight.nbytes
        emb.to_device(CPU)  # the budget took it after all: the registrations go
    else:
        assert [r for r in caplog.records if "could not pin" in r.getMessage()]
    assert sorted(cudart.released) == sorted(p for p, _ in cudart.registered)
    assert emb._registered == []


@pytest.mark.gpu
def test_the_device_reads_the_pinned_table_eagerly_and_in_a_captured_graph(rng_seed):
    from freetoken_agent.engine.layers.embedding import TokenEmbedding

    gen = torch.Generator().manual_seed(rng_seed)
    vocab, hidden = 5000 + int(torch.randint(3000, (1,), generator=gen)), 2048
    emb = TokenEmbedding(vocab, hidden, on_host=True)
    emb.weight.data = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    assert emb.pin() and emb.weight.is_pinned() and emb.device_nbytes == 0
    table = emb.weight.detach().cuda()  # what an on-device table gives
    ids = torch.randint(vocab, (777,), generator=gen).cuda()
    assert torch.equal(emb(ids), table[ids])  # eager: a prefill chunk
    static = torch.zeros(4, dtype=torch.long, device="cuda")
    emb(static)  # warm-up (the kernel's compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = emb(static)
    for _ in range(3):  # decode steps: new ids, one replay each
        static.copy_(torch.randint(vocab, (4,), generator=gen))
        graph.replay()
        assert torch.equal(out, table[static])


@pytest.mark.gpu
def test_offloaded_engine_on_cuda_keeps_the_table_on_the_host(tmp_path, rng_seed):
    """Auto: an offloaded bank on CUDA leaves the table in pinned host memory, decode graphs
    read it, and the tokens are the resident engine's (whose table stays on the device)."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    opts = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4)
    resident = Engine.load(tmp_path, policy="resident", **opts)
    engine = Engine.load(tmp_path, policy="transfer", expert_slots=5, **opts)
    assert not resident.loaded.model.embed_tokens.on_host
    table = engine.loaded.model.embed_tokens
    assert table.on_host and table.weight.is_pinned()
    assert engine.loaded.dense_bytes == resident.loaded.dense_bytes - table.weight.nbytes
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (rng.randint(3, 30), 70)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    assert engine.runner.graphs is not None  # decode ran from captured graphs
    for e in (engine, resident):
        e.close()


def test_auto_asks_for_the_host_table_on_cuda_unless_the_environment_says_no(monkeypatch):
    from freetoken_agent.engine.loading import host_embeddings_asked

    spec = spec_from_config(tiny_config("qwen3_moe").to_dict())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("FREETOKEN_HOST_EMBEDDINGS", raising=False)
    assert host_embeddings_asked(spec, EngineConfig(policy="adaptive"), cuda)
    assert not host_embeddings_asked(spec, EngineConfig(policy="resident"), cuda)
    assert not host_embeddings_asked(spec, EngineConfig(policy="adaptive"), cpu)
    assert host_embeddings_asked(spec, EngineConfig(host_embeddings=True), cpu)
    monkeypatch.setenv("FREETOKEN_HOST_EMBEDDINGS", "0")
    assert not host_embeddings_asked(spec, EngineConfig(policy="adaptive"), cuda)
    assert host_embeddings_asked(spec, EngineConfig(host_embeddings=True), cuda)  # asked for
