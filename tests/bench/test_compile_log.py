"""The compile log: Triton variants built while it listens, each with its kernel, variant and
seconds; the hooks it replaced come back when it closes."""

from __future__ import annotations

import io
import random

import pytest

from freetoken_agent.bench.compile_log import CompileLog

triton = pytest.importorskip("triton")


def test_hooks_are_installed_and_restored():
    runtime = triton.knobs.runtime
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    log = CompileLog()
    assert log.available
    assert runtime.jit_cache_hook == log._before and runtime.jit_post_compile_hook == log._after
    log.close()
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == before


@pytest.mark.gpu
def test_a_new_variant_is_recorded_with_its_time(rng_seed):
    import torch
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)

    factor = random.Random(rng_seed).randint(2, 10**6)  # a variant no cache has seen
    out = io.StringIO()
    log = CompileLog(out)
    try:
        x = torch.ones(100, device="cuda")
        scale[(1,)](x, 100, FACTOR=factor, BLOCK=128)
        scale[(1,)](x, 100, FACTOR=factor, BLOCK=128)  # the same variant: no second record
        torch.cuda.synchronize()
    finally:
        log.close()
    assert torch.equal(x, torch.full_like(x, float(factor) ** 2))
    [record] = log.take()
    assert record["kernel"].endswith("scale") and record["seconds"] > 0
    assert "x_ptr" in record["variant"] and out.getvalue().startswith("compile ")
    assert str(factor) in record["key"]  # the key spells the constexprs
    assert log.take() == []
