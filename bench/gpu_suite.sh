#!/usr/bin/env bash
# One pass on a CUDA machine: the GPU tests, then the Sinkhorn benchmark
# (bench.loss and bench.mixing run separately: each takes minutes;
# the mixing GPU tests take about 3.5 minutes on a cold Triton cache).
#   bash bench/gpu_suite.sh [pytest -k expression] [benchmark args...]
# Logs and CSVs go to $OUT (or results/). Wheels in .whl/ (pytest, hypothesis, einops) are
# installed to /tmp/site first when the machine has no package index.
set -uo pipefail
out=${OUT:-results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
filter=${1:-}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_sinkhorn_gpu.py tests/test_sinkhorn_eps.py tests/test_mixing_gpu.py \
  tests/test_mixing_fused.py tests/test_mixing_edges.py tests/test_mixing_chain.py tests/test_mixing_chain_gpu.py \
  tests/test_launch.py tests/test_capture_gpu.py tests/test_deepseek_v4.py tests/test_losses_gpu.py \
  ${filter:+-k "$filter"} 2>&1 | tee "$out/tests.log"
python3 -m bench.sinkhorn --out "$out/sinkhorn.csv" "$@" 2>&1 | tee "$out/bench.log"
