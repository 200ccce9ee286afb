#!/usr/bin/env bash
# The evidence recipe in one device call on one H200 (each part well under its 10 minutes), its
# processes sharing the card: a 5.5M model leaves most of it idle.
#   1. part 1, then the held-out accuracy
#      (greedy, dense and sparse) of the SFT policy;
#   2. part 2: the four GRPO modes, one process each, side by side;
#   3. part 3: the five policies, one process each; then one pass without ONLY writes RESULTS.md.
# $OUT gets small.tgz (every log, metric, score and the report; no weights) and handoff.tgz.* (the
# part-1 hand-off, 15 MB pieces, for a re-run of parts 2-3 elsewhere).
#   usage: bash benchmarks/gpu_evidence_run.sh BUDGET_S      (DEV=cpu SIZE=cpu ... for a CPU rehearsal)
#          HANDOFF_FROM=DIR EV_GRPO_SEED=1 bash benchmarks/gpu_evidence_run.sh BUDGET_S   (parts 2-3 again)
set -u
budget=${1:-560}
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( budget - $(el) )); }
R=${EVDIR:-/tmp/ev}; mkdir -p $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true  # sft tokenizes a file in batched, parallel calls
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the device has the tree, not an installed package
srl() { python -m sparse_rl.cli.main "$@"; }
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv 2>&1 | tee $R/gpu.txt
echo "${EV_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" >$R/commit.txt; date -u +%FT%TZ >>$R/commit.txt  # a copied tree may carry an older .git: pass EV_COMMIT

# -- step counts: the recipe's (SIZES["gpu"] in recipes/evidence/run.py), or PRE_STEPS / SFT_STEPS.
#    Session 7 measured part 1 at those counts (2,400 + 200 steps): 224 s of stages on the H200. A
#    12-step speed probe used before read 0.029-0.037 s a step while the stages then ran 0.035-0.059
#    s a step with their data loading and checkpoints, so two runs sized by it overran part 1's time.
steps=(); [ -n "${PRE_STEPS:-}" ] && steps+=(EV_PRE_STEPS=$PRE_STEPS); [ -n "${SFT_STEPS:-}" ] && steps+=(EV_SFT_STEPS=$SFT_STEPS)
echo "steps: ${steps[*]:-as in the recipe}" | tee $R/steps.txt

# -- part 1, or (HANDOFF_FROM=DIR holding an earlier call's handoff.tgz.*) its hand-off unpacked:
#    parts 2-3 again from the same SFT policy, e.g. with another GRPO seed (EV_GRPO_SEED=1)
E=$R/A; H=$E/part1/handoff
if [ -n "${HANDOFF_FROM:-}" ]; then
    cat "$HANDOFF_FROM"/handoff.tgz.* | tar xzf - -C $R && echo "hand-off from $HANDOFF_FROM" | tee $R/A.log
else
    (export PART=1 ${steps[@]+"${steps[@]}"}
     timeout ${PART1_S:-330} bash recipes/evidence/run.sh $R/A >$R/A.log 2>&1; echo "rc=$?" >>$R/A.log)
fi
echo "part 1 done at $(el) s"
score_sft() {  # ATTENTION: greedy held-out accuracy of the SFT policy
    srl generate $H --prompts $H/heldout.jsonl --out $E/sft-$1.jsonl --attention $1 --temperature 0 \
        --max-new-tokens 64 --max-batch 256 --device ${DEV:-cuda} >/dev/null 2>>$R/A.log
    python -c "from sparse_rl.eval import evidence; import json; print('sft $1', json.dumps(evidence.score_file('$E/sft-$1.jsonl', '$H/heldout.jsonl', '$E/sft-acc-$1.json')))"
}
[ -f $H/config.json ] && [ -z "${HANDOFF_FROM:-}" ] && { score_sft dense & score_sft sparse & wait; }
cat $E/sft-acc-*.json 2>/dev/null | tee $R/acc.txt
echo "part-1 hand-off: $([ -f $H/config.json ] && echo $H || echo none) at $(el) s" | tee -a $R/acc.txt

# -- parts 2 and 3, one process per mode / policy (PARTS=1: part 1 alone)
if [ -f $H/config.json ] && [ "${PARTS:-123}" != 1 ]; then
    for m in dense sparse sparse-tis sparse-distill; do
        (export PART=2 ONLY=$m; timeout $(( $(left) - ${PART3_S:-110} )) bash recipes/evidence/run.sh $E >$R/p2-$m.log 2>&1; echo "rc=$?" >>$R/p2-$m.log) &
    done; wait
    echo "part 2 done at $(el) s"
    for p in sft dense sparse sparse-tis sparse-distill; do
        (export PART=3 ONLY=$p; timeout $(( $(left) - 25 )) bash recipes/evidence/run.sh $E >$R/p3-$p.log 2>&1; echo "rc=$?" >>$R/p3-$p.log) &
    done; wait
    echo "part 3 done at $(el) s"
    # the whole run once more: every finished stage is skipped; writes commands.sh and RESULTS.md
    (export PART=$([ -n "${HANDOFF_FROM:-}" ] && echo 2,3 || echo all)  # from a hand-off: part 1's stages never ran here
     timeout 20 bash recipes/evidence/run.sh $E >$R/final.log 2>&1; echo "final rc=$?" >>$R/final.log)
fi
[ -f $H/heldout.jsonl ] && cp $H/heldout.jsonl $E/part1/heldout.jsonl  # the report's hop grid reads it; handoff/ stays out
cd $R && tar czf $OUT/small.tgz --exclude='*.safetensors' --exclude='checkpoints' --exclude='handoff' \
    --exclude='pretrain*.jsonl' --exclude='sft.jsonl' --exclude='grpo.jsonl' \
    *.log *.txt A 2>/dev/null
[ -f $H/config.json ] && [ -z "${HANDOFF_FROM:-}" ] && tar czf - A/part1/handoff | split -b 15M - $OUT/handoff.tgz.
ls -la $OUT; tail -n 3 $R/*.log | cut -c1-300; cat $R/acc.txt; echo "total $(el) s"
