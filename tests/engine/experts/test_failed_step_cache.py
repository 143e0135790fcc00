"""A step that fails after the expert cache filled slots (the CPU branch raising, here injected)
fails its own requests only: the cache's host maps and device table stay one picture, and later
requests decode the tokens a resident engine gives."""

from __future__ import annotations

import contextlib
import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import miss_placement


@pytest.mark.parametrize("policy", ["transfer", "adaptive"])
def test_a_failed_cpu_branch_after_fills_leaves_the_cache_whole(
    tmp_path, rng_seed, monkeypatch, policy
):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec = resident.spec
    slots = rng.randint(1, max(1, spec.n_experts // 2))  # few: fills evict, misses go to the CPU
    engine = Engine.load(tmp_path, device="cpu", policy=policy, expert_slots=slots,
                         progress=False)  # fmt: skip
    cache = engine.loaded.bank.cache
    fill, real_run = cache.fill, miss_placement.run_on_cpu
    state = {"filled": False, "failed": 0}

    def recording_fill(*args, **kwargs):
        filled = fill(*args, **kwargs)
        state["filled"] = bool(filled)
        return filled

    def failing_run(*args, **kwargs):
        if state["filled"] and not state["failed"]:  # right after a fill that took slots
            state["failed"] += 1
            raise RuntimeError("injected: the CPU branch failed")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(cache, "fill", recording_fill)
    monkeypatch.setattr(miss_placement, "run_on_cpu", failing_run)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for _ in range(20):  # until a step fails where the fault was put
        out = engine.generate([rng.randrange(3, 320) for _ in range(rng.randint(8, 60))], sp)
        if state["failed"]:
            break
    assert state["failed"] == 1, "no CPU branch ran after a fill"
    assert out.finish_reason == "error" and "injected" in out.error
    engine.check_integrity()
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    assert [o.token_ids for o in engine.generate(prompts, sp)] == [
        o.token_ids for o in resident.generate(prompts, sp)
    ]
    engine.check_integrity()


@pytest.mark.parametrize("where", ["copy", "claim", "publish"])
@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_a_fill_cut_short_leaves_host_maps_and_device_table_agreeing(
    tmp_path, rng_seed, monkeypatch, fault, where
):
    """A copy that fails, or a Ctrl-C landing between a slot's claim and its copy: the host
    maps had named the lid (and let its victim go) while the device table did not hear of it,
    and later requests ran with the wrong experts, with no error. The fault lands in the copy,
    inside the claim (after the maps changed), or between a deferred publish's fill and the
    publish. The fill's lids are undone, or the step's end writes the device table from the
    host maps: later requests give resident's tokens."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    slots = rng.randint(2, max(2, resident.spec.n_experts // 2))
    engine = Engine.load(tmp_path, device="cpu", policy="transfer", expert_slots=slots,
                         progress=False)  # fmt: skip
    cache = engine.loaded.bank.cache
    at = cache.fills + rng.randint(slots + 1, 3 * slots)  # past the first fills: evicting
    fired: list[int] = []

    def faulty(real):
        def call(*args, **kwargs):
            if cache.fills >= at and not fired:
                fired.append(cache.fills)
                raise fault(f"injected: the fill's {where} failed")
            return real(*args, **kwargs)

        return call

    if where == "claim":  # after the maps changed, before the claim returns
        monkeypatch.setattr(cache.races, "start", faulty(cache.races.start))
    else:
        name = "_copy_in" if where == "copy" else "publish"
        monkeypatch.setattr(cache, name, faulty(getattr(cache, name)))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    with pytest.raises(fault) if fault is KeyboardInterrupt else contextlib.nullcontext():
        for _ in range(20):  # until the fault's fill comes
            engine.generate(prompts, sp)
            if fired:
                break
    assert fired, "no fill reached the fault"
    engine.check_integrity()
    monkeypatch.undo()
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    engine.check_integrity()


def _fail_a_streamed_prompt(engine, monkeypatch, rng, sp: SamplingParams, prompt_len: int) -> None:
    """A prompt whose streamed chunk fails at one of its layers (the 2nd to the last MoE
    layer's launches, drawn): its request fails alone, naming the error; the launches work
    again after."""
    from freetoken_agent.engine.experts import streaming

    real, calls = streaming.MoeParts.add, {"n": 0}
    failing_call = rng.randint(2, engine.spec.n_moe_layers)

    def failing(parts, *args, **kwargs):  # a streamed layer's launches
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise RuntimeError("injected: a streamed layer failed")
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(streaming.MoeParts, "add", failing)
    out = engine.generate([rng.randrange(3, 320) for _ in range(prompt_len)], sp)
    monkeypatch.setattr(streaming.MoeParts, "add", real)
    assert out.finish_reason == "error" and "injected" in out.error


@pytest.mark.parametrize("cut", ["busy", "idle"])
def test_a_streamed_chunk_failing_midway_gives_its_staging_slots_back(
    tmp_path, rng_seed, monkeypatch, cut
):
    """Prefill staging lent from the cache's slots (an elastic budget of 3E+2 slots); one of a
    streamed chunk's layers fails. Its request fails alone; the slots it borrowed go back at
    the next safe point, so a budget cut there (with a request waiting, or on an idle engine)
    moves the split, and a later request decodes the resident tokens (it asserted on the lent
    cache at every step, so nothing ran again)."""
    from freetoken_agent.engine.experts.placement import workspace_bytes
    from freetoken_agent.engine.kv.pool import KVPool
    from freetoken_agent.engine.loading import dense_nbytes

    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=2048,
              num_hidden_layers=rng.randint(4, 6), mlp_only_layers=[])  # fmt: skip
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec, config = resident.spec, resident.config
    page = KVPool.page_bytes(len(spec.attention_layers), config.page_size, spec.n_kv_heads,
                             spec.head_dim, spec.dtype)  # fmt: skip
    slots = 3 * spec.n_experts + 2
    budget = (dense_nbytes(resident.loaded.model) + workspace_bytes(spec, config, offloaded=True)
              + 33 * page + (slots + 1) * spec.expert_bytes)  # fmt: skip
    # The workspace kept whole (not lent to slots): the cut's arithmetic counts all of it.
    engine = Engine.load(tmp_path, device="cpu", policy="transfer", progress=False,
                         gpu_budget=budget, kv_tokens=512, stream_min_tokens=32,
                         lend_workspace=False)  # fmt: skip
    bank, memory = engine.loaded.bank, engine.memory
    assert bank.streamer.lend, "the staging is not lent from the cache: the test is void"
    sp = SamplingParams(max_tokens=rng.randint(4, 16), temperature=0, ignore_eos=True)
    _fail_a_streamed_prompt(engine, monkeypatch, rng, sp, rng.randint(40, 120))
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(5, 20))]
    slots_before = bank.cache.n_slots
    need = -(-(len(prompt) + sp.max_tokens) // config.page_size) + 2  # pages, with room
    cut_to = memory.floor + need * memory.arena.kv_unit.nbytes  # the request fits; slots go
    if cut == "idle":
        engine.set_gpu_budget(cut_to)
        out = engine.generate(prompt, sp)
    else:
        rid = engine.submit(prompt, sp)
        engine.set_gpu_budget(cut_to)
        while engine.has_unfinished():
            engine.step()
        out = engine._collect(rid)
    assert bank.cache.n_slots < slots_before and bank.cache.lent == 0
    assert (out.finish_reason, out.error) == ("length", None), rng_seed
    assert out.token_ids == resident.generate(prompt, sp).token_ids, rng_seed
    engine.check_integrity()


def test_a_failed_streamed_chunk_gives_the_ring_its_slots_back_at_once(
    tmp_path, rng_seed, monkeypatch
):
    """Without elastic memory (a fixed slot count) no safe point ends a streamed chunk that
    failed midway: the step's own failure handling does, so the slots lent to the ring are
    back before the next step. On CUDA the decode steps after it replay graphs, which never
    call the bank, and held those slots out of service (a review's reading)."""
    rng = random.Random(rng_seed)
    # 4-6 layers: the 3E+1..4 slots leave a layer absent, so the ring is lent from them
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_hidden_layers=rng.randint(4, 6),
              mlp_only_layers=[])  # fmt: skip
    resident = Engine.load(tmp_path, device="cpu", policy="resident", progress=False)
    spec = resident.spec
    engine = Engine.load(tmp_path, device="cpu", policy="transfer", progress=False,
                         expert_slots=3 * spec.n_experts + rng.randint(1, 4),
                         stream_min_tokens=32)  # fmt: skip
    bank = engine.loaded.bank
    assert engine.memory is None and bank.streamer.lend, "no lent ring: the test is void"
    slots = bank.cache.n_slots
    sp = SamplingParams(max_tokens=rng.randint(2, 6), temperature=0, ignore_eos=True)
    _fail_a_streamed_prompt(engine, monkeypatch, rng, sp, rng.randint(40, 90))
    assert bank.cache.lent == 0 and not bank.streamer.active and bank.cache.n_slots == slots
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(5, 20))]
    assert engine.generate(prompt, sp).token_ids == resident.generate(prompt, sp).token_ids
    engine.check_integrity()
