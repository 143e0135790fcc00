#!/usr/bin/env bash
# One device-machine session: install without network, run the GPU tests, then benchmarks.
# Usage (on the device): bash bench/device_check.sh STAGE...
# stages: tests (or tests-kernels, then tests-engine) engine-tests elastic-tests decode kernels
#         kv-layout elastic-a elastic-b
#         s59-stream (the prefill streamer: its GPU tests, the 48-layer 8k prefill rows, then
#         the peer slice's 4096 rows with the warm one, ~7 min)
#         s60-timeline (the peer slice's 4096-token prefill profiled cold and warm: the link's
#         busy time and gaps, ~2 min)
#         s61-lend (the workspace lent to slots: its GPU tests, the peer slice's uniform b=1
#         decode with and without it, ~5 min) s61-warm (the peer 4096 prefill rows with it)
#         s62-native-48 (48 layers / 32 GB, native b=1, adaptive and gpu-fill, ~4 min)
#         s62-every (the CPU's share free to take every miss where fills do not pay, ~6 min)
#         s62-lend-ab (lent against whole inside one engine, peer uniform b=1 and 4, ~6 min)
#         elastic-hybrid-a elastic-hybrid-b (the Qwen3.6-35B-A3B shape: a quarter of the KV)
#         elastic-hybrid elastic-30b (all three engines in one run, ~6-8 minutes each)
#         zero-copy (the host-bank and direct-policy GPU tests, then the zero-copy probe)
#         elastic-hybrid-direct (the Qwen3.6 session under policy direct)
#         decode-profile (elastic vs fixed-last prefill and decode at the hybrid shape, ~4 minutes)
#         hog-profile (decode and kernels before and after another process takes 8 GB, ~5 min)
#         elastic-hybrid-interleaved (the three engines alive at once, each turn on all, its
#         decode in alternating blocks of 16 steps, ~7 min)
#         run-ahead (hybrid run-ahead: its GPU test, then decode_profile at 8k off and on, ~6 min)
#         offload-peer offload-30b (issue 3's decode table per policy and routing, no prefill)
#         workspace (a prefill step's peak allocation beside the slot sizing estimate, ~2 min)
#         profile (top kernels of an eager decode step and a prefill chunk, 12 layers, ~1 min)
#         gemv (the skinny-matmul kernel's GPU test, then F.linear against it per shape, ~1 min)
#         decode-skinny (bench decode at 12 layers without and with the skinny matmul, ~3 min)
#         stops (peer slice, uniform b=1: a decode step's host phases per policy, then
#         torch.profiler's host table of 8 steps each: where a stopping layer's time goes; the
#         CPU kernel with 0.3 ms host gaps, OpenMP waiting passively and actively, ~4 min)
#         run-ahead-zipf (peer slice, Zipf b=1: run-ahead 0/2/4 and miss gates 0.2/0.5, ~2 min)
#         stream-threshold (prefill 64-1536 tokens streamed and placed against the model, ~3 min)
#         huge-pages (the CPU kernel over 4 KB pages, then transparent huge pages, ~2 min)
#         fill-behind (Zipf b=1, EngineConfig.fill_behind off and on: 12 then 48 layers, ~5 min)
#         stop-clock (profile-offload's per-phase and per-stop host times, Zipf and native, 12
#         then 48 layers, ~5 min)
#         overlap (overlap scheduling: its GPU tests, then all-resident decode at 48 and 12
#         layers off and on, greedy and sampled, ~6 min)
#         overlap-offload (profile-offload adaptive with overlap off and on: native and Zipf at
#         12 layers, native at 48 layers / 32 GB, ~6 min)
#         gpu-fill (policy gpu-fill's and the sampling kernel's GPU tests, then bench offload
#         adaptive vs gpu-fill on the peer slice, b=1, ~6 min)
#         gpu-fill-48 (the same at 48 layers / 32 GB, native and Zipf, ~5 min)
#         step-paths (adaptive's stops and device paths: the GPU tests that load adaptive, then
#         adaptive, transfer and gpu-fill on the peer slice, ~7 min), step-paths-48 (48 layers)
#         sampler (the sampling kernel's GPU tests, bench sampler, sampled decode at 12 and 48
#         layers, ~2 min)
#         shared (adaptive's shared path: the CPU worker's and the CPU share's GPU tests, every
#         test that loads adaptive, then the peer slice with the shared path held, ~6 min)
#         shared-48 (48 layers / 32 GB, native and Zipf: adaptive measuring its three paths,
#         then held on shared, and gpu-fill, b=1, ~6 min)
#         shared-team (the CPU worker's kernel threads, OpenMP against its SpinTeam, ~3 min)
#         shared-zipf (the peer slice under Zipf 1.0 / loc 0.7, b=1 and 4: adaptive held on
#         shared with the gate off, against gpu-fill, SpinTeam; ~3 min)
#         fusions (the decode step's fused kernels: their GPU tests, bench gemv's router rows,
#         then bench fusions at 48 layers: router and o_proj + norm on and off, ~6 min)
#         shared-zipf-48 (the same at 48 layers / 32 GB, b=1: the acceptance's Zipf row, ~4 min)
#         step-kernels (an offloaded decode step's kernels in its replayed graphs: gpu-fill and
#         transfer at 12 layers, gpu-fill at 48 layers / 32 GB, ~5 min)
#         shared-kernels (the same for adaptive held on shared, uniform routing, b=1 and 4, ~3 min)
#         cold-share (the CPU share's rule at 48 layers / 32 GB under Zipf: adaptive held on
#         shared against gpu-fill, b=1 and 4, ~5 min)
#         s37-check (the plan's GPU tests with its m - 1 bound, bench plan-kernel and side-fill
#         on device_ms, then the peer slice's Zipf rows with the trials' steps by place, ~6 min)
#         share-curve (peer slice, uniform, b=1 and 4: adaptive held on shared at CPU shares
#         0.45-0.85, bench offload --hold-share: step time against the share, ~4 min)
#         plan-kernel (the fills' GPU tests, then bench plan-kernel: the plan alone per slots and
#         misses; PLAN_BEFORE=FILE times that version of its module beside it, ~3 min)
#         copy-grid (the fill copy grid timed per host: its GPU tests, calibrate, then the peer
#         slice's gpu-fill rows on 32 programs and on the timed grid, ~5 min)
#         acceptance-peer acceptance-48 (issue 3's tables: adaptive, transfer and gpu-fill at b=1
#         and 4 under native, Zipf and uniform routing; the peer slice ~4 min, 48 layers ~8 min)
#         tests-kernels tests-engine (every GPU test in two runs of under 10 minutes)
#         pdl-tests (PDL's and L2 prefetch's GPU tests, ~5 min), pdl (bench fusions' variants:
#         PDL, skinny matmul, L2 prefetch, ~4 min)
#         pdl-offload (48 layers / 32 GB, gpu-fill under each FREETOKEN_PDL value and
#         EngineConfig.l2_prefetch off and on, ~6 min)
#         popular-pins (48 layers / 32 GB, Zipf: adaptive and gpu-fill with
#         EngineConfig.popular_pins 0, then 0.8; ~8 min)
#         fill-through (its GPU tests, then 48 layers / 32 GB, native and Zipf, adaptive and
#         gpu-fill with EngineConfig.fill_through off, then on; ~9 min)
#         pins-uniform (the peer slice, uniform, adaptive and gpu-fill, pins 0 then 0.8; ~4 min)
#         attention-graph (attention decode planned for the real length and for a decode
#         graph's bound; ~2 min)
#         attention-rule (the split rule's GPU tests, then the 48-layer step at 256 and 4096
#         prompt tokens under 4k and 32k bounds, ~5 min)
#         long-context (48 layers / 32 GB, native and Zipf b=1 at an 8192-token context, ~4 min)
#         s26-check (the twenty-sixth session's unmeasured changes: their GPU tests, the
#         48-layer step, adaptive held on device against gpu-fill; ~7 min)
#         s28-split (the split expert: its GPU tests, 48 layers Zipf held on split; ~8 min)
#         split-cuts (bench split-cuts: held cuts, the cut trials', worker teams; ~6 min)
#         cpu-static-48 (the host's NUMA layout; 48 layers, b=1 and 4, policies cpu and static)
#         stops-rule (the peer slice under Zipf: adaptive, whose stops path is not kept while
#         fills pay, against gpu-fill and transfer; ~2.5 min)
#         worker-pins (the peer slice's uniform rows, the CPU worker unpinned, then pinned to
#         cores 0-11: FREETOKEN_WORKER_CPUS; ~4 min)
#         s27-check (bench side-fill: copies behind the step on a second stream, its GPU test
#         first; the CPU kernel's tests on AVX-512; then the peer slice native then uniform, adaptive and gpu-fill, with the
#         cores' use beside every host probe and row; ~5 min)
#         pdl-on-48 pdl-on-peer (adaptive under FREETOKEN_PDL light, the default, against on:
#         48 layers / 32 GB native and Zipf, b=1 and 4, ~6 min; the peer slice's three
#         regimes, ~4 min)
#         s38-front (the attention front in one launch, EngineConfig.fused_norm_qkv: its GPU
#         tests, then bench fusions at 48 layers with and without it, 3 rounds; ~7 min)
#         s39-half (the thirty-eighth session's unrun bf16 GPU tests, then bench attention-half:
#         its GPU tests and the attention half as one persistent grid against the engine's
#         five launches at 256 and 1024 cached tokens, ~6 min), s39-phases (its phases alone
#         and tile variants, ~4 min), s39-l2 (its L2 read-ahead rows, ~3 min), s39-two
#         (one and two programs an SM, ~3 min), s39-stream (STREAM tiles, ~3 min),
#         s39-stream2 (wider steps, 16 splits, ~3 min), s39-stream3 (the widest, ~3 min)
#         s39-block (EngineConfig.attention_block: its GPU tests, bench attention-half, then
#         bench fusions at 48 layers with and without it, ~8 min), s39-block-pdl (the same,
#         the block PDL-aware, with its split rule at 128 and 32 positions, ~6 min),
#         s41-sampling (the forty-first session's sampler changes: non-finite rows flagged,
#         signed zeros, their GPU tests; bench sampler for the greedy check's cost, ~4 min)
# Logs and JSON land in $OUT (or ./.out).
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  case $stage in
    tests)
      # The device image has no langchain, mcp or starlette: the integrations' tests would
      # stop the collection. All of them took 531 s in the twenty-first session: tests-kernels
      # and tests-engine split them for runs of at most 10 minutes.
      timeout 560 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --ignore=tests/integrations \
        tests/ 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40 ;;
    pdl-on-48)  # adaptive under PDL light against on, 48 layers / 32 GB (~6 min)
      timeout 570 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
        --rounds 1 --decode 128 --regimes native zipf:1.0,loc:0.7 --policies adaptive \
        --pdl light on --out "$OUT/pdl_on_48" 2>&1 | tee "$OUT/pdl_on_48.log" | grep "|b" \
        | grep -v "round[0-9]" | cut -c1-200 ;;
    pdl-on-peer)  # the same on the peer slice, its three regimes, 2 rounds (~4 min)
      timeout 570 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 4 --rounds 2 --decode 256 \
        --regimes uniform zipf:1.0,loc:0.7 native --policies adaptive --pdl light on \
        --out "$OUT/pdl_on_peer" 2>&1 | tee "$OUT/pdl_on_peer.log" | grep "|b" \
        | grep -v "round[0-9]" | cut -c1-200 ;;
    s39-half)  # the unrun bf16 GPU tests, then the attention half as one grid (~6 min)
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_norm_qkv.py \
        tests/kernels/test_proj_norm.py tests/bench/test_attention_half.py 2>&1 \
        | tee "$OUT/half_tests_s39.log" | tail -6
      timeout 300 python3 -m freetoken_agent.bench attention-half --out "$OUT" 2>&1 \
        | tee "$OUT/attention_half_s39.log" | tail -40
      mv "$OUT/attention_half.json" "$OUT/attention_half_s39.json"
      timeout 200 python3 -m freetoken_agent.bench attention-half --warps 8 --ahead 1 2 4 \
        --tiles '{"KS3": 8}' --out "$OUT" 2>&1 | tee "$OUT/attention_half_ks8_s39.log" | tail -20
      mv "$OUT/attention_half.json" "$OUT/attention_half_ks8_s39.json" ;;
    s39-phases)  # bench attention-half's phases alone and tile variants at 1024 tokens (~4 min)
      timeout 400 python3 -m freetoken_agent.bench attention-half --context 1024 --warps 4 \
        --ahead 0 --phase-rows --tiles '{}' '{"BK": 512}' '{"STAGES": 4}' \
        '{"BN1": 32, "KS1": 4}' --out "$OUT" 2>&1 | grep -v "max error" \
        | tee "$OUT/attention_half_phases_s39.log" | tail -30
      mv "$OUT/attention_half.json" "$OUT/attention_half_phases_s39.json" ;;
    s39-l2)  # bench attention-half's persistent rows with L2 read-ahead, 1024 tokens (~3 min)
      timeout 400 python3 -m freetoken_agent.bench attention-half --context 1024 --warps 4 \
        --ahead 0 1 --l2 0 1 2 3 --tiles '{"BN1": 32, "KS1": 4}' --out "$OUT" 2>&1 \
        | grep -v "max error" | tee "$OUT/attention_half_l2_s39.log" | tail -30
      mv "$OUT/attention_half.json" "$OUT/attention_half_l2_s39.json" ;;
    s39-two)  # bench attention-half at one and two programs an SM, 1024 tokens (~3 min)
      timeout 400 python3 -m freetoken_agent.bench attention-half --context 1024 --warps 4 \
        --ahead 0 --programs-per-sm 1 2 --phase-rows \
        --tiles '{"BN1": 32, "KS1": 4}' '{"BN1": 16, "KS1": 4, "KS3": 8}' --out "$OUT" 2>&1 \
        | grep -v "max error" | tee "$OUT/attention_half_two_s39.log" | tail -30
      mv "$OUT/attention_half.json" "$OUT/attention_half_two_s39.json" ;;
    s39-stream)  # bench attention-half with the projections' tiles as one loop (~3 min)
      timeout 400 python3 -m freetoken_agent.bench attention-half --context 1024 --warps 4 8 \
        --ahead 0 --phase-rows --tiles '{"BN1": 32, "KS1": 4, "STREAM": 1}' \
        '{"BN1": 16, "KS1": 4, "STREAM": 1, "BK": 128}' --out "$OUT" 2>&1 \
        | grep -v "max error" | tee "$OUT/attention_half_stream_s39.log" | tail -30
      mv "$OUT/attention_half.json" "$OUT/attention_half_stream_s39.json" ;;
    s39-stream2)  # STREAM with wider steps, o_proj tiles of 32 rows, 16 splits (~3 min)
      timeout 400 python3 -m freetoken_agent.bench attention-half --context 1024 --warps 4 \
        --ahead 0 --phase-rows --splits 16 --tiles '{"BN1": 32, "KS1": 4, "STREAM": 1}' \
        '{"BN1": 32, "KS1": 4, "STREAM": 1, "BK": 512, "BN3": 32}' \
        '{"BN1": 32, "KS1": 2, "STREAM": 1, "BN3": 32, "KS3": 2}' --out "$OUT" 2>&1 \
        | grep -v "max error" | tee "$OUT/attention_half_stream2_s39.log" | tail -30
      mv "$OUT/attention_half.json" "$OUT/attention_half_stream2_s39.json" ;;
    s39-stream3)  # STREAM's widest steps at 256 and 1024 tokens, 8 splits (~3 min)
      timeout 400 python3 -m freetoken_agent.bench attention-half --context 256 1024 \
        --warps 4 --ahead 0 --splits 8 \
        --tiles '{"BN1": 32, "KS1": 4, "STREAM": 1, "BK": 512, "BN3": 32}' \
        '{"BN1": 64, "KS1": 4, "STREAM": 1, "BK": 512, "BN3": 32}' \
        '{"BN1": 32, "KS1": 4, "STREAM": 1, "BK": 512, "BN3": 32, "KS3": 8}' \
        '{"BN1": 32, "KS1": 2, "STREAM": 1, "BK": 1024, "BN3": 32}' --out "$OUT" 2>&1 \
        | grep -v "max error" | tee "$OUT/attention_half_stream3_s39.log" | tail -30
      mv "$OUT/attention_half.json" "$OUT/attention_half_stream3_s39.json" ;;
    s39-block)  # the attention block in one launch: its GPU tests, bench attention-half,
      # then bench fusions at 48 layers with and without it, 3 rounds (~8 min)
      timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_attention_block.py 2>&1 | tee "$OUT/block_tests_s39.log" | tail -4
      timeout 150 python3 -m freetoken_agent.bench attention-half --out "$OUT" 2>&1 \
        | grep -v "max error" | tee "$OUT/attention_block_s39.log" | tail -8
      timeout 420 python3 -m freetoken_agent.bench fusions --layers 48 --variants both+pdl-light \
        block+pdl-light block+pdl --rounds 3 --out "$OUT" 2>&1 \
        | tee "$OUT/block_fusions_s39.log" | grep "|b" | cut -c1-160 ;;
    s41-sampling)  # non-finite rows and signed zeros on CUDA; the greedy check's cost (~4 min)
      timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/test_not_finite_logits.py tests/kernels/test_sampling_kernel_ties.py \
        tests/kernels/test_sampling_kernel.py tests/engine/test_sampler.py 2>&1 \
        | tee "$OUT/sampling_tests_s41.log" | tail -4
      timeout 200 python3 -m freetoken_agent.bench sampler --out "$OUT" 2>&1 \
        | tee "$OUT/sampler_s41.log" | grep '"path": "kernel"' | cut -c1-160 ;;
    s39-block-pdl)  # the PDL-aware block: GPU tests, its split rule, the 48-layer step (~6 min)
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_attention_block.py 2>&1 | tee "$OUT/block_pdl_tests_s39.log" | tail -3
      timeout 150 python3 -m freetoken_agent.bench attention-half --min-split 128 32 \
        --out "$OUT" 2>&1 | grep -v "max error" | tee "$OUT/block_splits_s39.log" | tail -10
      timeout 200 python3 -m freetoken_agent.bench fusions --layers 48 --variants both+pdl-light \
        block+pdl-light --rounds 2 --out "$OUT" 2>&1 | tee "$OUT/block_pdl_fusions_s39.log" \
        | grep "|b" | cut -c1-120 ;;
    s38-front)  # the attention front in one launch: its GPU tests and the 48-layer step (~7 min)
      timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_norm_qkv.py \
        tests/kernels/test_rope.py tests/kernels/test_pdl.py 2>&1 \
        | tee "$OUT/norm_qkv_tests_s38.log" | tail -4
      timeout 420 python3 -m freetoken_agent.bench fusions --layers 48 --variants both+pdl-light \
        all+pdl-light all+pdl --rounds 3 --out "$OUT" 2>&1 | tee "$OUT/front_fusions_s38.log" \
        | grep "|b" | cut -c1-160 ;;
    pdl-tests)  # PDL's and L2 prefetch's GPU tests: each variant against off, bit for bit (~5 min)
      timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_pdl_gpu.py \
        2>&1 | tee "$OUT/pdl_tests.log" | tail -15 ;;
    pdl)  # bench fusions at 48 layers: PDL's variants, the skinny matmul, L2 prefetch (~4 min)
      timeout 560 python3 -m freetoken_agent.bench fusions --layers 48 --variants both both+pdl \
        both+pdl-exit both+pdl-light both+pdl-prefetch both+skinny both+skinny+pdl-prefetch \
        both+l2 \
        --rounds 2 \
        --out "$OUT" 2>&1 | tee "$OUT/pdl_fusions.log" | grep "|b" | cut -c1-200 ;;
    pdl-offload)  # 48 layers / 32 GB native, gpu-fill under PDL variants x L2 prefetch (~5 min)
      timeout 300 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
        --rounds 1 --regimes native --policies gpu-fill \
        --pdl off on light prefetch --l2 off on --out "$OUT" 2>&1 \
        | tee "$OUT/pdl_offload_48.log" \
        | grep "|b" | grep -v "round[0-9]" | cut -c1-200 ;;
    popular-pins)  # 48 layers / 32 GB, Zipf b=1 and 4: gpu-fill and adaptive, pins off then
      # 0.8 of the slots (EngineConfig.popular_pins, chosen every 64 steps: 320 decoded
      # tokens a row; two loads of the model, ~8 min)
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/experts/test_popular_pins.py tests/kernels/test_expert_fills.py 2>&1 \
        | tee "$OUT/popular_pins_tests.log" | tail -3
      for f in 0 0.8; do
        timeout 280 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
          --rounds 1 --regimes zipf:1.0,loc:0.7 --policies adaptive gpu-fill --decode 320 \
          --popular-pins $f --out "$OUT/pins_$f" 2>&1 | tee "$OUT/popular_pins_$f.log" \
          | grep "|b" | grep -v "round[0-9]" | grep " | " | cut -c1-200
      done ;;
    pins-uniform)  # the peer slice, uniform routing, b=1 and 4, adaptive and gpu-fill, pins
      # 0 then 0.8 (the default): whether pins cost the shared path (~4 min)
      for f in 0 0.8; do
        timeout 280 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
          --skip-prefill --batches 1 4 --rounds 2 --regimes uniform --policies adaptive \
          gpu-fill --popular-pins $f --out "$OUT/pins_uniform_$f" 2>&1 \
          | tee "$OUT/pins_uniform_$f.log" | grep "|b" | grep -v "round[0-9]" | grep " | " \
          | cut -c1-200
      done ;;
    attention-graph)  # paged attention's decode as planned for the real length and as the
      # engine's decode graphs plan it (max_kv_len = max_model_len), default tiles (~2 min)
      timeout 300 python3 -m freetoken_agent.bench attention-kernel --no-sweep \
        --graph-bound 32768 2>&1 | tee "$OUT/attention_graph.log" | grep -E "decode|HBM" ;;
    attention-rule)  # paged attention's split rule (twenty-fifth session, unmeasured): its GPU
      # tests, then the 48-layer all-resident step at a 256-token prompt under a 4k and a 32k
      # bound, and at 4096 tokens under 32k (~5 min; 300.2 / 270.6 b=1 before the rule)
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_paged_attention.py 2>&1 | tee "$OUT/attention_rule_tests.log" | tail -2
      for pm in "256 4096" "256 32768" "4096 32768"; do
        read -r prompt bound <<<"$pm"
        timeout 150 python3 -m freetoken_agent.bench fusions --layers 48 --variants both \
          --rounds 2 --prompt "$prompt" --max-model-len "$bound" --out "$OUT" 2>&1 \
          | grep "|b" | sed "s/^/prompt $prompt bound $bound /" | cut -c1-120
      done ;;
    s26-check)  # the twenty-sixth session's unmeasured changes (~7 min): the GPU tests of
      # adaptive's graph sets, PDL and attention; the 48-layer all-resident step (attention's
      # prologue before its PDL wait; 302.9 / 277.6 tok/s b=1 at 256 / 4096 prompt tokens
      # before); the peer slice, native b=1, adaptive held on device against gpu-fill (914.9
      # against 937.4 when one graph set held the CPU worker's post for both paths)
      timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/experts/test_offload_gpu.py tests/engine/test_pdl_gpu.py \
        tests/kernels/test_paged_attention.py 2>&1 | tee "$OUT/s26_tests.log" | tail -3
      for prompt in 256 4096; do
        timeout 120 python3 -m freetoken_agent.bench fusions --layers 48 --variants both \
          --rounds 2 --prompt "$prompt" --out "$OUT" 2>&1 | grep "|b" \
          | sed "s/^/prompt $prompt /" | cut -c1-120
      done
      timeout 150 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 --rounds 2 --decode 256 --regimes native \
        --policies adaptive gpu-fill --adaptive-path device --out "$OUT/held_device" 2>&1 \
        | tee "$OUT/held_device.log" | grep "|b" | grep " | " | cut -c1-200 ;;
    long-context)  # 48 layers / 32 GB, b=1, native and Zipf, adaptive and gpu-fill, an 8192-token
      # context (bench offload --context; the limit counts the KV reads, ~4 min)
      timeout 400 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 \
        --rounds 1 --regimes native zipf:1.0,loc:0.7 --policies adaptive gpu-fill \
        --context 8192 --decode 128 --out "$OUT/long_context" 2>&1 \
        | tee "$OUT/long_context.log" | grep "|b" | grep -v "round[0-9]" | grep " | " \
        | cut -c1-200 ;;
    fill-through)  # fill-through's GPU tests, then 48 layers / 32 GB, native and Zipf, b=1
      # and 4, adaptive and gpu-fill, EngineConfig.fill_through off then on (~9 min)
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/experts/test_fill_through.py 2>&1 | tee "$OUT/fill_through_tests.log" \
        | tail -3
      for f in no-fill-through fill-through; do
        timeout 300 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
          --rounds 1 --regimes native zipf:1.0,loc:0.7 --policies adaptive gpu-fill \
          --$f --out "$OUT/$f" 2>&1 | tee "$OUT/$f.log" \
          | grep "|b" | grep -v "round[0-9]" | grep " | " | cut -c1-200
      done ;;
    tests-kernels)
      timeout 560 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/kernels tests/bench \
        2>&1 | tee "$OUT/gpu_tests_kernels.log" | tail -30 ;;
    tests-engine)
      timeout 560 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/engine 2>&1 \
        | tee "$OUT/gpu_tests_engine.log" | tail -30 ;;
    engine-tests)
      timeout 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/engine 2>&1 \
        | tee "$OUT/gpu_engine_tests.log" | grep -E "error|agreement|passed|failed|Error" ;;
    decode)
      timeout 400 python3 -m freetoken_agent.bench decode --out "$OUT" 2>&1 \
        | tee "$OUT/decode_baseline.log" | tail -12 ;;
    elastic-tests)  # the arena, its virtual memory, the watcher, the no-recompile check
      timeout 320 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12 tests/engine/test_device_memory.py \
        tests/engine/test_elastic_memory.py tests/engine/experts/test_cache_arena.py \
        tests/kernels/test_paged_attention.py tests/kernels/test_fused_moe.py \
        tests/engine/test_preemption_progress.py tests/bench/test_compile_log.py \
        tests/engine/kv/test_checkpoints.py tests/engine/test_elastic_checkpoints.py \
        tests/engine/test_hybrid_gpu.py tests/kernels/test_row_copy.py \
        tests/engine/experts/test_offload_gpu.py tests/engine/test_close.py \
        tests/kernels/test_gated_delta_gpu.py::test_gpu_no_recompile_for_new_prompt_lengths \
        tests/kernels/test_routing_export.py tests/engine/test_host_embeddings.py 2>&1 \
        | tee "$OUT/gpu_elastic_tests.log" | tail -22 ;;
    kv-layout)
      timeout 300 python3 -m freetoken_agent.bench kv-layout --out "$OUT/kv_layout.json" 2>&1 \
        | tee "$OUT/kv_layout.log" | tail -12 ;;
    elastic-a)  # one engine per command: each run is ~4 minutes at 48 layers
      timeout 560 python3 -m freetoken_agent.bench elastic --engines elastic \
        --routing zipf:1.0,loc:0.7 --decode-tokens 128 --out "$OUT/elastic_a.json" 2>&1 \
        | tee "$OUT/elastic_a.log" | grep -E "^elastic|^engine|^watch|^Timeout|^Thread|^  File" ;;
    elastic-b)  # then: freetoken bench elastic --merge elastic_b.json elastic_a.json --out ...
      timeout 560 python3 -m freetoken_agent.bench elastic --engines fixed-first fixed-last \
        --routing zipf:1.0,loc:0.7 --decode-tokens 128 --out "$OUT/elastic_b.json" 2>&1 \
        | tee "$OUT/elastic_b.log" | grep -E "^fixed|^engine|^watch|^Timeout|^Thread|^  File" ;;
    elastic-hybrid-a)
      timeout 560 python3 -m freetoken_agent.bench elastic --shape qwen3.6-35b-a3b \
        --engines elastic --routing zipf:1.0,loc:0.7 --decode-tokens 128 \
        --out "$OUT/elastic_hybrid_a.json" 2>&1 | tee "$OUT/elastic_hybrid_a.log" \
        | grep -E "^elastic|^engine|^watch|^Timeout|^Thread|^  File" ;;
    elastic-hybrid-b)
      timeout 560 python3 -m freetoken_agent.bench elastic --shape qwen3.6-35b-a3b \
        --engines fixed-first fixed-last --routing zipf:1.0,loc:0.7 --decode-tokens 128 \
        --out "$OUT/elastic_hybrid_b.json" 2>&1 | tee "$OUT/elastic_hybrid_b.log" \
        | grep -E "^fixed|^engine|^watch|^Timeout|^Thread|^  File" ;;
    elastic-hybrid)  # every engine in one run: the host pool is drawn and pinned once
      timeout 590 python3 -m freetoken_agent.bench elastic --shape qwen3.6-35b-a3b \
        --routing zipf:1.0,loc:0.7 --decode-tokens 128 --out "$OUT/elastic_hybrid.json" 2>&1 \
        | tee "$OUT/elastic_hybrid.log" | grep -E "^elastic|^fixed|^engine|^watch|^compile|^prof|^Timeout|^  File" ;;
    elastic-hybrid-interleaved)  # every engine alive, each turn on all of them (~7 min)
      timeout 590 python3 -m freetoken_agent.bench elastic --shape qwen3.6-35b-a3b --interleave \
        --routing zipf:1.0,loc:0.7 --decode-tokens 128 --out "$OUT/elastic_hybrid_interleaved.json" \
        2>&1 | tee "$OUT/elastic_hybrid_interleaved.log" \
        | grep -E "^elastic|^fixed|^engine|^watch|^prof .*ttft|^Timeout|^  File|geomean|turn_change" ;;
    elastic-hybrid-direct)  # policy direct (misses read by the kernels), elastic vs fixed-last
      timeout 590 python3 -m freetoken_agent.bench elastic --shape qwen3.6-35b-a3b \
        --engines elastic fixed-last --policy direct --routing zipf:1.0,loc:0.7 \
        --decode-tokens 128 --out "$OUT/elastic_hybrid_direct.json" 2>&1 \
        | tee "$OUT/elastic_hybrid_direct.log" | grep -E "^elastic|^fixed|^engine|^watch|^Timeout" ;;
    elastic-30b)
      timeout 590 python3 -m freetoken_agent.bench elastic --routing zipf:1.0,loc:0.7 \
        --decode-tokens 128 --out "$OUT/elastic_30b.json" 2>&1 \
        | tee "$OUT/elastic_30b.log" | grep -E "^elastic|^fixed|^engine|^watch|^compile|^Timeout|^  File" ;;
    hog-profile)  # decode before and after another process takes 8 GB and frees it (~5 min)
      timeout 500 python3 -m freetoken_agent.bench.decode_profile --layers 40 --budget-gb 32 \
        --context 32768 --fixed-kv-tokens 100000 --tokens 96 --top 12 --hog-gb 8 2>&1 \
        | tee "$OUT/hog_profile.log" | grep -E "^==|^-- hog|^-- decode, per|^ +[0-9.]+ +[0-9.]+  " \
        | cut -c1-160 ;;
    decode-profile)  # elastic vs fixed-last decode step: host functions, kernels, watcher reads
      timeout 420 python3 -m freetoken_agent.bench.decode_profile --layers 40 --budget-gb 32 \
        --context 32768 --fixed-kv-tokens 100000 --tokens 96 --top 20 --squeeze-gb 8 2>&1 \
        | tee "$OUT/decode_profile.log" | grep -v "^compile" | cut -c1-200 ;;
    run-ahead)  # hybrid segmented decode running ahead from step-start recurrent state copies
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_hybrid_gpu.py \
        -k run_ahead 2>&1 | tee "$OUT/gpu_run_ahead.log" | tail -3
      for flag in "" --hybrid-run-ahead; do
        timeout 240 python3 -m freetoken_agent.bench.decode_profile --layers 40 --budget-gb 32 \
          --context 8192 --tokens 96 --top 8 $flag 2>&1 | tee -a "$OUT/run_ahead_profile.log" \
          | grep -E "^== |prefill of" | cut -c1-200
      done ;;
    offload-peer)  # issue 3 decode table, peer slice (12 layers, 8.59 GB), every policy, 3 rounds (~7 min)
      timeout 570 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --out "$OUT" 2>&1 | tee "$OUT/offload_peer.log" | grep -v "round[0-9]" \
        | cut -c1-240 ;;
    copy-grid)  # the fill copy grid timed per host: its GPU tests, `freetoken calibrate` at the
      # Qwen3-30B-A3B expert, then the peer slice's Zipf b=1 gpu-fill on 32 programs and on the
      # grid timed fastest (~5 min)
      timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/engine/experts/test_calibration.py \
        tests/kernels/test_expert_fills.py 2>&1 | tee "$OUT/copy_grid_tests.log" | tail -6
      FREETOKEN_CACHE="$OUT/cache" timeout 120 python3 -m freetoken_agent.cli calibrate --hidden 2048 \
        --inter 768 2>&1 | tail -2
      for grid in "--copy-programs 32" ""; do  # 32 programs, then the grid timed at the start
        # shellcheck disable=SC2086
        timeout 150 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
          --skip-prefill --batches 1 --rounds 2 --decode 256 --regimes zipf:1.0,loc:0.7 uniform \
          --policies gpu-fill $grid --out "$OUT/copy_grid${grid:+_32}" 2>&1 \
          | tee "$OUT/copy_grid${grid:+_32}.log" | grep -E "fill copies|\|b" | grep -v "round[0-9]" \
          | cut -c1-200
      done ;;
    acceptance-peer)  # peer slice, b=1 and 4, adaptive / transfer / gpu-fill, 2 rounds (~5 min)
      # 256 timed tokens a row: at the default 48, adaptive's Zipf rows trailed gpu-fill's (48
      # layers: 113.6 against 122.1, twenty-fifth session) where 320 tokens found them even
      # (117.9 against 118.2, twenty-fourth): likely the cache its path trials left colder.
      timeout 560 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 4 --rounds 2 --decode 256 --regimes uniform zipf:1.0,loc:0.7 native \
        --policies adaptive transfer gpu-fill --out "$OUT" 2>&1 | tee "$OUT/acceptance_peer.log" \
        | grep "|b" | grep -v "round[0-9]" | cut -c1-200 ;;
    cpu-static-48)  # the host's NUMA layout, then 48 layers / 32 GB, b=1 and 4, policies cpu and
      # static (the acceptance's other two baselines; adaptive's rows: acceptance-48), ~5.5 min; the
      # last row (native b=4, cpu) does not fit in 300 s
      { lscpu | grep -i -E 'numa|socket|model name|^cpu\(s\)'; for n in /sys/devices/system/node/node*; do
          echo "$n cpus $(cat "$n/cpulist")"; grep MemTotal "$n/meminfo"; done; } 2>&1 \
        | tee "$OUT/numa.log"
      timeout 300 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
        --rounds 1 --decode 48 --regimes uniform zipf:1.0,loc:0.7 native --policies static cpu \
        --out "$OUT" 2>&1 | tee "$OUT/cpu_static_48.log" | grep "|b" | grep -v "round[0-9]" \
        | cut -c1-200 ;;
    acceptance-48)  # 48 layers / 32 GB, b=1 and 4, adaptive / transfer / gpu-fill, 1 round (~6 min)
      # (SPLIT_EXPERT=1: adaptive's split path offered)
      # 128 timed tokens a row (see acceptance-peer); the run took 236 s at 48.
      timeout 570 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
        --rounds 1 --decode 128 --regimes native zipf:1.0,loc:0.7 uniform --policies adaptive transfer \
        gpu-fill ${SPLIT_EXPERT:+--split-expert} --out "$OUT" 2>&1 | tee "$OUT/acceptance_48.log" | grep "|b" \
        | grep -v "round[0-9]" | cut -c1-200 ;;
    offload-30b)  # 48 layers, 32 GB, b=1, the four policies of the acceptance, 3 rounds (~6 min)
      timeout 580 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 \
        --regimes uniform zipf:1.0,loc:0.7 native --policies cpu transfer adaptive static \
        --out "$OUT" 2>&1 | tee "$OUT/offload_30b.log" | grep -v "round[0-9]" | cut -c1-240 ;;
    zero-copy)  # can kernels read experts from pinned host memory, and how fast (~30 s)
      timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
        tests/engine/experts/test_offload_gpu.py -k "host_bank or offloaded_on_cuda" 2>&1 \
        | tee "$OUT/gpu_direct_tests.log" | tail -4
      timeout 120 python3 -m freetoken_agent.bench.zero_copy_probe 2>&1 \
        | tee "$OUT/zero_copy.log" | tail -16 ;;
    workspace)
      timeout 300 python3 -m freetoken_agent.bench workspace --out "$OUT" 2>&1 \
        | tee "$OUT/workspace.log" | grep -v Warn | tail -14 ;;
    stops)  # kernel threads: all physical cores, one left free, four left free
      cores=$(python3 -c "from freetoken_agent.kernels.cpu.experts import physical_cores as p; print(p())")
      timeout 300 python3 -m freetoken_agent.bench profile-offload --layers 12 --budget-gb 8.59 \
        --regimes uniform --policies cpu static adaptive --torch-profile 8 \
        --threads "$cores" $((cores - 1)) $((cores - 4)) \
        >"$OUT/stops_12l.txt" 2>&1; grep -E '^\{|^==' "$OUT/stops_12l.txt" | cut -c1-900
      for policy in default active; do  # the CPU kernel with decode-like gaps: does its team sleep?
        wait_env=(); [ "$policy" = active ] && wait_env=(OMP_WAIT_POLICY=active)
        env "${wait_env[@]}" timeout 120 python3 -m freetoken_agent.bench cpu-experts \
          --no-torch --calls 40 --gap-us 0 300 2>&1 | tail -6 | sed "s/^/$policy: /"
      done ;;
    huge-pages)  # the CPU kernel over a pool in 4 KB pages, then in transparent huge pages (~2 min)
      cat /sys/kernel/mm/transparent_hugepage/enabled
      for flag in "" --huge-pages; do
        timeout 150 python3 -m freetoken_agent.bench cpu-experts --no-torch --calls 40 $flag 2>&1 \
          | tail -7 | sed "s/^/${flag:-4k-pages}: /"
      done ;;
    stream-threshold)  # prefill chunks streamed vs placed, 64-1536 tokens, beside the model (~3 min)
      timeout 400 python3 -m freetoken_agent.bench stream-threshold --out "$OUT" 2>&1 \
        | tee "$OUT/stream_threshold.log" | grep -v Warn | tail -12 ;;
    run-ahead-zipf)  # Zipf b=1 re-runs ~11 segments a token: run-ahead depth and gate (~2 min)
      timeout 300 python3 -m freetoken_agent.bench profile-offload --layers 12 --budget-gb 8.59 \
        --regimes zipf:1.0,loc:0.7 --policies adaptive transfer --run-ahead 0 2 4 \
        --miss-gate 0.2 0.5 >"$OUT/run_ahead_zipf.txt" 2>&1; grep -E '^\{' "$OUT/run_ahead_zipf.txt" \
        | cut -c1-700 ;;
    fill-behind)  # Zipf b=1: fills behind off and on, peer slice then 48 layers (~5 min)
      timeout 200 python3 -m freetoken_agent.bench profile-offload --layers 12 --budget-gb 8.59 \
        --regimes zipf:1.0,loc:0.7 --policies adaptive transfer --fill-behind 0 1 \
        >"$OUT/fill_behind_12l.txt" 2>&1; grep -E '^\{' "$OUT/fill_behind_12l.txt" | cut -c1-700
      timeout 380 python3 -m freetoken_agent.bench profile-offload --layers 48 --budget-gb 32 \
        --regimes zipf:1.0,loc:0.7 --policies adaptive --fill-behind 0 1 \
        >"$OUT/fill_behind_48l.txt" 2>&1; grep -E '^\{' "$OUT/fill_behind_48l.txt" | cut -c1-700 ;;
    stop-clock)  # a stop's and a hit's host time: Zipf and native, 12 then 48 layers (~5 min)
      timeout 150 python3 -m freetoken_agent.bench profile-offload --layers 12 --budget-gb 8.59 \
        --regimes zipf:1.0,loc:0.7 native --policies adaptive transfer \
        >"$OUT/stop_clock_12l.txt" 2>&1; grep -E '^\{' "$OUT/stop_clock_12l.txt" | cut -c1-900
      timeout 200 python3 -m freetoken_agent.bench profile-offload --layers 48 --budget-gb 32 \
        --regimes zipf:1.0,loc:0.7 native --policies adaptive \
        >"$OUT/stop_clock_48l.txt" 2>&1; grep -E '^\{' "$OUT/stop_clock_48l.txt" | cut -c1-900 ;;
    overlap)  # EngineConfig.overlap_schedule off and on, all resident (~6 min)
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_overlap_gpu.py \
        2>&1 | tee "$OUT/gpu_overlap_tests.log" | tail -3
      timeout 400 python3 -m freetoken_agent.bench decode --layers 48 12 --tokens 64 --overlap \
        --sampled --out "$OUT" 2>&1 | tee "$OUT/decode_overlap.log" | tail -8 ;;
    overlap-offload)  # profile-offload, adaptive, overlap off and on (~6 min)
      timeout 200 python3 -m freetoken_agent.bench profile-offload --layers 12 --budget-gb 8.59 \
        --regimes native zipf:1.0,loc:0.7 --policies adaptive --overlap 0 1 \
        >"$OUT/overlap_12l.txt" 2>&1; grep -E '^\{' "$OUT/overlap_12l.txt" | cut -c1-700
      timeout 240 python3 -m freetoken_agent.bench profile-offload --layers 48 --budget-gb 32 \
        --regimes native --policies adaptive --overlap 0 1 \
        >"$OUT/overlap_48l.txt" 2>&1; grep -E '^\{' "$OUT/overlap_48l.txt" | cut -c1-700 ;;
    sampler)  # the sampling kernel's GPU tests, bench sampler, sampled decode
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_sampling_kernel.py \
        2>&1 | tee "$OUT/gpu_sampling_tests.log" | tail -3
      timeout 120 python3 -m freetoken_agent.bench sampler --out "$OUT" 2>&1 | grep '^{' \
        | grep -v '"torch' | cut -c1-200
      timeout 150 python3 -m freetoken_agent.bench decode --layers 48 12 --tokens 64 --overlap \
        --sampled --out "$OUT" 2>&1 | tail -9 ;;
    gpu-fill)  # policy gpu-fill: its GPU tests (and the sampling kernel's), then adaptive against
      # it on the peer slice, every routing, b=1 (~6 min)
      timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_expert_fills.py \
        tests/engine/experts/test_offload_gpu.py tests/engine/test_overlap_gpu.py \
        tests/kernels/test_sampling_kernel.py 2>&1 | tee "$OUT/gpu_fill_tests.log" | tail -4
      timeout 200 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 --rounds 2 --policies adaptive gpu-fill --out "$OUT" 2>&1 \
        | tee "$OUT/gpu_fill_12l.log" | grep -v "round[0-9]" | cut -c1-600 ;;
    gpu-fill-48)  # adaptive against gpu-fill, 48 layers at 32 GB, native and Zipf, b=1 (~5 min)
      timeout 400 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 --rounds 2 \
        --regimes native zipf:1.0,loc:0.7 --policies adaptive gpu-fill --out "$OUT" 2>&1 \
        | tee "$OUT/gpu_fill_48l.log" | grep -v "round[0-9]" | cut -c1-600 ;;
    step-paths)  # adaptive's two step paths: the GPU tests that load adaptive, then the peer
      # slice's table for adaptive, transfer and gpu-fill, b=1 (~7 min)
      timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_expert_fills.py \
        tests/engine/experts/test_offload_gpu.py tests/engine/test_overlap_gpu.py \
        tests/engine/test_hybrid_gpu.py 2>&1 | tee "$OUT/step_paths_tests.log" | tail -4
      timeout 230 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 --rounds 2 --policies adaptive transfer gpu-fill --out "$OUT" \
        2>&1 | tee "$OUT/step_paths_12l.log" | grep -v "round[0-9]" | cut -c1-700 ;;
    step-paths-48)  # the same table at 48 layers / 32 GB, native and Zipf (~5 min)
      timeout 420 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 --rounds 2 \
        --regimes native zipf:1.0,loc:0.7 --policies adaptive transfer gpu-fill --out "$OUT" 2>&1 \
        | tee "$OUT/step_paths_48l.log" | grep -v "round[0-9]" | cut -c1-700 ;;
    shared)
      timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_cpu_worker.py \
        tests/kernels/test_expert_fills_cpu_share.py tests/kernels/test_expert_fills.py \
        tests/engine/experts/test_offload_gpu.py tests/engine/test_overlap_gpu.py \
        tests/engine/test_hybrid_gpu.py 2>&1 | tee "$OUT/shared_tests.log" | tail -6
      grep -E "^(FAILED|ERROR)|^E " "$OUT/shared_tests.log" | head -20
      timeout 250 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 --rounds 1 --policies adaptive --adaptive-path shared \
        --out "$OUT" 2>&1 | tee "$OUT/shared_12l.log" | grep -v "round[0-9]" | cut -c1-900 ;;
    shared-team)  # the worker's kernel threads: OpenMP team against its SpinTeam, alone
      # (bench worker-teams) then on the peer slice's uniform rows, shared path held (~4 min)
      timeout 120 python3 -m freetoken_agent.bench worker-teams --out "$OUT" 2>&1 | tail -6
      for team in omp spin; do
        FREETOKEN_WORKER_TEAM=$team timeout 150 python3 -m freetoken_agent.bench offload \
          --layers 12 --budget-gb 8.59 --skip-prefill --batches 1 --rounds 1 --regimes uniform \
          --policies adaptive --adaptive-path shared --out "$OUT/team_$team" 2>&1 \
          | grep "|b1|" | grep -v round | cut -c1-300
      done ;;
    shared-48)
      timeout 560 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 --rounds 1 \
        --regimes native zipf:1.0,loc:0.7 --policies adaptive gpu-fill --out "$OUT" 2>&1 \
        | tee "$OUT/shared_48l.log" | grep -v "round[0-9]" | cut -c1-900 ;;
    fusions)
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_route.py \
        tests/kernels/test_proj_norm.py tests/kernels/test_router.py tests/kernels/test_norm.py \
        tests/kernels/test_gemv.py 2>&1 | tee "$OUT/fusion_tests.log" | tail -4
      grep -E "^(FAILED|ERROR)" "$OUT/fusion_tests.log" | head
      timeout 120 python3 -m freetoken_agent.bench gemv --out "$OUT" 2>&1 | grep router \
        | cut -c1-160
      timeout 260 python3 -m freetoken_agent.bench fusions --layers 48 --out "$OUT" 2>&1 \
        | cut -c1-200 ;;
    shared-zipf)
      timeout 300 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 4 --rounds 1 --regimes zipf:1.0,loc:0.7 --policies adaptive \
        gpu-fill --adaptive-path shared --no-shared-gate --out "$OUT" 2>&1 \
        | grep "|b" | cut -c1-300 ;;
    shared-zipf-48)
      timeout 330 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 --rounds 1 \
        --regimes zipf:1.0,loc:0.7 --policies adaptive gpu-fill --adaptive-path shared \
        --no-shared-gate --out "$OUT" 2>&1 | grep "|b" | cut -c1-300 ;;
    step-kernels)
      timeout 200 python3 -m freetoken_agent.bench step-kernels --layers 12 --budget-gb 8.59 \
        --policies gpu-fill transfer --rows 24 --out "$OUT/step_kernels_12l.jsonl" 2>&1 \
        | cut -c1-150 | tail -56
      timeout 330 python3 -m freetoken_agent.bench step-kernels --layers 48 --budget-gb 32 \
        --policies gpu-fill --rows 24 --out "$OUT/step_kernels_48l.jsonl" 2>&1 \
        | cut -c1-150 | tail -28 ;;
    shared-kernels)  # peer slice, uniform: the shared path's kernels (the MoE sum over k holds
      # the wait for the CPU worker) against gpu-fill's, b=1 then b=4, and the worker's jobs (~3 min)
      for b in 1 4; do
        timeout 140 python3 -m freetoken_agent.bench step-kernels --layers 12 --budget-gb 8.59 \
          --regime uniform --batch $b --policies adaptive gpu-fill --adaptive-path shared \
          --rows 16 --out "$OUT/shared_kernels_b$b.jsonl" 2>&1 | cut -c1-400 | tail -36
      done ;;
    cold-share)  # the CPU share's new rule (no lone miss, the least used to the CPU): its GPU
      # tests, then 48 layers / 32 GB, Zipf b=1 and 4, adaptive held on shared (ungated)
      # against gpu-fill, one round (~5 min; the old rule ran 77.8 against 111.3 at b=1)
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_expert_fills_cpu_share.py 2>&1 | tee "$OUT/cold_share_tests.log" | tail -3
      timeout 420 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
        --rounds 1 --decode 128 --regimes zipf:1.0,loc:0.7 --policies adaptive gpu-fill \
        --adaptive-path shared --no-shared-gate --out "$OUT/cold_share" 2>&1 \
        | tee "$OUT/cold_share_48.log" | grep "|b" | grep -v "round[0-9]" | cut -c1-200 ;;
    s37-check)  # the thirty-sixth session's unrun GPU code, then the path trials' blocks by
      # place (~6 min): the plan's GPU tests with the m - 1 bound, bench plan-kernel and bench
      # side-fill on bench/cuda_graph.device_ms, the peer slice's Zipf rows (adaptive, gpu-fill)
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_expert_fills.py \
        tests/kernels/test_expert_fills_cpu_share.py 2>&1 | tee "$OUT/s37_plan_tests.log" | tail -3
      timeout 100 python3 -m freetoken_agent.bench plan-kernel --slots 687 3022 --misses 0 4 8 \
        --tokens 1 --share 0 --out "$OUT" 2>&1 | tee "$OUT/s37_plan_kernel.log" | cut -c1-200 | tail -8
      timeout 100 python3 -m freetoken_agent.bench side-fill --steps 40 --out "$OUT" 2>&1 \
        | tee "$OUT/s37_side_fill.log" | cut -c1-200 | tail -8
      timeout 200 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 4 --rounds 2 --decode 256 --regimes zipf:1.0,loc:0.7 \
        --policies adaptive gpu-fill --out "$OUT/s37_zipf" 2>&1 | tee "$OUT/s37_zipf.log" \
        | grep "|b" | grep -v "round[0-9]" | cut -c1-200
      grep "adaptive|round" "$OUT/s37_zipf.log" | python3 -c "
import json, sys
for line in sys.stdin:
    key, row = line.split(' ', 1)
    row = json.loads(row)
    print(key, 'paths', {p: round(v, 2) for p, v in row['path_ms_per_token'].items()},
          'places', {k: [round(v, 2) for v in m] for k, m in row['trial_positions_ms'].items()})
" ;;
    share-curve)  # peer slice, uniform, b=1 and 4: adaptive held on shared (ungated: a held
      # path never passes the gate's stops) at CPU shares 0.45-0.85, one round each (~4 min)
      timeout 500 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 4 --rounds 1 --decode 256 --regimes uniform --policies adaptive \
        --adaptive-path shared --no-shared-gate --hold-share 0.45 0.55 0.65 0.75 0.85 \
        --out "$OUT/share_curve" 2>&1 | tee "$OUT/share_curve.log" | grep "|b" \
        | grep -v "round[0-9]" | cut -c1-200 ;;
    plan-kernel)  # the fills' GPU tests, then the plan kernel alone per slots and misses, the
      # kernels' module before a change beside it when PLAN_BEFORE names its file (~3 min)
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_expert_fills.py \
        tests/kernels/test_expert_fills_cpu_share.py tests/kernels/test_expert_fills_split.py \
        tests/engine/experts/test_device_fills.py 2>&1 | tee "$OUT/plan_tests.log" | tail -4
      timeout 300 python3 -m freetoken_agent.bench plan-kernel ${PLAN_BEFORE:+--kernel-file "$PLAN_BEFORE"} \
        --out "$OUT" 2>&1 | tee "$OUT/plan_kernel.log" | cut -c1-300 | tail -60 ;;
    profile)
      timeout 200 python3 -m freetoken_agent.bench profile --layers 12 --rows 30 \
        >"$OUT/profile_12l.txt" 2>&1; tail -c 6000 "$OUT/profile_12l.txt" ;;
    gemv)
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gemv.py 2>&1 \
        | tee "$OUT/gpu_gemv_tests.log" | tail -3
      timeout 300 python3 -m freetoken_agent.bench gemv --out "$OUT" 2>&1 | tee "$OUT/gemv.log" \
        | cut -c1-200 | tail -50 ;;
    decode-skinny)  # all-resident decode, 12 layers, cuBLAS projections then the skinny matmul
      timeout 250 python3 -m freetoken_agent.bench decode --layers 12 --out "$OUT" 2>&1 | tail -3
      timeout 250 python3 -m freetoken_agent.bench decode --layers 12 --skinny-gemv --out "$OUT" \
        2>&1 | tail -3 ;;
    s28-split)  # the split expert's first device run (~8 min): its GPU tests (the worker's
      # copies behind through libcuda, the split set held and alternating with the other paths
      # against resident), then 48 layers / 32 GB under Zipf with adaptive held on `split`
      # against gpu-fill (twenty-seventh session: adaptive 119.5 / 170.6, gpu-fill 122.3 /
      # 169.7 at b=1 / 4)
      timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -s \
        tests/kernels/test_cpu_worker_behind.py tests/engine/experts/test_split_path_gpu.py \
        2>&1 | tee "$OUT/split_tests.log" | grep -E "passed|failed|Error|slots|^E " | tail -25
      timeout 330 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 4 \
        --rounds 1 --decode 128 --regimes zipf:1.0,loc:0.7 --policies adaptive gpu-fill \
        --adaptive-path split --out "$OUT/split48" 2>&1 | tee "$OUT/split_48.log" | grep " | " \
        | cut -c1-200
      python3 - "$OUT/split48/offload_48l_32gb.json" <<'PY'
import json, sys
for key, row in json.load(open(sys.argv[1]))["decode"].items():
    share = row.get("cpu_share") or {}
    print(key, round(row["tok_s"], 1), "split/tok", round(row.get("split_per_token", 0), 2),
          "in-flight hits/tok", round(row.get("split_hits_per_token", 0), 2), "max job ms",
          share.get("max_job_ms"), "B_H online", round(row["b_h_online_gb_s"], 1))
PY
      ;;
    split-cuts)  # the split path's cuts and the trials' against gpu-fill, 48 layers / 32 GB,
      # Zipf, b=1 and 4, then the trials' cut at 8 and 10 worker threads (~6 min)
      timeout 500 python3 -m freetoken_agent.bench split-cuts --batches 1 4 --threads 8 10 \
        --out "$OUT" 2>&1 | tee "$OUT/split_cuts.log" | grep " | " ;;
    s27-check)  # the split expert's first measurement and the CPU worker's lost cores
      # (~5 min): bench side-fill (NOTES, twenty-sixth session: measure this before building
      # it), then the peer slice native then uniform, whose probes after native fell to 45
      # GB/s and whose uniform row's worker measured 58 GB/s online against 81 (twenty-seventh
      # session): cpu_load says whose threads held the cores
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/bench/test_side_fill.py \
        2>&1 | tail -3
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
        -k partly 2>&1 | tail -2  # partly filled slots in the decode MoE kernels, bf16
      # The CPU kernel's column slices on the host's AVX-512 (the dev machine has AVX2 only)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cpu_experts.py \
        tests/kernels/test_cpu_worker.py 2>&1 | tail -2
      timeout 150 python3 -m freetoken_agent.bench side-fill --out "$OUT" 2>&1 \
        | tee "$OUT/side_fill.log" | cut -c1-220
      timeout 200 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 --rounds 1 --decode 128 --regimes native uniform \
        --policies adaptive gpu-fill --out "$OUT/cpu_load" 2>&1 | tee "$OUT/cpu_load.log" \
        | grep " | " | cut -c1-200
      # The rows' and probes' cores (their lines in the log are too long to print whole)
      python3 - "$OUT/cpu_load/offload_12l_8gb.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for p in report["host_probes"]:
    print("probe", p["when"], "b_h", round(p.get("b_h_gb_s", 0), 1), "idle",
          json.dumps(p.get("idle_load")), "during", json.dumps(p.get("probe_load")))
for key, row in report["decode"].items():
    print(key, round(row["tok_s"], 1), "b_h online", round(row["b_h_online_gb_s"], 1),
          json.dumps(row.get("cpu_load")))
PY
      ;;
    stops-rule)  # the peer slice under Zipf, adaptive (stops measured, not kept while fills
      # pay) against gpu-fill and transfer, b=1 and 4, 2 rounds (~2.5 min)
      timeout 280 python3 -m freetoken_agent.bench offload --layers 12 --budget-gb 8.59 \
        --skip-prefill --batches 1 4 --rounds 2 --decode 256 --regimes zipf:1.0,loc:0.7 \
        --policies adaptive gpu-fill transfer --out "$OUT/stops_rule" 2>&1 \
        | tee "$OUT/stops_rule.log" | grep "|b" | grep -v "round[0-9]" | cut -c1-200 ;;
    worker-pins)  # the peer slice's uniform rows, adaptive, the CPU worker unpinned and then
      # pinned to cores 0-11 (FREETOKEN_WORKER_CPUS): does pinning cut the jobs' tail (~4 min)
      for cpus in "" 0-11; do
        FREETOKEN_WORKER_CPUS=$cpus timeout 270 python3 -m freetoken_agent.bench offload \
          --layers 12 --budget-gb 8.59 --skip-prefill --batches 1 4 --rounds 2 --decode 256 \
          --regimes uniform --policies adaptive --out "$OUT/pins_${cpus:-none}" 2>&1 \
          | tee "$OUT/pins_${cpus:-none}.log" | grep "|b" | grep -v "round[0-9]" | cut -c1-160
        python3 - "$OUT/pins_${cpus:-none}/offload_12l_8gb.json" "${cpus:-none}" <<'PY'
import json, sys
for key, row in json.load(open(sys.argv[1]))["decode"].items():
    print(sys.argv[2], key, [round(t, 1) for t in row["tok_s_rounds"]], "jobs",
          json.dumps(row.get("worker_jobs")), "paths", json.dumps(row.get("path_ms_per_token")))
PY
      done ;;
    s59-stream)  # the prefill streamer: its GPU tests, the 48-layer 8k rows, then the peer
      # slice's 4096 rows with the warm one (each row the median of 3 runs, ~7 min)
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/experts/test_streaming.py tests/kernels/test_moe_parts.py 2>&1 \
        | tee "$OUT/s59_gpu_tests.log" | tail -5
      timeout 280 python3 -m freetoken_agent.bench offload --skip-decode --prefill 8192 \
        --out "$OUT" 2>&1 | tee "$OUT/s59_prefill48.log" | grep -E "^8192" | cut -c1-300
      timeout 120 python3 -m freetoken_agent.bench offload --layers 12 --skip-decode \
        --prefill 4096 --out "$OUT" 2>&1 | tee "$OUT/s59_prefill12.log" | grep -E "^4096" \
        | cut -c1-300 ;;
    s60-timeline)  # the peer slice's 4096-token prefill profiled, cold and warm (~2 min)
      timeout 200 python3 -m freetoken_agent.bench prefill-timeline --layers 12 --tokens 4096 \
        --out "$OUT" 2>&1 | tee "$OUT/s60_timeline12.log" | grep -vE "^host probe" | tail -80 ;;
    s61-lend)  # the workspace lent to slots: its GPU tests, then the peer slice's uniform b=1
      # decode, adaptive, with it and without (2 rounds of 256 each, ~5 min)
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -s \
        tests/engine/test_workspace_lending.py tests/engine/test_elastic_memory.py 2>&1 \
        | tee "$OUT/s61_gpu_tests.log" | grep -E "slots|passed|failed|Error" | tail -8
      for lend in lend-workspace no-lend-workspace; do
        timeout 200 python3 -m freetoken_agent.bench offload --layers 12 --skip-prefill \
          --batches 1 --rounds 2 --decode 256 --regimes uniform --policies adaptive \
          --$lend --out "$OUT/$lend" 2>&1 | tee "$OUT/s61_peer_uniform_$lend.log" \
          | grep "|b" | cut -c1-220
      done ;;
    s61-ab)  # the lent workspace's GPU tests, then peer uniform b=1 adaptive with and without
      # it, alternating processes (on, off, on, off; 2 rounds of 256 each, ~6 min)
      timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -s \
        tests/engine/test_workspace_lending.py tests/engine/test_elastic_memory.py -k \
        "lending_on_cuda or vram_back" 2>&1 | tee "$OUT/s61_gpu_tests2.log" \
        | grep -E "slots|passed|failed|Error" | tail -8
      for lend in lend-workspace no-lend-workspace lend-workspace no-lend-workspace; do
        timeout 120 python3 -m freetoken_agent.bench offload --layers 12 --skip-prefill \
          --batches 1 --rounds 2 --decode 256 --regimes uniform --policies adaptive \
          --$lend --out "$OUT/$lend$SECONDS" 2>&1 | tee -a "$OUT/s61_ab_$lend.log" \
          | grep "|b" | grep -v round | cut -c1-160
      done ;;
    s61-zipf)  # peer Zipf and native b=1 adaptive with and without the lent workspace (~3 min)
      for lend in lend-workspace no-lend-workspace; do
        timeout 140 python3 -m freetoken_agent.bench offload --layers 12 --skip-prefill \
          --batches 1 --rounds 2 --decode 256 --regimes zipf:1.0,loc:0.7 native \
          --policies adaptive --$lend --out "$OUT/$lend" 2>&1 \
          | tee -a "$OUT/s61_zipf_$lend.log" | grep "|b" | grep -v round | cut -c1-160
      done ;;
    s62-lend-ab)  # the lent workspace against the whole one inside one engine (bench offload
      # --lend-ab): peer uniform b=1 and b=4, adaptive, 3 rounds of 256 (~6 min)
      timeout 560 python3 -m freetoken_agent.bench offload --layers 12 --skip-prefill \
        --batches 1 4 --rounds 3 --decode 256 --regimes uniform --policies adaptive --lend-ab \
        --out "$OUT" 2>&1 | tee "$OUT/s62_lend_ab.log" | grep "|b" | cut -c1-200 ;;
    s62-every)  # the CPU's share free to take a layer's every miss where fills do not pay:
      # its plan's GPU tests, then the peer slice's uniform b=1 and 4, adaptive, every against
      # kept in one engine (--every-miss-ab), 2 rounds of 256 (~6 min)
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_expert_fills_cpu_share.py 2>&1 | tee "$OUT/s62_every_tests.log" | tail -3
      timeout 420 python3 -m freetoken_agent.bench offload --layers 12 --skip-prefill \
        --batches ${EVERY_BATCHES:-1 4} --rounds 2 --decode 256 --regimes uniform \
        --policies adaptive --every-miss-ab --out "$OUT" 2>&1 | tee "$OUT/s62_every.log" | grep "|b" | cut -c1-220 ;;
    s62-native-48)  # 48 layers / 32 GB, native b=1 (the H200's unmet row): adaptive and
      # gpu-fill, 2 rounds of 256 (~4 min)
      timeout 560 python3 -m freetoken_agent.bench offload --skip-prefill --batches 1 \
        --rounds 2 --decode 256 --regimes native --policies adaptive gpu-fill --out "$OUT" 2>&1 \
        | tee "$OUT/s62_native48.log" | grep "|b" | cut -c1-200 ;;
    s61-warm)  # the peer slice's 4096-token prefill rows with the workspace lent (~2 min)
      timeout 200 python3 -m freetoken_agent.bench offload --layers 12 --skip-decode \
        --prefill 4096 --out "$OUT" 2>&1 | tee "$OUT/s61_prefill12.log" | grep -E "^4096" \
        | cut -c1-400 ;;
    kernels)
      timeout 200 python3 -m freetoken_agent.bench.attention_kernel --graph-bound 0 2>&1 | tee "$OUT/attn.log" | tail -25
      timeout 200 python3 -m freetoken_agent.bench.moe_kernel 2>&1 | tee "$OUT/moe.log" | tail -25 ;;
  esac
done
