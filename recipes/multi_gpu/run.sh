#!/usr/bin/env bash
# Issue 18: GRPO (sparse+distill) with FSDP2 and DDP, and indexer training with DDP, on two GPUs over NCCL,
# each checked against a one-GPU run of the same global batch; then resume after a kill, and 1-vs-2-GPU scaling.
#
#   bash recipes/multi_gpu/run.sh OUT            # on a machine with >= 2 GPUs (e.g. nvidia-h200-x2)
#
# Every stage writes under OUT and is skipped when its output exists, so a cut run continues where it stopped.
# The last step prints one table (compare.py) and writes OUT/multi_gpu.json.
# Checked on a CPU only (2026-12-01, DEVICE=cpu SIZE=tiny NEW=8 SEQ=256 STEPS=3, gloo): every stage ran, the 2-process
# runs (torchrun DDP, FSDP2, accelerate, FSDP killed + resumed) ended within 7e-9 relative L2 of the 1-process
# weights, indexer DDP within 2e-8. No NCCL/CUDA run has been made: no multi-GPU machine was lent.
set -euo pipefail
OUT=${1:?usage: bash recipes/multi_gpu/run.sh OUT}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
# NVLink multicast stays off on shared hosts (device README): NCCL, PyTorch symmetric memory, NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-4}
# DEVICE=cpu SIZE=tiny NEW=8 SEQ=256 runs the same plumbing on a CPU (gloo), as a dry run of this script.
DEVICE=${DEVICE:-cuda} SIZE=${SIZE:-large} NEW=${NEW:-128} SEQ=${SEQ:-4096}
DT=$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)
SRL="python -m sparse_rl.cli.main"
TR="torchrun --standalone --nproc-per-node 2 -m sparse_rl.cli.main"

# A ~280M-parameter (SIZE=large) Qwen2-shaped model (preset `large`, random weights), its sparse conversion, and tasks.
[ -d "$OUT/dense" ] || $SRL model init "$OUT/dense" --arch qwen2 --size "$SIZE" --dtype "$DT"
[ -d "$OUT/sparse" ] || $SRL convert "$OUT/dense" "$OUT/sparse" --index-topk 256 --index-heads 4 --index-dim 64 \
    --sink 4 --window 64 --dense-layers 0
[ -f "$OUT/tasks.jsonl" ] || $SRL synth math --num-tasks 256 --families arith --out "$OUT/tasks.jsonl"

# Same seed and global batch everywhere: 8 prompts a step x 8 samples (keep 4); 2 GPUs take 4 prompts each.
grpo() {  # grpo RUN_DIR LAUNCHER [extra flags]
  local run=$1 launcher=$2; shift 2
  [ -f "$run/metrics.jsonl" ] && [ "$(wc -l < "$run/metrics.jsonl")" -ge "$STEPS" ] && return 0
  $launcher grpo "$OUT/sparse" --tasks "$OUT/tasks.jsonl" --out "$run" --mode sparse+distill --steps "$STEPS" \
      --samples 8 --keep 4 --prompts-per-step 8 --max-new-tokens "$NEW" --device "$DEVICE" --dtype "$DT" \
      --checkpoint-every 1 --seed 0 --resume "$@"
}
grpo "$OUT/grpo_1gpu" "$SRL"
grpo "$OUT/grpo_ddp" "$TR" --set parallel=ddp
grpo "$OUT/grpo_fsdp" "$TR" --set parallel=fsdp
# accelerate's launcher on the same run (DDP): the same weights as torchrun's
grpo "$OUT/grpo_accel" "accelerate launch --multi_gpu --num_processes 2 -m sparse_rl.cli.main" --set parallel=ddp

# Resume after a kill: stop an FSDP run mid-way (SIGKILL), resume it, compare with the uninterrupted run.
if [ ! -f "$OUT/grpo_fsdp_killed/metrics.jsonl" ] || [ "$(wc -l < "$OUT/grpo_fsdp_killed/metrics.jsonl")" -lt "$STEPS" ]; then
  (grpo "$OUT/grpo_fsdp_killed" "$TR" --set parallel=fsdp) & pid=$!
  while [ ! -d "$OUT/grpo_fsdp_killed/checkpoints/step-2" ] && kill -0 $pid 2>/dev/null; do sleep 2; done
  pkill -KILL -f "grpo_fsdp_killed" || true; wait $pid 2>/dev/null || true
  grpo "$OUT/grpo_fsdp_killed" "$TR" --set parallel=fsdp
fi

# Indexer warm-up with DDP (accelerate), against one GPU with the same global batch.
idx() {  # idx OUT_DIR LAUNCHER BATCH_PER_PROCESS
  [ -f "$1/summary.json" ] && return 0
  $2 indexer train "$OUT/sparse" --out "$1/model" --run-dir "$1/run" --stage warmup --data synthetic \
      --seq-len "$SEQ" --steps 20 --batch-size "$3" --save-every 5 --device "$DEVICE" --seed 0 --resume > "$1.json.tmp"
  mv "$1.json.tmp" "$1/summary.json"
}
idx "$OUT/indexer_1gpu" "$SRL" 4
idx "$OUT/indexer_ddp" "accelerate launch --multi_gpu --num_processes 2 -m sparse_rl.cli.main" 2

python "$here/compare.py" "$OUT" | tee "$OUT/multi_gpu.md"
