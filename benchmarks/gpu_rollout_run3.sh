#!/usr/bin/env bash
# One device call (about 9 minutes): checks and select timing after the linear-bin change, the eager
# decode step by context with its kernel profile, then 8K- and 16K-token generations, dense vs sparse,
# batch 64 (eager CUDA graphs: the engine's default). COMPILE=1 runs only the generations, with the
# compiled step: every engine compiles its own variants (23-36 s each on the H200, 5 in all), so the
# checks and the profile are left out to stay inside one 10-minute call. Run from the repo root;
# writes under $OUT.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${COMPILE:-0}" = 1 ]; then C=--compile; T=560; else C=--no-compile; T=400
timeout 80 python benchmarks/gpu_rollout_step.py --out "$OUT" --no-compile-bench 2>&1 | grep -v -i warn | tail -20
timeout 50 python benchmarks/gpu_rollout_eager.py --out "$OUT" --batches 64 --contexts 4096,16384 2>&1 | grep -v -i warn | tail -8
fi
timeout $T python -m sparse_rl.cli.main bench rollout --no-hf --no-eager $C --batch 64 --new-tokens 8 \
    --long-batch 64 --long-new-tokens 8K,16K --out "$OUT/rollout_long.json" > "$OUT/rollout_long.md" 2> "$OUT/rollout_long.log"
grep -v "^\s*$" "$OUT/rollout_long.log" | tail -12
cat "$OUT/rollout_long.md"
