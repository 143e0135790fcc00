"""An engine option that only changes kernels must not change results: the check the decode
kernels' switches share (EngineConfig.skinny_gemv, fused_router, fused_proj_norm)."""

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
