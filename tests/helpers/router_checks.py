"""What router tests check of top-k weights (tests/kernels/test_router.py, test_route.py)."""

from __future__ import annotations

import torch
from torch import Tensor


def check_weights(w: Tensor, ref: Tensor, round_to: torch.dtype | None, tol: float) -> None:
    """Within tol; rounded weights within one ulp of round_to, and bitwise nearly everywhere
    (a few fp32 ulps of difference only matter on a rounding boundary of round_to)."""
    assert w.shape == ref.shape and not w.isnan().any(), "weights left unwritten"
    w, ref = w.double().cpu(), ref.double().cpu()
    if round_to is None:
        torch.testing.assert_close(w, ref, atol=tol, rtol=0)
        return
    assert torch.equal(w, w.to(round_to).double()), f"weights not rounded to {round_to}"
    assert ((w - ref).abs() <= ref.abs() * 2.0**-7).all(), "more than one ulp of round_to"
    mismatch = int((w != ref).sum())
    assert mismatch <= 1 + w.numel() // 1000, f"{mismatch} weights differ: a systematic error"
