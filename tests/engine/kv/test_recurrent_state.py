"""RecurrentStatePool: slot allocation, the scratch slot, zeroing, layer views, sizes."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.engine.kv.checkpoints import CheckpointPool
from freetoken_agent.engine.kv.recurrent_state import (
    SCRATCH_SLOT,
    OutOfStateSlots,
    RecurrentStatePool,
)

# L layers, N slots, C conv channels, K conv width, Hv value heads, Dk / Dv head dims
L, N, C, KM1, HV, DK, DV = 3, 6, 10, 3, 2, 4, 5
CONV, SSM = (C, KM1), (HV, DK, DV)


def _pool(dtype: torch.dtype = torch.bfloat16) -> RecurrentStatePool:
    return RecurrentStatePool(L, N, CONV, SSM, dtype, "cpu")


def _fill_random(pool: RecurrentStatePool, gen: torch.Generator) -> None:
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen).to(pool.conv.dtype))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=gen, dtype=pool.ssm.dtype))


def test_alloc_free_and_scratch(rng_seed):
    pool = _pool()
    assert pool.capacity == N - 1 and pool.n_free == N - 1
    slots = [pool.alloc() for _ in range(N - 1)]
    pool.check_integrity()
    assert sorted(slots) == list(range(1, N)), "every slot but the scratch one, each once"
    assert pool.n_free == 0 and all(pool.is_allocated(s) for s in slots)
    with pytest.raises(OutOfStateSlots, match=f"all {N - 1} recurrent-state slots"):
        pool.alloc()
    assert isinstance(OutOfStateSlots("x"), RuntimeError)
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(rng_seed))
    for i in order.tolist():
        pool.free(slots[i])
        pool.check_integrity()
        with pytest.raises(AssertionError, match="double free"):
            pool.free(slots[i])
    assert pool.n_free == N - 1
    with pytest.raises(AssertionError, match="scratch"):
        pool.free(SCRATCH_SLOT)
    with pytest.raises(AssertionError, match="out of range"):
        pool.free(N)
    pool.check_integrity()


def test_alloc_zeroes_only_its_slot(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    pool = _pool()
    held = [pool.alloc() for _ in range(N - 1)]
    _fill_random(pool, gen)  # every slot, scratch included, holds a live-looking state
    conv, ssm = pool.conv.clone(), pool.ssm.clone()
    victim = held[int(torch.randint(len(held), (1,), generator=gen))]
    pool.free(victim)
    again = pool.alloc()
    assert again == victim  # the only free slot
    assert torch.count_nonzero(pool.conv[:, again]) == 0
    assert torch.count_nonzero(pool.ssm[:, again]) == 0
    others = [s for s in range(N) if s != again]
    assert torch.equal(pool.conv[:, others], conv[:, others]), "zeroing leaked to other slots"
    assert torch.equal(pool.ssm[:, others], ssm[:, others])
    assert torch.count_nonzero(conv[:, again]) > 0, "the test must start from a nonzero state"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_and_sizes(dtype):
    pool = _pool(dtype)
    expected_ssm = torch.float64 if dtype == torch.float64 else torch.float32
    assert pool.conv.dtype == dtype and pool.ssm.dtype == expected_ssm
    assert pool.conv.shape == (L, N, C, KM1) and pool.ssm.shape == (L, N, HV, DK, DV)
    per_slot = RecurrentStatePool.bytes_per_slot(L, CONV, SSM, dtype)
    assert per_slot * N == pool.nbytes
    assert per_slot == CheckpointPool.bytes_per_checkpoint(L, CONV, SSM, dtype)
    item = torch.tensor([], dtype=dtype).element_size()
    assert per_slot == L * (C * KM1 * item + HV * DK * DV * expected_ssm.itemsize)


def test_view_slices_alias_the_pools(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    pool = _pool()
    ckpts = CheckpointPool(L, 4, 2, CONV, SSM, torch.bfloat16, "cpu")
    # Random contents everywhere first: the device tier is uninitialised memory, which may
    # hold NaNs (never equal to themselves).
    ckpts.ssm.copy_(torch.randn(ckpts.ssm.shape, generator=gen))
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen).to(pool.conv.dtype))
    for layer in range(L):
        view = pool.view(layer, ckpts)
        assert view.conv.shape == (N, C, KM1) and view.ssm.shape == (N, HV, DK, DV)
        assert view.conv_snap.shape == (4, C, KM1) and view.ssm_snap.shape == (4, HV, DK, DV)
        assert view.ssm.dtype == view.ssm_snap.dtype == torch.float32
        assert view.conv.is_contiguous() and view.ssm.is_contiguous()
        assert view.conv_snap.is_contiguous() and view.ssm_snap.is_contiguous()
        # A kernel writing through the view writes this layer's rows of the pools, no other.
        conv = torch.randn(view.conv.shape, generator=gen).to(torch.bfloat16)
        snap = torch.randn(view.ssm_snap.shape, generator=gen)
        before_conv, before_snap = pool.conv.clone(), ckpts.ssm.clone()
        view.conv.copy_(conv)
        view.ssm_snap.copy_(snap)
        assert torch.equal(pool.conv[layer], conv) and torch.equal(ckpts.ssm[layer], snap)
        rest = [i for i in range(L) if i != layer]
        assert torch.equal(pool.conv[rest], before_conv[rest])
        assert torch.equal(ckpts.ssm[rest], before_snap[rest])
    bare = pool.view(0, None)
    assert bare.conv_snap.shape == (0, C, KM1) and bare.ssm_snap.shape == (0, HV, DK, DV)
    with pytest.raises(IndexError):
        pool.view(L, ckpts)
    wrong = CheckpointPool(L, 4, 0, CONV, SSM, torch.float16, "cpu")
    with pytest.raises(ValueError, match="does not match"):
        pool.view(0, wrong)


def test_bad_construction_and_integrity_can_fail():
    with pytest.raises(ValueError, match="at least 2 slots"):
        RecurrentStatePool(L, 1, CONV, SSM, torch.float32, "cpu")
    with pytest.raises(ValueError, match="conv_shape"):
        RecurrentStatePool(L, N, (C, 1, KM1), SSM, torch.float32, "cpu")
    pool = _pool()
    pool.alloc()
    pool._free.append(pool._free[0])  # corrupt: a slot listed free twice
    with pytest.raises(AssertionError, match="duplicate"):
        pool.check_integrity()
    pool = _pool()
    pool._free.appendleft(SCRATCH_SLOT)
    with pytest.raises(AssertionError, match="scratch"):
        pool.check_integrity()
