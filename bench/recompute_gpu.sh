#!/usr/bin/env bash
# recompute_streams on a CUDA machine: its tests on the compiled kernels, then the GPT memory and
# step-time table against the block length (eager; compiled with --compiled), or the DeepSeek-V4
# step (--v4). Logs under $OUT (or results/recompute).
set -uo pipefail
OUT=${OUT:-results/recompute}
mkdir -p "$OUT"
case "${1:-}" in
  --compiled)
    python3 -m bench.mixing --tables model --models 1024 --arms plain mhc mhc-chain --recompute 3 0 \
      --modes compiled --repeats 3 --seq 2048 --out-dir "$OUT/compiled" 2>&1 | tee "$OUT/gpt_compiled.log" ;;
  --v4)
    python3 examples/deepseek_v4.py --bench-step --rounds 3 2>&1 | tee "$OUT/v4_step.log" ;;
  *)
    python3 -m pytest -q -p no:cacheprovider tests/test_recompute.py 2>&1 | tail -5 | tee "$OUT/tests.log"
    python3 -m bench.mixing --tables model --models 1024 --arms plain mhc mhc-chain --recompute 2 3 0 \
      --modes eager --repeats 3 --seq 2048 --out-dir "$OUT/eager_1024" 2>&1 | tee "$OUT/gpt_eager_1024.log"
    python3 -m bench.mixing --tables model --models 4096 --arms plain mhc mhc-chain --recompute 2 0 \
      --modes eager --repeats 3 --seq 2048 --out-dir "$OUT/eager_4096" 2>&1 | tee "$OUT/gpt_eager_4096.log" ;;
esac
