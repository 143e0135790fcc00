"""What router tests check of top-k weights (tests/kernels/test_router.py, test_route.py)."""

from __future__ import annotations

import torch
from torch import Tensor

# How far (relative) a kernel's fp32 weight may sit from the twin's before rounding: 16 fp32
# ulps, room for another order of the softmax's sum and a fused division.
FP32_SLACK = 2.0**-19


def check_weights(w: Tensor, ref: Tensor, round_to: torch.dtype | None, tol: float,
                  unrounded: Tensor | None = None) -> None:  # fmt: skip
    """Within tol of the twin's weights ref; rounded to round_to, bitwise the twin's except
    where the twin's value before rounding (`unrounded`, required then) lies within
    FP32_SLACK of a rounding boundary of round_to, where either neighbour is right. A bound
    on how many may differ instead failed on real boundaries: fp16 logits two ulps apart give
    top-2 weights of 0.5 +- 2^-10 (a bf16 midpoint below 0.5) in every row that has them."""
    assert w.shape == ref.shape and not w.isnan().any(), "weights left unwritten"
    w, ref = w.double().cpu(), ref.double().cpu()
    if round_to is None:
        torch.testing.assert_close(w, ref, atol=tol, rtol=0)
        return
    assert unrounded is not None, "rounded weights are checked against the unrounded twin"
    assert torch.equal(w, w.to(round_to).double()), f"weights not rounded to {round_to}"
    exact = unrounded.double().cpu()
    low = (exact * (1 - FP32_SLACK)).float().to(round_to).double()
    high = (exact * (1 + FP32_SLACK)).float().to(round_to).double()
    assert ((ref == low) | (ref == high)).all(), "ref is not the rounding of unrounded"
    wrong = (w != low) & (w != high)
    assert not wrong.any(), (
        f"{int(wrong.sum())} weights are not the twin's rounding: {w[wrong].tolist()} "
        f"where the twin before rounding holds {exact[wrong].tolist()}"
    )
