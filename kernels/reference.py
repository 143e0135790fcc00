"""Plain-torch twins of the kernels: the test oracle and the CPU fallback.

Every function here is the specification of a kernel in `kernels/triton/`: same signature, same
results within float tolerance. They favour clarity over speed, may synchronise with the host
(`.tolist()`), and must never be used on a hot GPU path.
"""

# Shape legend (paged attention):
#   T  query tokens of all sequences, flattened sequence after sequence
#   B  sequences in the batch
#   Hq query heads, Hkv kv heads, G = Hq // Hkv (GQA group: query head h reads kv head h // G)
#   D  head dim
#   P  pages in the KV cache, S tokens per page (a page holds S consecutive positions)
#   L  kv length of one sequence, n its query length

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Query rows processed at once per sequence: bounds the [Hq, rows, L] fp32 score tensor
# (a 32k-token prefill would otherwise need 32 * 32k * 32k * 4 bytes).
_REF_Q_CHUNK = 256


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write new tokens' K/V into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [P, S, Hkv, D] with each page's [S, Hkv, D] dense
    (pages may be strided: the KV pool lives in an elastic arena, engine/arena.py);
    slot_mapping: [T] int64, slot = page * S + offset. Serves the CPU and CUDA alike:
    `index_put_` with tensor indices has no host synchronisation, so it can be captured in a
    CUDA graph.
    """
    P, S, Hkv, D = k_cache.shape
    assert v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k.shape == v.shape and k.shape[1:] == (Hkv, D), (k.shape, v.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    page, offset = slot_mapping // S, slot_mapping % S
    k_cache.index_put_((page, offset), k.to(k_cache.dtype))
    v_cache.index_put_((page, offset), v.to(v_cache.dtype))


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_q_lens: Tensor,
    kv_lens: Tensor,
    scale: float,
    max_q_len: int,
    window: int = 0,
    out: Tensor | None = None,
    max_kv_len: int | None = None,
) -> Tensor:
    """Causal (optionally sliding-window) attention of a varlen batch over a paged KV cache.

    q: [T, Hq, D]; k_cache, v_cache: [P, S, Hkv, D]; page_table: [B, max_pages] int32;
    cu_q_lens: [B+1] int32; kv_lens: [B] int32 (including the new tokens, already stored).
    Query i of sequence b sits at position p = kv_len_b - q_len_b + i and attends to kv
    positions j <= p, and with window > 0 only to p - window < j <= p. Softmax in fp32 (fp64
    for fp64 inputs), output in q.dtype, written into `out` ([T, Hq, D]) when given. max_q_len
    and max_kv_len are launch hints of the Triton kernel, unused here.
    """
    T, Hq, D = q.shape
    P, S, Hkv, Dk = k_cache.shape
    B = page_table.shape[0]
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, (q.shape, k_cache.shape)
    assert cu_q_lens.shape == (B + 1,) and kv_lens.shape == (B,), (cu_q_lens.shape, kv_lens.shape)
    G = Hq // Hkv
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a float64 oracle
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape, (out.shape, q.shape)
    cu = cu_q_lens.tolist()  # host sync: acceptable in the reference only
    lens = kv_lens.tolist()
    for b in range(B):
        q0, n, L = cu[b], cu[b + 1] - cu[b], lens[b]
        if n == 0:
            continue
        if n > L:
            raise ValueError(f"sequence {b}: kv_len {L} < q_len {n} (new tokens must be stored)")
        pages = page_table[b, : (L + S - 1) // S].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:L].to(wide).permute(1, 2, 0)  # [Hkv, D, L]
        v = v_cache[pages].reshape(-1, Hkv, D)[:L].to(wide).permute(1, 0, 2)  # [Hkv, L, D]
        j = torch.arange(L, device=q.device)  # kv positions
        for c0 in range(0, n, _REF_Q_CHUNK):
            c1 = min(n, c0 + _REF_Q_CHUNK)
            qc = q[q0 + c0 : q0 + c1].to(wide).view(c1 - c0, Hkv, G, D).permute(1, 2, 0, 3)
            s = (qc @ k[:, None]) * scale  # [Hkv, G, c, L]
            pos = (L - n + torch.arange(c0, c1, device=q.device))[:, None]  # [c, 1]
            allowed = j[None, :] <= pos  # [c, L]
            if window > 0:
                allowed &= j[None, :] > pos - window
            s = s.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(s, dim=-1) @ v[:, None]  # [Hkv, G, c, D]
            out[q0 + c0 : q0 + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, Hq, D).to(out.dtype)
    return out


# --- fused MoE over rows of expert banks -----------------------------------------------
# Plain-torch twin of the fused MoE expert computation (test oracle and CPU fallback).
#
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
    if out is not None:
        assert tuple(out.shape) == (t, h) and out.dtype == hidden.dtype, (
            f"out must be [T={t}, H={h}] {hidden.dtype}, got {tuple(out.shape)} {out.dtype}"
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


# --- fused norm / rope / router (the decode path's small ops) -------------------------
# Shape legend (fused norm / rope / router):
#   T  tokens, H hidden size
#   Hq query heads, Hkv kv heads, D head dim, R rotary dims (even, <= D; dims R..D-1 pass through)
#   P  pages in the KV cache, S tokens per page (flat slot = page * S + offset)
#   E  routed experts, K top-k


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype of norms and softmax: fp32, or float64 for a float64 oracle."""
    return torch.promote_types(dtype, torch.float32)


def _rms_normalize(x: Tensor, weight: Tensor, eps: float, zero_centred: bool = False) -> Tensor:
    # engine/layers/norm.py RMSNorm.forward: statistics in fp32, cast back to the model dtype
    # before the weight multiply (a dtype multiply: torch computes it in fp32, rounds once).
    # Zero-centred (Qwen3-Next's RMSNorm): the stored weight is w - 1; n * (1 + w) is formed in
    # fp32 and rounded once, with no rounding of n in between.
    dtype = x.dtype
    x32 = x.to(_wide(dtype))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (x32 * (1.0 + weight.to(x32.dtype))).to(dtype)
    return weight * x32.to(dtype)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    zero_centred: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, optionally fused with the residual add before it.

    x: [T, H] fp32 / fp16 / bf16 (float64 here too); weight: [H], x.dtype; residual: [T, H].
    Without residual: returns y = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps)), [T, H].
    zero_centred: y = to_dtype(x32 * rsqrt(mean(x32^2) + eps) * (1 + weight32)) instead (the
    checkpoint stores w - 1; adding 1 in bf16 at load would round it away).
    With residual: s = x + residual in x.dtype (computed in fp32, rounded once, as transformers'
    `residual + hidden_states`), y = rms_norm(s); returns (y, s), the new residual stream s.
    """
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert weight.dtype == x.dtype, (x.dtype, weight.dtype)
    if residual is None:
        return _rms_normalize(x, weight, eps, zero_centred)
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    s = x + residual  # [T, H]
    return _rms_normalize(s, weight, eps, zero_centred), s


def _rotate_half(x: Tensor, cos: Tensor, sin: Tensor, r: int) -> Tensor:
    # engine/layers/rope.py `_rotate`: every op in the model dtype, so each product is rounded
    # to the dtype, then their sum.
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def qk_norm_rope_store(
    qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    """Split the stacked q/k/v projection, per-head RMSNorm q and k, RoPE them, store k and v.

    qkv: [T, (Hq + 2 * Hkv) * D] (q heads, then k heads, then v heads); positions: [T] int64;
    cos, sin: [max_pos, R] in qkv.dtype, laid out as cat(freqs, freqs) (GPT-NeoX rotate-half on
    dims 0..R-1, dims R..D-1 pass through); q_norm_weight, k_norm_weight: [D] or None (no norm);
    k_cache, v_cache: [P, S, Hkv, D], qkv.dtype; slot_mapping: [T] int64, every slot valid.
    Writes the normed, rotated k and the raw v at slot_mapping; returns q [T, Hq, D], normed and
    rotated, a new contiguous tensor.
    """
    T = qkv.shape[0]
    Hq, Hkv, D = n_heads, n_kv_heads, head_dim
    R = cos.shape[-1]
    assert qkv.dim() == 2 and qkv.shape[1] == (Hq + 2 * Hkv) * D, (qkv.shape, Hq, Hkv, D)
    assert cos.shape == sin.shape and R % 2 == 0 and R <= D, (cos.shape, sin.shape, D)
    assert positions.shape == (T,) and slot_mapping.shape == (T,), (positions.shape, T)
    assert k_cache.shape[2:] == (Hkv, D) and v_cache.shape == k_cache.shape, k_cache.shape
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = q.reshape(T, Hq, D)
    k = k.reshape(T, Hkv, D)
    v = v.reshape(T, Hkv, D)
    if q_norm_weight is not None:
        q = _rms_normalize(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = _rms_normalize(k, k_norm_weight, eps)
    c = cos[positions].unsqueeze(1)  # [T, 1, R]
    s = sin[positions].unsqueeze(1)
    q, k = _rotate_half(q, c, s, R), _rotate_half(k, c, s, R)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous()


def softmax_topk(
    logits: Tensor, k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The router after its linear layer (engine/layers/moe.py TopKRouter.forward).

    logits: [T, E] in the model dtype. probs = softmax(logits) in fp32; returns ids [T, K] int32
    of the k largest probs in descending order (ties: lowest index first; torch.topk here) and
    weights [T, K] fp32 (float64 for float64 logits): the top probs, divided by their sum when
    renormalize, rounded to round_to and back when round_to is given (Qwen / OLMoE; Mixtral
    passes None).
    """
    assert logits.dim() == 2 and 0 < k <= logits.shape[1], (logits.shape, k)
    probs = torch.softmax(logits, dim=-1, dtype=_wide(logits.dtype))  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to)
    return ids.to(torch.int32), weights.to(probs.dtype)
