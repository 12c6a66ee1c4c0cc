#!/usr/bin/env bash
# The toy LM (mhc arm) on one GPU against DDP and FSDP2 on two GPUs with the same global batch,
# and activation memory with and without checkpointing: the tables of docs/distributed.md.
#   bash bench/distributed_gpu.sh [steps]
# Needs 2 CUDA GPUs. Tables (tables.md), the JSONL logs (logs.tgz) and the GPU description go to
# $OUT (or results/distributed).
set -euo pipefail
out=${OUT:-results/distributed}
steps=${1:-300}
runs=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared machines): keep these set for every process started here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
nvidia-smi topo -m | tee -a "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

toy="examples/train_toy_lm.py --preset gpu --no-progress"
two="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
: > "$out/tables.md"
table() {  # table TITLE REFERENCE RUN... [options]
  printf '\n### %s\n\n' "$1" >> "$out/tables.md"
  shift
  python3 -m bench.distributed_table "$@" | tee -a "$out/tables.md"
}

# 1. equivalence in fp32 (logged losses are fp32; bf16 losses are rounded to 1/64 at loss 2-4)
eq="$toy --residual mhc --dtype float32 --steps 20 --log-every 1 --eval-every 20"
python3 $eq --out-dir "$runs/fp32_one_gpu" | tail -1
$two $eq --out-dir "$runs/fp32_ddp_2gpu" | tail -1
$two $eq --fsdp --out-dir "$runs/fp32_fsdp_2gpu" | tail -1
table "fp32, 20 steps" "$runs/fp32_one_gpu" "$runs/fp32_ddp_2gpu" "$runs/fp32_fsdp_2gpu" --skip 5

# 2. bf16 training, preset batch (32 x 256 tokens) and 4x that
for batch in 32 128; do
  batch_steps=$((steps * 32 / batch < 100 ? 100 : steps * 32 / batch))  # about the same tokens
  run="$toy --residual mhc --steps $batch_steps --eval-every 100 --log-every 10 --batch-size $batch"
  python3 $run --out-dir "$runs/b${batch}_one_gpu" | tail -1
  $two $run --out-dir "$runs/b${batch}_ddp_2gpu" | tail -1
  $two $run --fsdp --out-dir "$runs/b${batch}_fsdp_2gpu" | tail -1
  table "bf16, global batch $batch x 256 tokens, $batch_steps steps" \
    "$runs/b${batch}_one_gpu" "$runs/b${batch}_ddp_2gpu" "$runs/b${batch}_fsdp_2gpu"
done

# 3. activation memory: plain residual and mhc, with and without checkpointing (one GPU)
for arm in baseline mhc; do
  run="$toy --residual $arm --steps 100 --eval-every 100 --log-every 10"
  python3 $run --out-dir "$runs/${arm}_memory" | tail -1
  python3 $run --checkpoint-activations --out-dir "$runs/${arm}_memory_checkpointed" | tail -1
  table "activation memory, $arm" "$runs/${arm}_memory" "$runs/${arm}_memory_checkpointed" --arm $arm
done

(cd "$runs" && tar czf "$out/logs.tgz" ./*/*.jsonl ./*/run.json)
