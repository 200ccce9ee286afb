#!/usr/bin/env bash
# The evidence recipe in one device call on one H200 (each part well under its 10 minutes), its
# processes sharing the card: a 5.5M model leaves most of it idle.
#   1. a speed probe sizes the pre-training / SFT steps to the budget; part 1 in two size variants
#      side by side (A: every token of 32-row tables; C: the solutions alone, 16-row tables); held-out accuracy (greedy, dense and sparse) of each SFT policy; the variant in
#      the 20-70% band (else the most accurate) goes on;
#   2. part 2: the four GRPO modes, one process each, side by side;
#   3. part 3: the five policies, one process each; then one pass without ONLY writes RESULTS.md.
# $OUT gets small.tgz (every log, metric, score and the report; no weights) and handoff.tgz.* (the
# chosen part-1 hand-off, 15 MB pieces, for a re-run of parts 2-3 elsewhere).
#   usage: bash benchmarks/gpu_evidence_run.sh BUDGET_S      (DEV=cpu SIZE=cpu ... for a CPU rehearsal)
set -u
budget=${1:-560}
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( budget - $(el) )); }
R=${EVDIR:-/tmp/ev}; mkdir -p $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
srl() { python -m sparse_rl.cli.main "$@"; }
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv 2>&1 | tee $R/gpu.txt
git rev-parse HEAD 2>/dev/null >$R/commit.txt; date -u +%FT%TZ >>$R/commit.txt

# -- speed probe: 16 pre-training steps of two processes side by side
probe_one() {
    local d=$R/speed$1
    srl model init $d/base --size ${EV_MODEL:-small} --seed 0 >/dev/null 2>&1
    srl synth lookup --num-tasks 600 --seed 9 --keys ${PROBE_KEYS:-32} --hops ${PROBE_HOPS:-4} --out $d/t.jsonl >/dev/null 2>&1
    srl sft $d/base --data $d/t.jsonl --out $d/pre --loss-on all --seq-len ${PRE_SEQ:-1024} --batch-size ${PRE_BS:-64} \
        --steps 16 --lr 1e-3 --dtype float32 --mixed-precision ${MIXED:-bf16} --device ${DEV:-cuda} >/dev/null 2>>$R/speed.log
}
probe_one 1 & probe_one 2 & wait
step_s=$(python -c "
import json,statistics
t=[json.loads(l)['step_time_s'] for i in (1,2) for l in open('$R/speed%d/pre.run/metrics.jsonl'%i) if json.loads(l)['step']>4]
print(statistics.median(t))" 2>/dev/null || echo 0.13)
pre_steps=$(python -c "print(max(50, min(6000, int(${PRE_BUDGET_S:-150} / $step_s))))")
sft_steps=$(python -c "print(max(30, min(2000, int(${SFT_BUDGET_S:-70} / ($step_s * 2.0)))))")
echo "probe: $step_s s/step, two processes -> pre_steps $pre_steps, sft_steps $sft_steps (at $(el) s)" | tee $R/speed.txt

# -- part 1, two variants
variant() {
    local name=$1; shift
    (export PART=1 EV_PRE_STEPS=$pre_steps EV_SFT_STEPS=$sft_steps "$@"
     timeout ${PART1_S:-330} bash recipes/evidence/run.sh $R/$name >$R/$name.log 2>&1; echo "rc=$?" >>$R/$name.log) &
}
variant A                                                      # the planned sizes
variant C EV_PRE_LOSS=assistant EV_PRE_KEYS=16 EV_PRE_LR=2e-3  # the loss on the look-ups alone, short tables first
wait
echo "part 1 done at $(el) s"
score_sft() {  # VARIANT ATTENTION
    local h=$R/$1/part1/handoff
    srl generate $h --prompts $h/heldout.jsonl --out $R/$1/sft-$2.jsonl --attention $2 --temperature 0 \
        --max-new-tokens 64 --max-batch 256 --device ${DEV:-cuda} >/dev/null 2>>$R/$1.log
    python -c "from sparse_rl.eval import evidence; import json; print('$1 $2', json.dumps(evidence.score_file('$R/$1/sft-$2.jsonl', '$h/heldout.jsonl', '$R/$1/sft-acc-$2.json')))"
}
for v in A C; do [ -f $R/$v/part1/handoff/config.json ] && { score_sft $v dense & score_sft $v sparse & }; done; wait
cat $R/*/sft-acc-*.json 2>/dev/null | tee $R/acc.txt
best=$(python - "$R" <<'EOF'
import json, pathlib, sys
best, key = "", None
for v in "AC":
    f = pathlib.Path(sys.argv[1]) / v / "sft-acc-dense.json"
    if f.is_file():
        a = json.loads(f.read_text())["accuracy"]
        k = (0.2 <= a <= 0.7, a)  # in the band first, then the most accurate
        if key is None or k > key:
            best, key = v, k
print(best)
EOF
)
echo "chosen variant: ${best:-none} at $(el) s" | tee -a $R/acc.txt

# -- parts 2 and 3 on the chosen variant, one process per mode / policy
if [ -n "$best" ]; then
    E=$R/$best
    for m in dense sparse sparse-tis sparse-distill; do
        (export PART=2 ONLY=$m; timeout $(( $(left) - ${PART3_S:-110} )) bash recipes/evidence/run.sh $E >$R/p2-$m.log 2>&1; echo "rc=$?" >>$R/p2-$m.log) &
    done; wait
    echo "part 2 done at $(el) s"
    for p in sft dense sparse sparse-tis sparse-distill; do
        (export PART=3 ONLY=$p; timeout $(( $(left) - 25 )) bash recipes/evidence/run.sh $E >$R/p3-$p.log 2>&1; echo "rc=$?" >>$R/p3-$p.log) &
    done; wait
    echo "part 3 done at $(el) s"
    # the whole run once more: every finished stage is skipped; writes commands.sh and RESULTS.md
    timeout 20 bash recipes/evidence/run.sh $E >$R/final.log 2>&1; echo "final rc=$?" >>$R/final.log
fi
cd $R && tar czf $OUT/small.tgz --exclude='*.safetensors' --exclude='checkpoints' --exclude='handoff' \
    --exclude='pretrain.jsonl' --exclude='sft.jsonl' --exclude='grpo.jsonl' --exclude='speed*' \
    *.log *.txt A C 2>/dev/null
[ -n "$best" ] && tar czf - $best/part1/handoff | split -b 15M - $OUT/handoff.tgz.
ls -la $OUT; tail -n 3 $R/*.log | cut -c1-300; cat $R/acc.txt; echo "total $(el) s"
