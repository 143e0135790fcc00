"""Inputs of the fused q/k norm + RoPE + KV store (kernels/rope.py) and of the kernels that end
in it (kernels/norm_qkv.py): a random case and the check of what it wrote into its caches
(tests/kernels/test_rope.py, test_norm_qkv.py)."""

# Shape legend: T tokens, Hq / Hkv query / kv heads, D head dim, R rotary dims, P pages of S slots.

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EPS = 1e-6
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    qkv: Tensor  # [T, (Hq + 2 * Hkv) * D]
    positions: Tensor  # [T] int64
    cos: Tensor  # [max_pos, R]
    sin: Tensor
    hq: int
    hkv: int
    d: int
    q_w: Tensor | None  # [D]
    k_w: Tensor | None
    k_cache: Tensor  # [P, S, Hkv, D], NaN
    v_cache: Tensor
    slots: Tensor  # [T] int64

    def args(self, k_cache: Tensor | None = None, v_cache: Tensor | None = None) -> tuple:
        return (self.qkv, self.positions, self.cos, self.sin, self.hq, self.hkv, self.d, self.q_w,
                self.k_w, EPS, self.k_cache if k_cache is None else k_cache,
                self.v_cache if v_cache is None else v_cache, self.slots)  # fmt: skip

    def fresh_caches(self) -> tuple[Tensor, Tensor]:
        nan = float("nan")
        return torch.full_like(self.k_cache, nan), torch.full_like(self.v_cache, nan)


def make_case(seed: int, T: int, hq: int, hkv: int, d: int, r: int, norm: str,
              dtype: torch.dtype, device: str = DEV, page: int = 4) -> Case:  # fmt: skip
    """norm: "qk" (Qwen3), "none" (Mixtral / Qwen2), "q" (one side only)."""
    gen = torch.Generator().manual_seed(seed)
    max_pos = 4096
    # The engine's table (rope.py): cat(freqs, freqs) of R // 2 frequencies, then cast.
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, R]
    qkv = (torch.randn(T, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(device)

    def weight() -> Tensor:
        return (1 + 0.2 * torch.randn(d, generator=gen)).to(device, dtype)

    q_w = weight() if norm in ("qk", "q") else None
    k_w = weight() if norm == "qk" else None
    P = (T + page - 1) // page + 2  # spare pages nobody writes
    slots = torch.randperm(P * page, generator=gen)[:T].to(device)
    k_cache = torch.full((P, page, hkv, d), float("nan"), dtype=dtype, device=device)
    return Case(qkv, positions, emb.cos().to(device, dtype), emb.sin().to(device, dtype), hq, hkv,
                d, q_w, k_w, k_cache, torch.full_like(k_cache, float("nan")), slots)  # fmt: skip


def written(c: Case, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The mapped slots' k and v [T, Hkv, D]; asserts every other slot is still NaN."""
    P, S = k_cache.shape[:2]
    hit = torch.zeros(P * S, dtype=torch.bool, device=k_cache.device)
    hit[c.slots] = True
    for cache in (k_cache, v_cache):
        flat = cache.view(P * S, c.hkv, c.d)
        assert flat[~hit].isnan().all(), "a slot outside slot_mapping was written"
        assert not flat[hit].isnan().any(), "a mapped slot was left (partly) unwritten"
    return k_cache.view(P * S, c.hkv, c.d)[c.slots], v_cache.view(P * S, c.hkv, c.d)[c.slots]
