#!/usr/bin/env bash
# One device call (about 9 minutes) for what issue #4 still lacks. Run from the repo root:
#     bash benchmarks/gpu_rollout_long.sh        # writes under $OUT
# 1. The compiled decode step against the eager one at batch 64 and 16, dense and sparse, contexts
#    16K/8K/1K: logits agreement and CUDA-graph step times, saved row by row. Before this, only
#    batch 16 dense had been measured.
# 2. 16K-token generations, dense vs sparse, batch 64, with the compiled step: tokens/s. Batch 64 is
#    used because at batch 16 a Qwen2-0.5B-shaped model's decode step is mostly fixed cost, and the
#    index keys (128 B a token a layer) are already a quarter of its K/V (512 B): see
#    benchmarks/NOTES.md, "Rollouts".
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 250 python - <<'PY' 2>&1 | grep -v Warning | tail -30
import json, os
from sparse_rl.eval.bench_rollout import compile_step_bench, markdown_compile
out = os.environ.get("OUT", "/tmp/out")
def save(r):
    json.dump(r, open(f"{out}/compile_step.json", "w"), indent=1)
    open(f"{out}/compile_step.md", "w").write(markdown_compile(r))
r = compile_step_bench(batches=(64, 16), contexts=(16384, 8192, 1024), reps=20, on_result=save)
save(r)
print(markdown_compile(r))
PY
timeout 300 python -m sparse_rl.cli.main bench rollout --no-hf --no-eager --compile --batch 64 --new-tokens 8 \
    --long-batch 64 --long-new-tokens 16K --out "$OUT/rollout_long.json" > "$OUT/rollout_long.md" 2> "$OUT/rollout_long.log"
tail -5 "$OUT/rollout_long.log"
cat "$OUT/rollout_long.md"
