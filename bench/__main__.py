"""`python -m freetoken_agent.bench NAME [options]` / `freetoken bench NAME [options]`.

    decode            all-resident decode and prefill beside the HBM limit (needs CUDA)
    offload           experts in host memory: decode per policy and routing regime, streamed
                      prefill with and without double buffering (needs CUDA)
    cpu-experts       the CPU expert kernel's weight bandwidth beside the host's read bandwidth
    attention-kernel  paged attention decode/prefill beside HBM bandwidth and SDPA (CUDA)
    moe-kernel        fused MoE decode/prefill beside HBM bandwidth and matmul rate (CUDA)
    profile           where a decode step and a prefill chunk spend their time (CUDA)
    profile-offload   where an offloaded decode step spends its host time, per phase (CUDA)
    parity-precision  bf16 distance from fp32, ours and transformers', per family
    agent             agent sessions replayed per recurrent-checkpoint mode: tokens re-prefilled
                      and time to first token per turn (CUDA; --cpu-smoke runs on the CPU)
    elastic           a growing agent session on the elastic split against two fixed ones, with
                      an external allocation mid-session (CUDA; --cpu-smoke runs on the CPU)
    kv-layout         paged attention over the fixed pool's, the elastic arena's and the old
                      interleaved KV layouts, decode and prefill at long contexts (CUDA)
    workspace         the device memory a prefill step allocates beside the estimate slots are
                      sized with (CUDA)
    gemv              decode projections: torch's F.linear against the Triton skinny matmul,
                      beside HBM bandwidth (CUDA)
    stream-threshold  prefill chunk lengths streamed and placed: the measured crossover beside
                      the model's (CUDA)
    sampler           a decode step's sampling per configuration: the Triton kernel against
                      torch's ops, host and device time, launches (CUDA)
    worker-teams      the CPU worker's job time on its OpenMP team against its own spinning
                      team, beside the host's read bandwidth (any CPU)
    step-kernels      an offloaded decode step's device time kernel by kernel, in the graphs
                      each policy replays (CUDA)
    fusions           the decode step's fused kernels (router, o_proj + norm) on and off in
                      one all-resident engine, beside the HBM limit (CUDA)
    cache-policies    expert cache replacement policies replayed on routing traces: LRU's
                      miss rate beside frequency-aware ones and the offline optimum (any CPU)
    side-fill         copies behind a decode step on a second stream: what they cost the
                      step's own copies and kernels, beside the link's limit (CUDA)
    split-cuts        adaptive's split path at held cuts, its trials' cut and other worker
                      teams, against gpu-fill, beside each row's limit (CUDA)
    plan-kernel       the in-graph fill's plan kernel alone: device time per plan against its
                      misses and the slots it scans, beside the launch floor (CUDA)
    share-rule        the shared path's CPU share rules replayed on routing traces with a
                      per-layer time model: fills, CPU experts and modelled steps (any CPU)
    expert-mlp        a probe: one token's routed experts in one launch against the decode
                      path's three, graph-replayed at the 30B shape, beside HBM (CUDA)
    attention-half    a probe: a token's attention half of a layer as one persistent grid
                      against the engine's five launches, at the 30B shape (CUDA)
    routing-prediction  how well the next layer's router on this layer's state predicts the
                      next layer's experts (and its misses) in a random model (any CPU)

`freetoken bench NAME --help` lists that benchmark's options and their defaults; the
environment variables below change what every offloaded engine does.
"""

from __future__ import annotations

import importlib
import sys

from freetoken_agent.bench.environment import ENVIRONMENT

BENCHES = {
    "decode": "freetoken_agent.bench.decode_baseline",
    "offload": "freetoken_agent.bench.offload",
    "cpu-experts": "freetoken_agent.bench.cpu_experts",
    "attention-kernel": "freetoken_agent.bench.attention_kernel",
    "moe-kernel": "freetoken_agent.bench.moe_kernel",
    "profile": "freetoken_agent.bench.profile_step",
    "profile-offload": "freetoken_agent.bench.profile_offload",
    "parity-precision": "freetoken_agent.bench.parity_precision",
    "agent": "freetoken_agent.bench.agent",
    "elastic": "freetoken_agent.bench.elastic",
    "kv-layout": "freetoken_agent.bench.kv_layout",
    "workspace": "freetoken_agent.bench.workspace",
    "gemv": "freetoken_agent.bench.gemv_kernel",
    "stream-threshold": "freetoken_agent.bench.stream_threshold",
    "sampler": "freetoken_agent.bench.sampler_profile",
    "worker-teams": "freetoken_agent.bench.worker_teams",
    "step-kernels": "freetoken_agent.bench.step_kernels",
    "fusions": "freetoken_agent.bench.fusions",
    "cache-policies": "freetoken_agent.bench.cache_policies",
    "side-fill": "freetoken_agent.bench.side_fill",
    "split-cuts": "freetoken_agent.bench.split_cuts",
    "plan-kernel": "freetoken_agent.bench.plan_kernel",
    "expert-mlp": "freetoken_agent.bench.expert_mlp",
    "attention-half": "freetoken_agent.bench.attention_half",
    "routing-prediction": "freetoken_agent.bench.routing_prediction",
    "share-rule": "freetoken_agent.bench.share_rule",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or argv[0] not in BENCHES:
        asked = not argv or argv[0] in ("-h", "--help")
        print(__doc__.strip() + "\n\n" + ENVIRONMENT.rstrip(),
              file=sys.stdout if asked else sys.stderr)  # fmt: skip
        if not asked:
            print(f"\nunknown benchmark {argv[0]!r}; choose one of {', '.join(BENCHES)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        return 0
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
