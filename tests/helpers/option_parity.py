"""An engine option that only changes kernels must not change results: the checks the decode
kernels' switches share (EngineConfig.skinny_gemv, fused_router, fused_proj_norm,
fused_norm_qkv, attention_block)."""

from __future__ import annotations

import random

from tiny_models import make_tiny, max_rel_err


def assert_option_keeps_results_on_cuda(tmp_path, rng_seed: int, **option: bool) -> None:
    """fp32 tiny model on CUDA, decode under graphs: the same greedy tokens, and the same
    logits within fp32 rounding, with the boolean `option` on as off. Decoded one sequence at a
    time as well as two together: the fused kernels run one-row steps only."""
    from freetoken_agent import Engine, SamplingParams

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 40)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    opts = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4)
    off = {name: not on for name, on in option.items()}
    base = Engine.load(tmp_path, **off, **opts)
    changed = Engine.load(tmp_path, **option, **opts)
    want = [o.token_ids for o in base.generate(prompts, sp)]
    assert [o.token_ids for o in changed.generate(prompts, sp)] == want, option
    for prompt in prompts:  # against the same one-row steps without it
        alone = base.generate([prompt], sp)[0].token_ids
        assert changed.generate([prompt], sp)[0].token_ids == alone, option
    ids = prompts[1] + want[1]
    assert max_rel_err(changed.score(ids), base.score(ids)) <= 1e-4, option


def assert_switch_reaches_layers_on_cpu(tmp_path, rng_seed: int, family: str, option: str) -> None:
    """A decoder-layer switch (`option`, an EngineConfig field and the DecoderLayer attribute
    of the same name) reaches every layer of a tiny `family` model on, none off; on the CPU
    the switched layers compute what the plain ones do: the same tokens and logits."""
    import torch

    from freetoken_agent import Engine, SamplingParams
    from freetoken_agent.engine.models.base import DecoderLayer

    make_tiny(family, tmp_path, rng_seed)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(rng_seed)
    prompt = [int(t) for t in torch.randint(3, 300, (12,), generator=gen)]
    tokens, logits = [], []
    for on in (False, True):
        engine = Engine.load(tmp_path, device="cpu", progress=False, **{option: on})
        layers = [m for m in engine.loaded.model.modules() if isinstance(m, DecoderLayer)]
        assert len(layers) > 1 and all(getattr(m, option) == on for m in layers)
        tokens.append(engine.generate(prompt, sp).token_ids)
        logits.append(engine.score(prompt + tokens[-1]))
    assert tokens[0] == tokens[1]
    assert torch.equal(logits[0], logits[1])


def assert_switch_keeps_tokens_on_cpu(tmp_path, rng_seed: int, option: str) -> None:
    """A tiny Qwen3 model on the CPU with the boolean EngineConfig `option` off, then on: the
    same greedy tokens for two prompts decoded together (wider steps) and the first alone
    (one-row steps), so a switch serving only one-row steps is run both ways."""
    import torch

    from freetoken_agent import Engine, SamplingParams

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [[int(t) for t in torch.randint(3, 300, (n,), generator=gen)] for n in (9, 14)]
    out = {}
    for on in (False, True):
        engine = Engine.load(tmp_path, device="cpu", progress=False, **{option: on})
        out[on] = [o.token_ids for o in engine.generate(prompts, sp)]
        out[on].append(engine.generate(prompts[0], sp).token_ids)
    assert out[True] == out[False], option
