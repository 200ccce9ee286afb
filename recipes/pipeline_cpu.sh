#!/usr/bin/env bash
# Every stage chained through the CLI on a tiny model, on a CPU (a few minutes). The same chain on a
# GPU with a real checkpoint: replace the model-init line by your HF dir and raise the sizes.
# Launch: bash recipes/pipeline_cpu.sh [WORKDIR]
set -euo pipefail
W=${1:-runs/pipeline}
mkdir -p "$W"
dev=(--device cpu)

# 1. a tiny model, converted to DSA: k = 32 keys per query (L/8 at 256 tokens), layer 0 kept dense
sparse-rl model init "$W/dense" --arch qwen2 --size tiny --force
sparse-rl convert "$W/dense" "$W/sparse" --index-topk 32 --index-heads 4 --index-dim 32 --sink 2 --window 4 --dense-layers 0 --force

# 2. give the random model attention structure (LM training, sparse stage with k = L, i.e. dense),
#    then the indexer warm-up at k = 32 (KL to the dense attention), and measure it
sparse-rl indexer train "$W/sparse" --out "$W/pretrained" --stage sparse --index-topk 256 --seq-len 256 --batch-size 4 \
  --steps 100 --model-lr 3e-3 --lr 0 "${dev[@]}" --force > /dev/null
sparse-rl indexer train "$W/pretrained" --out "$W/indexer" --stage warmup --index-topk 32 --seq-len 256 --batch-size 4 \
  --steps 60 --lr 3e-3 "${dev[@]}" --force > /dev/null
sparse-rl indexer eval "$W/indexer" --seq-len 256 --rows 4 "${dev[@]}" > "$W/indexer_eval.json"

# 3. verifiable tasks, sparse generation piped into math scoring
sparse-rl synth math --num-tasks 32 --seed 0 --families arith --max-level 1 --out "$W/tasks.jsonl" --stats "$W/tasks_stats.json" --force
sparse-rl generate "$W/indexer" --prompts "$W/tasks.jsonl" --attention sparse --max-new-tokens 24 --temperature 0 "${dev[@]}" \
  | tee "$W/completions.jsonl" | sparse-rl eval math --score - --problems "$W/tasks.jsonl" > "$W/eval_math.json"

# 4. GRPO with sparse rollouts + LoRA distillation (a few steps); sparse-vs-dense fidelity on the completions
sparse-rl grpo "$W/indexer" --tasks "$W/tasks.jsonl" --out "$W/grpo" --mode sparse+distill --samples 4 --keep 2 \
  --prompts-per-step 4 --max-new-tokens 24 --steps 2 --lr 1e-4 "${dev[@]}" > /dev/null
sparse-rl eval fidelity "$W/indexer" --data "$W/completions.jsonl" --out "$W/fidelity" --max-tokens 256 "${dev[@]}" --force > /dev/null

# 5. needle in a haystack, dense and sparse side by side (heatmaps in $W/niah)
sparse-rl eval niah "$W/indexer" --kinds single --lengths 256,512 --depths 0.1,0.5,0.9 --per-cell 2 \
  --max-new-tokens 8 --out "$W/niah" "${dev[@]}" --force > /dev/null
echo "pipeline done: $W"
