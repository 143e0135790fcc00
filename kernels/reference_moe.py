"""Plain-torch twin of the fused MoE expert computation: the test oracle and the CPU fallback.

DESIGN section 4 puts every twin in `kernels/reference.py`; that file passed the 400-line limit,
so the fused MoE's twin lives here: `fused_moe` with its SwiGLU over a range of an expert's
columns (`swiglu_columns`), the ids of host-bank rows (`host_ids`), and the contract checks the
Triton kernels share (`check_moe_shapes`, `check_host_banks`, `check_slot_cols`, `check_add`).
reference.py re-exports them all, where callers import them. The dispatcher is
`kernels/fused_moe.py`.
"""

# Shape legend (shared with `kernels/triton/fused_moe.py`):
#   T tokens, H hidden, I expert intermediate width, K top-k, N rows in a weight bank,
#   P = T * K (token, choice) pairs; pair p = t * K + k.
#   hidden       [T, H]       fp32 / fp16 / bf16
#   w13          [N, 2I, H]   per row: gate_proj.weight in rows 0..I-1, up_proj.weight in I..2I-1
#   w2           [N, H, I]    down_proj.weight
#   topk_ids     [T, K]       int32 / int64 bank row ids; a negative id skips that (t, k)
#   topk_weights [T, K]       float32 routing weights
#   out          [T, H]       hidden.dtype
#
# Bank rows are whatever the caller maps expert ids to (a logical id `layer * n_experts + expert`
# today, a GPU cache slot later); this code only indexes rows.
#
# Numerics: every product is computed in fp32 (float64 for float64 inputs) from upcast inputs,
# the SwiGLU activation stays in fp32, the routing-weighted sum over k runs in fp32 in the fixed
# order k = 0..K-1, and the result is cast to hidden.dtype once. The Triton kernels do the same
# except where tensor cores need 16-bit operands for the down projection: the decode path keeps
# the activation as a high + low 16-bit pair (about 16 significant bits), the prefill path rounds
# it to the weight dtype once.
#
# The reference groups pairs by bank row, so each row is upcast once per call. The matmuls go
# through torch's CPU BLAS, whose blocking may depend on how many tokens share a row: results are
# deterministic for a given batch but only float-close (not bitwise) across batch compositions.

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_moe_shapes(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """Assert the fused-MoE contract and return (T, H, I, K)."""
    assert hidden.dim() == 2, f"hidden must be [T, H], got {tuple(hidden.shape)}"
    t, h = hidden.shape
    assert w13.dim() == 3 and w13.shape[2] == h and w13.shape[1] % 2 == 0, (
        f"w13 must be [N, 2I, H={h}], got {tuple(w13.shape)}"
    )
    n, i = w13.shape[0], w13.shape[1] // 2
    assert tuple(w2.shape) == (n, h, i), f"w2 must be [N={n}, H={h}, I={i}], got {tuple(w2.shape)}"
    assert w13.dtype == hidden.dtype and w2.dtype == hidden.dtype, (
        f"dtypes differ: hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    )
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t, (
        f"topk_ids must be [T={t}, K], got {tuple(topk_ids.shape)}"
    )
    assert topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids dtype {topk_ids.dtype}"
    k = topk_ids.shape[1]
    assert tuple(topk_weights.shape) == (t, k), (
        f"topk_weights must be [T={t}, K={k}], got {tuple(topk_weights.shape)}"
    )
    # fp32 routing weights; float64 runs (CPU exactness tests) carry float64 ones.
    wide = torch.promote_types(hidden.dtype, torch.float32)
    assert topk_weights.dtype == wide, f"topk_weights must be {wide}, got {topk_weights.dtype}"
    if out is not None:  # or the sum unrounded, in `wide`, for a later call to `add`
        assert tuple(out.shape) == (t, h) and out.dtype in (hidden.dtype, wide), (
            f"out must be [T={t}, H={h}] {hidden.dtype} (or {wide}), got {tuple(out.shape)} "
            f"{out.dtype}"
        )
    return t, h, i, k


def host_ids(rows: torch.Tensor) -> torch.Tensor:
    """The ids that send pairs to rows of the host banks (`fused_moe`'s host_w13 / host_w2):
    row r is id -r - 2, so every host row keeps an id of its own and -1 still means skip."""
    return -rows - 2


def check_host_banks(w13: torch.Tensor, host_w13: torch.Tensor, host_w2: torch.Tensor) -> None:
    """Host banks hold rows of the same experts' shape and dtype as the device banks."""
    _, two_i, h = w13.shape
    assert host_w13.dim() == 3 and tuple(host_w13.shape[1:]) == (two_i, h), (
        f"host_w13 must be [N, 2I={two_i}, H={h}], got {tuple(host_w13.shape)}"
    )
    n, i = host_w13.shape[0], two_i // 2
    assert tuple(host_w2.shape) == (n, h, i), (
        f"host_w2 must be [N={n}, H={h}, I={i}], got {tuple(host_w2.shape)}"
    )
    assert host_w13.dtype == w13.dtype and host_w2.dtype == w13.dtype, (
        f"host bank dtypes {host_w13.dtype}, {host_w2.dtype} differ from {w13.dtype}"
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
    host_w13: torch.Tensor | None = None,
    host_w2: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    fill_slot_of: torch.Tensor | None = None,
    slot_cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden[t]); SwiGLU experts.
    With host banks, an id <= -2 names row -id - 2 of host_w13 / host_w2 (`host_ids`).
    `add` [T, H]: added to the sum before its rounding to out's dtype, then zeroed (`check_add`).
    `fill_slot_of` [Nh] int32 (fill-through): host row r is also copied into slot
    fill_slot_of[r] of w13 / w2 where that is >= 0 (the kernels store the tiles they read).
    `slot_cols` [N] int32 (the split expert's device half): bank row r holds only columns
    [0, slot_cols[r]) of its width (gate and up rows, w2's columns), and computes those; I is a
    whole row. Host rows are always whole."""
    t, h, i, k = check_moe_shapes(hidden, w13, w2, topk_ids, topk_weights, out)
    check_add(add, hidden)
    check_slot_cols(slot_cols, w13)
    host = host_w13 is not None
    if host:
        check_host_banks(w13, host_w13, host_w2)
    if fill_slot_of is not None:
        assert host, "fill-through needs host banks"
        for lid in torch.unique(-topk_ids[topk_ids < -1].long() - 2).tolist():
            slot = int(fill_slot_of[lid])
            if slot >= 0:
                w13[slot].copy_(host_w13[lid])
                w2[slot].copy_(host_w2[lid])
    if out is None:
        out = torch.empty_like(hidden)
    ids = topk_ids.reshape(-1).long()  # [P]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or float64 for float64
    y = torch.zeros(t * k, h, dtype=acc_dtype, device=hidden.device)  # [P, H] per-pair outputs
    live = ids != -1 if host else ids >= 0  # [P] pairs that compute
    # A host sync (unique) is fine here: this is the oracle and the CPU path.
    for row in torch.unique(ids[live]).tolist():
        pairs = (ids == row).nonzero().squeeze(1)  # [m] pairs that picked this bank row
        bank13, bank2, r = (host_w13, host_w2, -row - 2) if row < 0 else (w13, w2, row)
        x = hidden[pairs // k].to(acc_dtype)  # [m, H]
        c = i if row < 0 or slot_cols is None else int(slot_cols[r])  # columns it holds
        y[pairs] = swiglu_columns(x, bank13[r], bank2[r], 0, c)  # [m, H]
    y = y.view(t, k, h)
    weights = topk_weights.masked_fill(~live.view(t, k), 0.0)  # [T, K] a skipped pair adds 0
    acc = torch.zeros(t, h, dtype=acc_dtype, device=hidden.device)  # [T, H]
    for j in range(k):  # fixed order over k
        acc += weights[:, j, None] * y[:, j]
    if add is not None:
        acc += add.to(acc_dtype)
        add.zero_()
    out.copy_(acc)
    return out


def swiglu_columns(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, c0: int, c1: int
) -> torch.Tensor:
    """One expert's SwiGLU over columns [c0, c1) of its width I, in x's dtype and device:
    x [m, H], w13 [2I, H], w2 [H, I] (cast and moved here) -> [m, H]. The whole width is one
    matmul over w13 as it always was; a slice reads its gate rows [c0, c1), its up rows
    [I + c0, I + c1) and w2's columns [c0, c1). SwiGLU is elementwise over I, so
    complementary slices sum to the whole expert."""
    i = w2.shape[1]
    cast = lambda w: w.to(device=x.device, dtype=x.dtype)  # noqa: E731
    if (c0, c1) == (0, i):
        gate_up = x @ cast(w13).t()  # [m, 2I]
        gate, up = gate_up[:, :i], gate_up[:, i:]
    else:
        gate = x @ cast(w13[c0:c1]).t()  # [m, c1 - c0]
        up = x @ cast(w13[i + c0 : i + c1]).t()
    return (F.silu(gate) * up) @ cast(w2[:, c0:c1]).t()


def check_slot_cols(slot_cols: torch.Tensor | None, w13: torch.Tensor) -> None:
    """`fused_moe`'s `slot_cols`: [N] int32 on the bank's device. Its values (in [1, I]) are
    not read here: that would be a device sync inside a decode graph."""
    if slot_cols is None:
        return
    n = w13.shape[0]
    if slot_cols.shape != (n,) or slot_cols.dtype != torch.int32:
        raise ValueError(f"slot_cols must be [N={n}] int32, got {tuple(slot_cols.shape)} "
                         f"{slot_cols.dtype}")  # fmt: skip
    if slot_cols.device != w13.device:
        raise ValueError(f"slot_cols must be on the bank's device {w13.device}")


def check_add(add: torch.Tensor | None, hidden: torch.Tensor) -> None:
    """`fused_moe`'s `add`: a contiguous [T, H] buffer beside hidden [T, H]. It carries a part
    of the sum computed elsewhere (the offloaded bank's CPU branch), written again before each
    use: the kernel consumes it, leaving zeros, so a step whose branch computed nothing adds
    nothing without a clear of its own (one less kernel a layer in decode graphs)."""
    if add is None:
        return
    assert add.shape == hidden.shape and add.is_contiguous(), (
        f"add must be a contiguous {tuple(hidden.shape)} tensor, got {tuple(add.shape)}"
    )
    assert add.device == hidden.device, f"add on {add.device}, hidden on {hidden.device}"
