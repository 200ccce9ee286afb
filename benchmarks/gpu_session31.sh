#!/usr/bin/env bash
# Session 31 (lead), issues 14 and 15, one device call, TOTAL seconds:
#   H200 (> 100 GB): #14's b32 16K rollout first (the CUDA decode select's first H200 run, pending since session 27),
#     then the Gluon PREFETCH tests and the 32K kernel A/B;
#   H100: (session 31's last commits) the warp-specialized dk/dv's GPU test alone, then the Gluon tests, the A/B of
#     the three Gluon kernels (PREFETCH, the warp-specialized dk/dv `2x2x1x128x64x1`) with their key /
#     query lists read ahead (PREFETCH) at 32K trained, then ncu of every tile / dk-dv form
#     (benchmarks/gpu_ncu_session30.py: counters of the Triton, Gluon and Gluon-PREFETCH kernels).
# Usage (device machine, repository root): TOTAL=540 bash benchmarks/gpu_session31.sh   (writes under $OUT)
source benchmarks/gpu_lib.sh  # set -u, PYTHONPATH, TOTAL, SRL, $mem
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
tests() {  # $1 seconds, $2 pytest -k expression
  timeout "$1" python3 -m pytest -q -x tests/sparse/test_union_gluon.py -k "$2" > "$OUT/t_gluon.log" 2>&1
  echo "gluon tests rc=$? at ${SECONDS}s"; tail -3 "$OUT/t_gluon.log"
}
ab() {  # $1 s, $2 seqlens: Triton / Gluon / Gluon PREFETCH, forward, dq, keyq dk-dv (gpu_gluon_fwd_session29.py)
  timeout "$1" python3 benchmarks/gpu_gluon_fwd_session29.py --seqlens "$2" --budget $(($1 - 15)) \
    --tunes 32x2,32x2x0x1,64x2,64x2x0x1 --dq-tunes 64x2,64x2x1 --keyq-tunes 2x2x1,2x2x1x128x64x1 --reps 2 \
    --out "$OUT/pf31" > "$OUT/pf31.log" 2>&1
  echo "prefetch A/B rc=$? at ${SECONDS}s"; tail -c 3000 "$OUT/pf31.log"
}
if [ "$mem" -gt 100000 ] && [ "${ROLLOUT:-1}" = 1 ]; then
  timeout $((TOTAL - SECONDS - 150)) $SRL bench rollout --config recipes/rollout_bench_qwen3_4b.yaml \
    --long-new-tokens 16K --long-batches 32 --latency-contexts none --whole integrate -o "$OUT/ro_b32.json" \
    > "$OUT/ro_b32.log" 2>&1
  echo "rollout rc=$? at ${SECONDS}s"; grep -v "^- " "$OUT/ro_b32.log" | tail -25
  left=$((TOTAL - SECONDS)); [ $left -gt 60 ] && tests 50 "dkdv"
  left=$((TOTAL - SECONDS)); [ $left -gt 60 ] && ab $((left - 5)) 32768
else
  # the warp-specialized dk/dv's GPU test first, alone (a wrong mbarrier count would hang, not fail)
  timeout 90 python3 -m pytest -q -x tests/sparse/test_union_gluon.py -k "dkdv and tune5" > "$OUT/t_ws.log" 2>&1
  echo "ws tests rc=$? at ${SECONDS}s"; tail -3 "$OUT/t_ws.log"
  ab $((TOTAL - SECONDS - 100)) 32768  # the timings (each row also checks its result against Triton's)
  left=$((TOTAL - SECONDS)); [ $left -gt 40 ] && tests $((left > 230 ? 130 : left - 10)) "not rejects"
  left=$((TOTAL - SECONDS)); [ $left -gt 90 ] && ncu_tiles $((left - 10)) ncu31
fi
