"""L2 prefetch (kernels/l2_prefetch.py, kernels/triton/l2_prefetch.py): what a launch asks for,
that the CPU asks for nothing, and the compiled sm_90 kernel (prefetches, its one load of the
rows, no store). The GPU tests (tests/engine/test_pdl_gpu.py) check that it changes no bit."""

from __future__ import annotations

import random
import re

import pytest
import torch
from sm90_compile import compiled_json

from freetoken_agent.kernels import l2_prefetch
from freetoken_agent.kernels.triton import l2_prefetch as triton_prefetch


class _Launches:
    """Stands for the kernel: records each launch's grid and arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_a_launch_covers_the_bytes_asked_for(monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    kernel = _Launches()
    monkeypatch.setattr(triton_prefetch, "_prefetch_kernel", kernel)
    base = torch.zeros(8, dtype=torch.uint8)
    for _ in range(20):
        row_bytes, n_rows = rng.randint(1, 10_000_000), rng.randint(1, 16)
        rows = torch.tensor([rng.randint(-3, 50) for _ in range(n_rows)])
        triton_prefetch.prefetch(base, rows, 12345, row_bytes)
        grid, args, kwargs = kernel.calls[-1]
        lines = -(-row_bytes // triton_prefetch.LINE)
        chunks, r = grid
        assert r == n_rows and kwargs["ROWS"] is True
        # every line of the row is some program's, and no program is wholly past the row
        assert (chunks - 1) * kwargs["LINES"] < lines <= chunks * kwargs["LINES"]
        assert args[1] is rows and args[2] == 12345 and args[3] == row_bytes
    triton_prefetch.prefetch(base, None, 0, 300)
    grid, args, kwargs = kernel.calls[-1]
    assert grid == (1, 1) and kwargs["ROWS"] is False
    n = len(kernel.calls)
    triton_prefetch.prefetch(base, torch.zeros(0, dtype=torch.int64), 1, 300)  # no rows
    triton_prefetch.prefetch(base, None, 0, 0)  # no bytes
    assert len(kernel.calls) == n


def test_the_cpu_asks_for_nothing(monkeypatch):
    kernel = _Launches()
    monkeypatch.setattr(triton_prefetch, "_prefetch_kernel", kernel)
    l2_prefetch.prefetch_tensor(torch.randn(64, 32))
    l2_prefetch.prefetch_rows(torch.randn(6, 4, 8), torch.tensor([0, 3, -2]), 0.5)
    assert kernel.calls == []


def test_rows_of_a_strided_bank(monkeypatch, rng_seed):
    """prefetch_rows' arguments for a bank whose slots sit further apart than a row (an arena):
    the bank's first byte, the slot stride in bytes, the asked fraction of a row's bytes."""
    rng = random.Random(rng_seed)
    seen = []
    monkeypatch.setattr(l2_prefetch, "_active", lambda t: True)
    monkeypatch.setattr(triton_prefetch, "prefetch", lambda *a: seen.append(a))
    rows_n, a, b, pad = rng.randint(2, 9), rng.randint(1, 5), rng.randint(1, 7), rng.randint(0, 9)
    storage = torch.zeros(rows_n, a * b + pad, dtype=torch.bfloat16)
    bank = storage[:, : a * b].view(rows_n, a, b)  # [S, a, b], slots a * b + pad apart
    rows = torch.tensor([[rng.randint(-2, rows_n - 1) for _ in range(3)] for _ in range(2)])
    fraction = rng.uniform(0.1, 1.0)
    l2_prefetch.prefetch_rows(bank, rows, fraction)
    ((base, flat, stride, row_bytes),) = seen
    assert base.data_ptr() == bank.data_ptr() and base.dtype == torch.uint8
    assert torch.equal(flat, rows.reshape(-1))
    assert stride == (a * b + pad) * 2 and row_bytes == int(a * b * 2 * fraction)
    with pytest.raises(AssertionError):
        l2_prefetch.prefetch_rows(bank, rows, 1.5)


_COMPILE = """
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.l2_prefetch import _prefetch_kernel as fn
out = {}
for rows in (True, False):
    consts = dict(LINES=256, ROWS=rows)
    sig = {"base_ptr": "*u8", "rows_ptr": "*i64", "row_stride": "i64", "row_bytes": "i64",
           **{k: "constexpr" for k in consts}}
    out[str(rows)] = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=4)).asm["ptx"]
print(json.dumps(out))
"""


def test_sm90_code_prefetches_and_stores_nothing():
    ptx = compiled_json(_COMPILE)
    for rows, code in ptx.items():
        assert "prefetch.global.L2 " in code
        assert "st.global" not in code
        assert len(re.findall(r"ld\.global", code)) == (1 if rows == "True" else 0), rows
