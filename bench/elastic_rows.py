"""The rows bench/elastic.py prints and saves: each turn's physical limits (bandwidths measured
in the run) and its line on stdout."""

from __future__ import annotations

import torch

from freetoken_agent.bench.decode_baseline import kv_bytes_per_token
from freetoken_agent.bench.limits import (
    decode_floor_s,
    hbm_copy_bandwidth,
    host_paths,
    host_read_bandwidth,
    streamed_prefill_floor_s,
)
from freetoken_agent.engine.engine import Engine


class Limits:
    """Bandwidths measured in this run (CUDA only) and the per-turn limits they give."""

    def __init__(self, cfg: dict, on_gpu: bool) -> None:
        self.on_gpu = on_gpu
        self.hbm = self.pcie = self.cpu = self.host_read = None
        if on_gpu:
            from freetoken_agent.engine.experts import calibration

            h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
            self.hbm = hbm_copy_bandwidth(torch.device("cuda"))
            self.pcie = calibration.measure_pcie(3 * h * i * 2)
            self.cpu = calibration.measure_cpu(h, i, torch.bfloat16)
            self.host_read = host_read_bandwidth()

    def add(self, row: dict, engine: Engine, context: int, chunk: int) -> None:
        row["decode_limit_tok_s"] = row["ttft_limit_s"] = None
        bank = engine.loaded.bank
        if not self.on_gpu or row.get("miss_rate") is None:
            return
        loaded = engine.loaded
        dense = loaded.dense_bytes - loaded.model.embed_tokens.device_nbytes
        kv = context * kv_bytes_per_token(engine)
        moved = row["experts_per_token"] * bank.pool.expert_bytes
        link = host_paths(self.pcie, self.cpu, self.host_read)
        hit, miss = moved * (1 - row["miss_rate"]), moved * row["miss_rate"]
        floor = decode_floor_s(dense + kv + hit, miss, self.hbm, link)
        row["decode_limit_tok_s"] = 1 / floor
        # At most every slot the run has had holds a resident expert (copied on the device).
        records = engine.memory.trace.records if engine.memory is not None else []
        slots = max([r.slots for r in records] + [bank.cache.n_slots])
        chunk_bytes = max(0, bank.pool.nbytes - slots * bank.pool.expert_bytes)
        cuts = engine.scheduler.recurrence is not None  # checkpoints may end chunks early
        row["ttft_limit_s"] = streamed_prefill_floor_s(
            row["prefilled_tokens"], chunk, bank.stream_min_tokens, cuts, chunk_bytes, self.pcie
        )

    def to_json(self) -> dict:
        pairs = (
            ("hbm_copy", self.hbm),
            ("b_p", self.pcie),
            ("b_h", self.cpu),
            ("host_read", self.host_read),
        )
        return {f"{k}_gb_s": v / 1e9 if v else None for k, v in pairs}


HEAD = f"{'engine':<12}{'turn':>5}{'ctx':>8}{'reused':>8}{'prefill':>8}{'ttft s':>8}"
HEAD += f"{'(lim)':>7}{'tok/s':>8}{'(lim)':>7}{'miss':>6}{'slots':>7}{'pages':>8}{'GB':>7}"
HEAD += f"{'free':>7}{'fetch':>7}{'cpu':>6}{'sp ms':>7}{'step':>7}{'p50':>6}{'max':>6}{'wait':>6}"
HEAD += f"{'stops':>6}{'gc ms':>7}"
HEAD += "  status"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_row(name: str, r: dict) -> None:
    print(
        f"{name:<12}{r['turn']:>5}{r['context']:>8}{_fmt(r.get('reused_tokens'), 'd'):>8}"
        f"{_fmt(r.get('prefilled_tokens'), 'd'):>8}{_fmt(r.get('ttft_s'), '.3f'):>8}"
        f"{_fmt(r.get('ttft_limit_s'), '.2f'):>7}{_fmt(r.get('decode_tok_s'), '.1f'):>8}"
        f"{_fmt(r.get('decode_limit_tok_s'), '.0f'):>7}{_fmt(r.get('miss_rate'), '.2f'):>6}"
        f"{_fmt(r.get('slots'), 'd'):>7}{_fmt(r.get('kv_pages'), 'd'):>8}"
        f"{_fmt(r.get('budget_gb'), '.2f'):>7}{_fmt(r.get('free_gb'), '.2f'):>7}"
        f"{_fmt(r.get('fetched_per_token'), '.1f'):>7}{_fmt(r.get('on_cpu_per_token'), '.1f'):>6}"
        f"{_fmt(r.get('safe_point_ms'), '.2f'):>7}{_fmt(r.get('step_ms'), '.1f'):>7}"
        f"{_fmt(r.get('step_p50_ms'), '.1f'):>6}{_fmt(r.get('step_max_ms'), '.0f'):>6}"
        f"{_fmt(r.get('device_wait_ms'), '.1f'):>6}"
        f"{_fmt(r.get('missed_layers_per_step'), '.1f'):>6}"
        f"{_fmt(r.get('gc_ms'), '.0f'):>7}"
        f"  {r.get('failed') or 'ok'}" + ("  [pressure]" if r.get("pressure") else ""),
        flush=True,
    )
