"""Which implementation a kernel call takes: Triton for CUDA tensors, the plain-torch twin of
`kernels/reference.py` otherwise; `force_triton=True` runs CPU tensors through the Triton kernel
in Triton's interpreter (tests), which must have been switched on before triton was imported."""

from __future__ import annotations

import os

from torch import Tensor


def use_triton(tensor: Tensor, force_triton: bool, kernel: str) -> bool:
    if tensor.is_cuda:
        return True
    if not force_triton:
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{kernel}(force_triton=True) on CPU tensors needs TRITON_INTERPRET=1 set before "
            "triton is imported"
        )
    return True
