"""The host's bandwidth caps over a whole `bench offload` run, and the decode limit from them.

A limit is the best the machine can do, so each cap is the best value any probe of the run
saw. One probe of one second at the start is not enough on the device host: its memory speed
changes over seconds, and the twenty-sixth session's acceptance run probed 88 GB/s for both
miss paths at once where a later load probed 133; the uniform rows' limits then sat at 45 tok/s
under a measured 48.4 (107% "of the limit"). So the run probes at its start and again after
each routing regime, and every row's limit is recomputed from the best caps when it is saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freetoken_agent.bench import cpu_load
from freetoken_agent.bench.limits import (
    decode_floor_overlapped_s,
    decode_floor_s,
    host_paths,
    host_paths_bandwidth,
)
from freetoken_agent.engine.experts import calibration

IDLE_SECONDS = 0.5  # the idle window sampled before each probe


@dataclass
class HostCaps:
    b_p: float = 0.0  # pinned host-to-device bytes/s (B_P), best seen
    b_h: float = 0.0  # the CPU expert kernel's weight bytes/s (B_H), best seen
    b_read: float = 0.0  # host memory read bytes/s with both miss paths at once, best seen
    probes: list[dict] = field(default_factory=list)  # every probe, in order, for the report

    def observe(self, when: str, b_p: float, b_h: float, b_read: float, **loads) -> None:
        """`loads`: the cores' use around the probe (cpu_load.py), kept in its record."""
        self.b_p, self.b_h = max(self.b_p, b_p), max(self.b_h, b_h)
        self.b_read = max(self.b_read, b_read)
        self.probes.append({"when": when, "b_p_gb_s": b_p / 1e9, "b_h_gb_s": b_h / 1e9,
                            "host_read_gb_s": b_read / 1e9, **loads})  # fmt: skip

    def probe(self, when: str, w13: torch.Tensor, w2: torch.Tensor, device: torch.device) -> dict:
        """Measure the three caps now, over the run's own pool (w13 [N, 2I, H], w2 [N, H, I]),
        and keep the best of each. Returns what both paths read at once, or the error of a
        probe that failed (recorded; the caps stay as they were). Its record holds the cores'
        use (cpu_load.py) for IDLE_SECONDS before it, while nothing should run (a thread of
        this process busy then spins), and during it (other tenants, the hypervisor's steal)."""
        hidden, inter = w13.shape[2], w2.shape[2]
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        idle = cpu_load.sample(IDLE_SECONDS)
        start = cpu_load.snapshot()
        try:  # beside a live engine: a probe that fails (out of memory) only goes unused
            both = host_paths_bandwidth(w13, w2, device)
            b_p = calibration.measure_pcie(expert_bytes) if device.type == "cuda" else 0.0
            b_h = calibration.measure_cpu(hidden, inter, w13.dtype, pool=(w13, w2))
        except RuntimeError as exc:
            both = {"error": str(exc)[:300], "both_gb_s": 0.0}
            self.probes.append({"when": when, "error": both["error"], "idle_load": idle})
            return both
        finally:  # the probe's buffers back to the driver: the engine's memory reads free VRAM
            if device.type == "cuda":
                torch.cuda.empty_cache()
        during = cpu_load.between(start, cpu_load.snapshot())
        self.observe(when, b_p, b_h, 1e9 * both["both_gb_s"], idle_load=idle,
                     probe_load=None if during is None else during.report())  # fmt: skip
        return both

    def miss_bandwidth(self) -> float:
        """Bytes/s at which a step's misses can leave host memory: the link and the CPU's reads
        together, under the read cap (`host_paths`, DESIGN section 7), for every policy.

        One rule for all: a limit is what the machine allows at the row's own miss rate, not
        what the policy's design can reach. A policy that leaves the CPU branch unused (direct
        and gpu-fill read every miss over the link; transfer fetches every miss; cpu computes
        every one on the host) forgoes bandwidth the machine had, and its share of the limit
        should show that; limits taken from its own paths (the link alone) would rate it
        against a lower bar than adaptive at the same bytes, and rows of two policies could
        not be read against each other."""
        return host_paths(self.b_p, self.b_h, self.b_read)

    def bound(self, row: dict, b_hbm: float) -> None:
        """Set a decode row's limit_tok_s and of_limit from the best caps and the row's own
        bytes a step: step_device_bytes (dense weights, hit experts and KV read from HBM),
        step_host_bytes (missed experts, read from host memory), with the tokens a step
        makes (tokens_per_step, else its batch)."""
        b_miss = self.miss_bandwidth()
        floor = decode_floor_s(row["step_device_bytes"], row["step_host_bytes"], b_hbm, b_miss)
        tokens = row.get("tokens_per_step", row["batch"])
        row["limit_tok_s"] = tokens / floor
        row["of_limit"] = row["tok_s"] * floor / tokens
        hits = row.get("step_hit_bytes")
        if hits is not None:  # the bound with hits beside misses (limits.py says why)
            dense = row["step_device_bytes"] - hits
            floor = decode_floor_overlapped_s(dense, hits, row["step_host_bytes"], b_hbm, b_miss)
            row["limit_overlap_tok_s"] = tokens / floor
            row["of_overlap_limit"] = row["tok_s"] * floor / tokens


def above_limits(rows: dict[str, dict]) -> list[str]:
    """A line for each row measured faster than its limit: a limit is a bound, so such a row
    means a cap was never probed at its best in the run (or the limit's model misses a path),
    and its share of the limit must not be read as an efficiency."""
    return [f"WARNING: {key} measured {row['tok_s']:.1f} tok/s, above its limit "
            f"{row['limit_tok_s']:.1f}: the host caps this run probed are below what it did"
            for key, row in rows.items() if row.get("of_limit", 0.0) > 1.0]  # fmt: skip
