#!/usr/bin/env bash
# Session 25 (lead), issues 14 and 15, one device call on whichever Hopper card comes (H100 80 GB or H200), in
# TOTAL seconds (default 575; the session's device time was short):
#   1. `gpu_norm_session21.py` (#14: session 21's untimed builds, fuse_norm's second form, L2 prefetch, TMA loads,
#      the fused merge) at batch 32 where the Qwen3-4B shape's 32 x 16K K/V fits (H200), else batch 16;
#   2. `bench attention` through the CLI at main's defaults, 32K (#15: prefill and trained fwd + bwd);
#   3. if time is left: the CLI's sparse 16K step rows with fp8 index keys against bf16 ones.
# Session 25 ran parts 2-3 as a second command after the first form's `timeout srl` found no such program.
# Usage (device machine, repository root): TOTAL=400 bash benchmarks/gpu_session25.sh   (writes under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TOTAL=${TOTAL:-575}
SRL="python3 -m sparse_rl.cli.main"  # a variable, not a function: `timeout` runs commands, not shell functions
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
batch=16; [ "$mem" -gt 100000 ] && batch=32
nm=$((TOTAL - 170))
timeout $nm python3 benchmarks/gpu_norm_session21.py --batch $batch --tol 0.1 --budget $((nm - 15)) \
  --out "$OUT/nm" > "$OUT/nm.log" 2>&1
echo "norm21 rc=$? batch=$batch at ${SECONDS}s"; tail -c 2500 "$OUT/nm.log"
left=$((TOTAL - SECONDS))
timeout $left $SRL bench attention --seqlens 32K --backward-seqlens 32K --granular none -o "$OUT/att.json" \
  > "$OUT/att.log" 2>&1; echo "attention rc=$? at ${SECONDS}s"
grep -v "^- " "$OUT/att.log" | tail -20
for d in fp8 bf16; do
  [ $((TOTAL - SECONDS)) -lt 70 ] && { echo "no time for the $d rows"; break; }
  timeout 65 $SRL bench rollout --config recipes/rollout_bench_qwen3_4b.yaml --long-new-tokens none \
    --set "long_batches=[]" --latency-contexts none --step-contexts 16K --step-batch $batch --index-dtype $d \
    --no-hf --no-eager -o "$OUT/ro_$d.json" > "$OUT/ro_$d.log" 2>&1
  echo "rollout $d rc=$?"; tail -5 "$OUT/ro_$d.log"
done
