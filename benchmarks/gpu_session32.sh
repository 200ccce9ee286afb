#!/usr/bin/env bash
# Session 32 (lead), issues 14 and 15, one device call, TOTAL seconds. Session 32 had no device: everything below
# is its first GPU run, so each step checks its results against the previous kernels before it times them.
#   H200 (> 100 GB): #14's b32 16K rollout first (the CUDA decode select's first H200 run, pending since session
#     27), then the keyq lists A/B (session 32's run-based bits pass: its lists against the old kernel's, then the
#     fwd + bwd through auto), then session 31's Gluon tests and A/B;
#   H100: the warp-specialized dk/dv's GPU test alone (session 31, never run: a wrong mbarrier count would hang),
#     the keyq lists A/B, the Gluon A/B with the ws tune (gpu_session31.sh's), then the CLI's 32K attention row
#     with every default of sessions 31-32 (the Gluon PREFETCH forward in auto, the new lists).
# Usage (device machine, repository root): TOTAL=540 bash benchmarks/gpu_session32.sh   (writes under $OUT)
source benchmarks/gpu_lib.sh  # set -u, PYTHONPATH, TOTAL, SRL, $mem
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
lists() {  # $1 seconds: the bits pass old vs new (equality first), lists, fwd + bwd auto vs dense at 32K
  timeout "$1" python3 benchmarks/gpu_lists_session32.py --seqlens 32768 --budget $(($1 - 10)) --out "$OUT/ls32" \
    > "$OUT/ls32.log" 2>&1
  echo "lists A/B rc=$? at ${SECONDS}s"; tail -c 1500 "$OUT/ls32.log"
}
cli() {  # $1 seconds: the CLI's 32K row (prefill and fwd + bwd on the trained pattern)
  timeout "$1" $SRL bench attention --seqlens 32K --backward-seqlens 32K --granular none --no-flex \
    --set "patterns=[indexer,trained]" -o "$OUT/attn32.json" > "$OUT/attn32.log" 2>&1
  echo "bench attention rc=$? at ${SECONDS}s"; tail -25 "$OUT/attn32.log"
}
if [ "$mem" -gt 100000 ] && [ "${ROLLOUT:-1}" = 1 ]; then
  timeout $((TOTAL - SECONDS - 200)) $SRL bench rollout --config recipes/rollout_bench_qwen3_4b.yaml \
    --long-new-tokens 16K --long-batches 32 --latency-contexts none --whole integrate -o "$OUT/ro_b32.json" \
    > "$OUT/ro_b32.log" 2>&1
  echo "rollout rc=$? at ${SECONDS}s"; grep -v "^- " "$OUT/ro_b32.log" | tail -25
  left=$((TOTAL - SECONDS)); [ $left -gt 100 ] && lists 90
  left=$((TOTAL - SECONDS)); [ $left -gt 100 ] && cli $((left - 10))
else
  timeout 90 python3 -m pytest -q -x tests/sparse/test_union_gluon.py -k "dkdv and tune5" > "$OUT/t_ws.log" 2>&1
  echo "ws tests rc=$? at ${SECONDS}s"; tail -3 "$OUT/t_ws.log"
  lists 100
  left=$((TOTAL - SECONDS)); [ $left -gt 200 ] && cli 110
  left=$((TOTAL - SECONDS)); [ $left -gt 150 ] && timeout $((left - 10)) python3 benchmarks/gpu_gluon_fwd_session29.py \
    --seqlens 32768 --budget $((left - 25)) --tunes 32x2x0x1 --dq-tunes 64x2x1 --keyq-tunes 2x2x1,2x2x1x128x64x1 \
    --reps 3 --out "$OUT/ws32" > "$OUT/ws32.log" 2>&1
  echo "ws A/B at ${SECONDS}s"; tail -c 2500 "$OUT/ws32.log"
fi
