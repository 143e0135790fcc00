#!/usr/bin/env bash
# One device-machine session: install without network, run the GPU tests, then benchmarks.
# Usage (on the device): bash bench/device_check.sh STAGE...   stages: tests decode kernels
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
      timeout 420 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/ 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40 ;;
    engine-tests)
      timeout 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/engine 2>&1 \
        | tee "$OUT/gpu_engine_tests.log" | grep -E "error|agreement|passed|failed|Error" ;;
    decode)
      timeout 400 python3 -m freetoken_agent.bench decode --out "$OUT" 2>&1 \
        | tee "$OUT/decode_baseline.log" | tail -12 ;;
    kernels)
      timeout 200 python3 -m freetoken_agent.bench.attention_kernel 2>&1 | tee "$OUT/attn.log" | tail -25
      timeout 200 python3 -m freetoken_agent.bench.moe_kernel 2>&1 | tee "$OUT/moe.log" | tail -25 ;;
  esac
done
