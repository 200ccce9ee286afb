#!/usr/bin/env bash
# Session 29 (lead), issues 14 and 15, one device call on whichever Hopper card comes, in TOTAL seconds:
#   1. tests/sparse/test_union_gluon.py (the Gluon tile forward / dq against the reference and the Triton tiles);
#   2. benchmarks/gpu_gluon_fwd_session29.py (#15: Gluon vs Triton tile forward, tile dq, keyq dk/dv, fwd + bwd;
#      trained 32K; 128K on an H100);
#   3. on an H200 (> 100 GB): the #14 rows at the target's shape, `bench rollout` b32 16K (the cuda decode select's
#      first H200 run); on an H100: the CUDA sampled quantile of branch cuda-quantile (its tests and select script).
# Usage (device machine, repository root): TOTAL=520 bash benchmarks/gpu_session29.sh   (writes under $OUT)
source benchmarks/gpu_lib.sh  # set -u, PYTHONPATH, TOTAL, SRL, $mem
timeout 130 python3 -m pytest -q tests/sparse/test_union_gluon.py > "$OUT/t_gluon.log" 2>&1
echo "gluon tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|Error|assert" "$OUT/t_gluon.log" | grep -v "^ - " | tail -12
seq=32768,131072; [ "$mem" -gt 100000 ] && seq=32768
timeout 200 python3 benchmarks/gpu_gluon_fwd_session29.py --seqlens $seq --budget 185 --out "$OUT/gf29" \
  > "$OUT/gf29.log" 2>&1; echo "gluon script rc=$? at ${SECONDS}s"; tail -c 3000 "$OUT/gf29.log"
left=$((TOTAL - SECONDS))
if [ "$mem" -gt 100000 ]; then
  timeout $((left - 5)) $SRL bench rollout --config recipes/rollout_bench_qwen3_4b.yaml --long-new-tokens 16K \
    --long-batches 32 --latency-contexts none --whole integrate -o "$OUT/ro_b32.json" > "$OUT/ro_b32.log" 2>&1
  echo "rollout rc=$? at ${SECONDS}s"; grep -v "^- " "$OUT/ro_b32.log" | tail -25
else
  timeout 80 python3 -m pytest -q -x tests/sparse/test_cand_cuda.py > "$OUT/t_cand.log" 2>&1
  echo "cand tests rc=$? at ${SECONDS}s"; tail -3 "$OUT/t_cand.log"
  left=$((TOTAL - SECONDS))
  [ $left -gt 60 ] && timeout $((left - 5)) python3 benchmarks/gpu_cand_select_session28.py --seqlens 32768 \
    --budget $((left - 20)) --reps 2 --out "$OUT/cs28" > "$OUT/cs28.log" 2>&1
  echo "cand script rc=$? at ${SECONDS}s"; tail -c 1500 "$OUT/cs28.log"
fi
