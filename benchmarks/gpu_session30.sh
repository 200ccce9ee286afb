#!/usr/bin/env bash
# Session 30 (lead), issues 14 and 15, one device call, TOTAL seconds:
#   1. the new "auto" backward (Gluon tile dq + keyq dk/dv on sm_90) against "gluon" / "triton" (its GPU test);
#   2. on an H200 (> 100 GB): #14 at the target's shape, `bench rollout` b32 16K whole generation (the cuda decode
#      select's first H200 run), then #15's CLI row if time is left; on an H100: #15's CLI row
#      (`bench attention --seqlens 32K --backward-seqlens 32K`: prefill with the CUDA quantile, fwd + bwd with the
#      Gluon backward).
# Usage (device machine, repository root): TOTAL=520 bash benchmarks/gpu_session30.sh   (writes under $OUT)
# Options: ROLLOUT=0 (skip the H200 rollout), NCU=1 (H100: ncu of the tile forward / dq), GF=1 (H100: keyq_gluon's
# program orders and the Gluon dq at 32K / 128K).
source benchmarks/gpu_lib.sh  # set -u, PYTHONPATH, TOTAL, SRL, $mem
timeout 60 python3 -m pytest -q tests/sparse/test_union_gluon.py -k auto > "$OUT/t_auto.log" 2>&1
echo "auto tests rc=$? at ${SECONDS}s"; tail -2 "$OUT/t_auto.log"
gluon_sweep() {  # GF=1: keyq_gluon's program orders, the Gluon dq at 32K / 128K (gpu_gluon_fwd_session29.py)
  timeout "$1" python3 benchmarks/gpu_gluon_fwd_session29.py --seqlens 32768,131072 --budget $(($1 - 15)) --tunes 32x2 \
    --dq-tunes 64x2 --keyq-tunes 2x1,2x4,2x8 --reps 1 --out "$OUT/gf30" > "$OUT/gf30.log" 2>&1
  echo "gluon sweep rc=$? at ${SECONDS}s"; tail -c 2500 "$OUT/gf30.log"
}
attention() {
  timeout "$1" $SRL bench attention --seqlens 32K --backward-seqlens 32K --granular none --no-flex \
    --set "patterns=[indexer,trained]" -o "$OUT/attn32k.json" \
    > "$OUT/attn32k.log" 2>&1
  echo "attention rc=$? at ${SECONDS}s"; grep -v "^- " "$OUT/attn32k.log" | tail -30
}
if [ "$mem" -gt 100000 ] && [ "${ROLLOUT:-1}" = 1 ]; then
  timeout $((TOTAL - SECONDS - 5)) $SRL bench rollout --config recipes/rollout_bench_qwen3_4b.yaml \
    --long-new-tokens 16K --long-batches 32 --latency-contexts none --whole integrate -o "$OUT/ro_b32.json" \
    > "$OUT/ro_b32.log" 2>&1
  echo "rollout rc=$? at ${SECONDS}s"; grep -v "^- " "$OUT/ro_b32.log" | tail -25
  left=$((TOTAL - SECONDS)); [ $left -gt 100 ] && attention $((left - 5))
else
  attention $((TOTAL - SECONDS - 70))
  left=$((TOTAL - SECONDS)); [ "${NCU:-0}" = 1 ] && [ $left -gt 60 ] && ncu_tiles $((left - 10)) ncu30
  left=$((TOTAL - SECONDS)); [ "${GF:-0}" = 1 ] && [ $left -gt 80 ] && gluon_sweep $((left - 10))
fi
