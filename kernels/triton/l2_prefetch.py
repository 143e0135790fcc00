"""Ask L2 for bytes ahead of the kernel that reads them: `prefetch.global.L2`, one instruction a
128-byte line, nothing loaded into registers (dispatcher and why: kernels/l2_prefetch.py).

Normal eviction priority, not evict_last: the lines are read within microseconds, by the next
weight-streaming kernel, while the kernels between read little (attention over a short context,
the fill copy's few experts); lines marked evict_last would stay after that read, a step's
worth of them (~40 MB a layer) crowding the L2 for everything after.

Grid (chunks, rows): program (c, r) asks for lines c * LINES .. (c + 1) * LINES - 1 of row r's
first `row_bytes` bytes, where row r starts at base + rows[r] * row_stride bytes (with ROWS; a
negative rows[r] names a row not on the device: nothing) or at base + r * row_stride. The lines
past `row_bytes` ask for `base` instead (a valid address: the hint is harmless).
"""

# Shape legend: R rows asked for, B bytes asked for a row (at most the row's).

from __future__ import annotations

import triton
import triton.language as tl

LINE = 128  # bytes a prefetch covers
LINES = 256  # lines a program asks for: 32 KB


@triton.jit
def prefetch_lines(ptrs, ok, base):
    """The L2 prefetch of the lines at `ptrs` (a tensor of addresses, one a line; lanes where
    `ok` is false ask for `base`), for the kernel that reads them next."""
    safe = tl.where(ok, ptrs, base)
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.u32 $0, 0;",
        "=r,l",
        [safe],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_kernel(base_ptr, rows_ptr, row_stride, row_bytes,
                     LINES: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    c, r = tl.program_id(0), tl.program_id(1)
    row = r.to(tl.int64)
    if ROWS:  # the rows another kernel chose (stream order: it has completed)
        row = tl.load(rows_ptr + r).to(tl.int64)
    if row >= 0:
        offs = (c * LINES + tl.arange(0, LINES)).to(tl.int64) * 128  # bytes into the row
        prefetch_lines(base_ptr + row * row_stride + offs, offs < row_bytes, base_ptr)


def prefetch(base, rows, row_stride: int, row_bytes: int) -> None:
    """Launch for `base` (a uint8 view of the memory), rows [R] int64 or None (R = 1: one row
    at `base`), `row_bytes` B of each row from its start."""
    n_rows = 1 if rows is None else rows.numel()
    chunks = triton.cdiv(triton.cdiv(row_bytes, LINE), LINES)
    if n_rows == 0 or chunks == 0:
        return
    _prefetch_kernel[(chunks, n_rows)](
        base, base if rows is None else rows, row_stride, row_bytes,
        LINES=LINES, ROWS=rows is not None, num_warps=4,
    )  # fmt: skip
