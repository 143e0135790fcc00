"""Random inputs for the gated DeltaNet kernel tests (tests/kernels/test_gated_delta*.py): a
packed delta-rule call (`Delta`, `make_delta`), a causal-conv call (`Conv`, `make_conv`) and the
fp64 chunked reference run on a copy of a call.

State pools hold random rows (some no sequence owns), state slots are shuffled, checkpoint rows
start random; the same seed gives the same inputs.
"""

# T tokens (packed over B sequences), Hk / Hv key / value heads, Dk / Dv head dims, N state
# slots, Cn checkpoint rows, C conv channels, K conv width

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken_agent.kernels import reference_delta

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
F64 = torch.float64


@dataclass
class Delta:
    q: Tensor  # [T, Hk, Dk]
    k: Tensor
    v: Tensor  # [T, Hv, Dv]
    g: Tensor  # [T, Hv] fp32
    beta: Tensor
    state: Tensor  # [N, Hv, Dk, Dv]
    slots: Tensor  # [B] int64, shuffled
    cu: Tensor  # [B + 1] int32
    bounds: tuple[int, ...] | None
    snap_slots: Tensor | None = None  # [T] int64
    snap_out: Tensor | None = None  # [Cn, Hv, Dk, Dv]

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.g, self.beta, self.state, self.slots, self.cu,
                self.q.shape[-1] ** -0.5, self.bounds, self.snap_slots, self.snap_out)  # fmt: skip

    def clone(self) -> Delta:  # fresh pools for a second run on the same inputs
        snap = None if self.snap_out is None else self.snap_out.clone()
        return replace(self, state=self.state.clone(), snap_out=snap)

    def seq(self, b: int) -> slice:
        return slice(int(self.cu[b]), int(self.cu[b + 1]))


def bounds_of(lens: list[int]) -> tuple[int, ...]:
    return tuple(accumulate(lens, initial=0))


def make_delta(seed: int, lens: list[int], hk=2, hv=4, dk=16, dv=8, dtype=torch.float32,
               device=DEV, decode=False, snaps=0) -> Delta:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    T, B = sum(lens), len(lens)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    sdt = F64 if dtype == F64 else torch.float32
    n = B + 3  # rows no sequence owns
    # Decay from "keeps everything" (g near 0) to "forgets at once"; beta over (0, 1).
    g = -F.softplus(2 * rnd(T, hv) - 1) * torch.rand(T, hv, generator=gen)
    d = Delta(rnd(T, hk, dk).to(dtype), rnd(T, hk, dk).to(dtype), rnd(T, hv, dv).to(dtype),
              g.to(sdt), torch.rand(T, hv, generator=gen).to(sdt) * 0.98 + 0.01,
              rnd(n, hv, dk, dv).to(sdt), torch.randperm(n, generator=gen)[:B],
              torch.tensor(bounds_of(lens), dtype=torch.int32),
              None if decode else bounds_of(lens))  # fmt: skip
    if snaps:
        d.snap_out = rnd(snaps + 2, hv, dk, dv).to(sdt)  # Cn > snaps: some rows stay untouched
        d.snap_slots = torch.full((T,), -1, dtype=torch.int64)
        at = torch.randperm(T, generator=gen)[:snaps]
        d.snap_slots[at] = torch.randperm(snaps + 2, generator=gen)[: len(at)]
    return Delta(*(x.to(device) if isinstance(x, Tensor) else x for x in vars(d).values()))


def fp64_reference(d: Delta) -> Delta:
    """d in fp64 (same values), run through the chunked reference; returns the finished copy."""
    e = replace(d, q=d.q.double(), k=d.k.double(), v=d.v.double(), g=d.g.double(),
                beta=d.beta.double(), state=d.state.double(),
                snap_out=None if d.snap_out is None else d.snap_out.double())  # fmt: skip
    e.v = reference_delta.gated_delta_rule(*e.args())  # the output, kept in the v field
    return e


@dataclass
class Conv:
    x: Tensor  # [T, C]
    weight: Tensor  # [C, K]
    state: Tensor  # [N, C, K - 1]
    slots: Tensor
    cu: Tensor
    bounds: tuple[int, ...] | None
    snap_slots: Tensor
    snap_out: Tensor  # [Cn, C, K - 1]

    def args(self) -> tuple:
        return (self.x, self.weight, self.state, self.slots, self.cu, self.bounds,
                self.snap_slots, self.snap_out)  # fmt: skip


def make_conv(seed: int, lens: list[int], c=12, taps=4, dtype=torch.float32, decode=False,
              device="cpu") -> Conv:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    T, B, n = sum(lens), len(lens), len(lens) + 3
    snap_slots = torch.full((T,), -1, dtype=torch.int64)
    snap_slots[torch.randperm(T, generator=gen)[:3]] = torch.randperm(5, generator=gen)[:3]
    conv = Conv(torch.randn(T, c, generator=gen).to(dtype),
                torch.randn(c, taps, generator=gen).to(dtype),
                torch.randn(n, c, taps - 1, generator=gen).to(dtype),
                torch.randperm(n, generator=gen)[:B],
                torch.tensor(bounds_of(lens), dtype=torch.int32),
                None if decode else bounds_of(lens), snap_slots,
                torch.randn(5, c, taps - 1, generator=gen).to(dtype))  # fmt: skip
    return Conv(*(a.to(device) if isinstance(a, Tensor) else a for a in conv.args()))
